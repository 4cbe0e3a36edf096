"""Mixed into every vLLM worker (``worker_extension_cls``): receive weights, track versions.

Imported by the vLLM worker only, never by the trainer. Method names carry an
``mlogra_`` prefix: vLLM refuses extension methods that shadow the Worker's own.

A push is ``mlogra_load`` per bucket of HF-named tensors (vLLM's own
``reload_weights`` maps HF names onto its fused, sharded, repacked parameters),
then ``mlogra_commit(version)``. A tied lm_head is re-tied to the new embedding after
each bucket that carries it (vLLM's reload would keep its old copy). Between the first bucket and the commit the
worker reports ``version = -1`` (a push in flight), and the engine refuses to
generate with such a worker (``engine.RolloutEngine`` checks before every batch).
"""

from __future__ import annotations

import torch


class WeightReceiver:
    def mlogra_load(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full HF tensors; returns the bytes received."""
        self._mlogra_version = -1
        self.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        if any(name == "model.embed_tokens.weight" for name, _ in tensors):
            self._mlogra_retie_lm_head()
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def _mlogra_retie_lm_head(self) -> None:
        """A tied lm_head loads no weights of its own, so vLLM's reload puts its old kernel
        tensors back (on CPU: the old packed GEMM copy). Point it at the new embedding and
        rerun its post-load processing (the repack on CPU; nothing on GPU)."""
        model = self.model_runner.get_model()
        if not getattr(model.config, "tie_word_embeddings", False):
            return
        lm_head, embed = model.lm_head, model.model.embed_tokens
        lm_head.weight = embed.weight
        lm_head.quant_method.process_weights_after_loading(lm_head)

    def mlogra_commit(self, version: int) -> int:
        self._mlogra_version = int(version)
        return self._mlogra_version

    def mlogra_version(self) -> int:
        return getattr(self, "_mlogra_version", 0)
