"""Mixed into every vLLM worker (``worker_extension_cls``): receive weights, track versions.

Imported by the vLLM workers only, never by the trainer. The methods are the
``protocol.WorkerRPC`` names (the engine process calls them with ``collective_rpc``);
the module checks at import that each one exists.

Full push: ``mlogra_load`` per bucket of HF-named tensors (vLLM's own
``reload_weights`` maps HF names onto its fused, sharded parameters), then
``mlogra_commit(version)``; an engine started for deltas uses ``mlogra_set`` instead
(a copy into the live parameters). After a reload, a tied lm_head is re-tied to the new
embedding for each bucket that carries it (vLLM's reload would keep its old copy).
Between the first bucket and the commit the worker reports ``version = -1`` (a push in
flight), and the engine refuses to generate or score with such a worker
(``protocol.PushInFlight``).

Delta pushes (``mlogra_sketch_delta``, ``mlogra_sparse_delta``, ``mlogra_set``) are
applied in place to the live parameters, each worker to its own shard
(``bridge.vllm_layout``): the same code on CPU and GPU. Payloads were checked by the
engine process (``receiver``) before they get here: an exception in a worker kills the
engine.

The CPU patch that keeps vLLM's linear weights live (``weight_sync.cpu_live_weights``)
is applied at import in an engine started for deltas (``LIVE_WEIGHTS_ENV``).
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from megatron_logra.bridge.protocol import WorkerRPC
from megatron_logra.weight_sync.cpu_live_weights import LIVE_WEIGHTS_ENV, keep_cpu_weights_live


if os.environ.get(LIVE_WEIGHTS_ENV) == "1":
    keep_cpu_weights_live()


# vLLM's reload warns, per call, about every layer and tensor the call did not load; a
# bucket leaves most of them alone by design (hundreds of lines per push otherwise)
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


@contextmanager
def _quiet_partial_reload():
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


class VllmWorkerExtension:
    """The weight-receiving methods every vLLM worker gets (see the module doc)."""

    # --- full pushes ------------------------------------------------------------------------
    def mlogra_load(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of full HF tensors; returns the bytes received."""
        self._mlogra_version = -1
        with _quiet_partial_reload():
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

    # --- in place, on this worker's shards (``weight_sync.worker_shards``) -----------------
    def _mlogra_shards(self):
        from megatron_logra.weight_sync.worker_shards import WorkerShards

        if not hasattr(self, "_mlogra_worker_shards"):
            self._mlogra_worker_shards = WorkerShards(self.model_runner.get_model(),
                                                      self.model_config.model)
        return self._mlogra_worker_shards

    def mlogra_check_layout(self) -> list[str]:
        """Problems with in-place updates on this worker (empty: none)."""
        return self._mlogra_shards().layout_problems()

    @torch.inference_mode()
    def mlogra_sketch_delta(self, updates: list) -> int:
        """W -= c D A(seed) on this worker's pieces of every sketched weight (checked)."""
        from megatron_logra.bridge.sketch_delta import apply_updates_into

        self._mlogra_version = -1
        shards = self._mlogra_shards()
        return len(apply_updates_into(shards.arch, updates, shards.locator()))

    @torch.inference_mode()
    def mlogra_sparse_delta(self, deltas: list) -> int:
        from megatron_logra.bridge.sparse_delta import apply_deltas_into

        self._mlogra_version = -1
        return len(apply_deltas_into(deltas, self._mlogra_shards().locator()))

    @torch.inference_mode()
    def mlogra_set(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy whole HF tensors into this worker's pieces of them."""
        self._mlogra_version = -1
        locate = self._mlogra_shards().locator()
        for name, t in tensors:
            for target, p in locate(name):
                piece = t[p.row0:p.row1] if p.col0 is None else t[p.row0:p.row1, p.col0:p.col1]
                target[p.local_row:p.local_row + p.row1 - p.row0].copy_(piece)
        return len(tensors)

    # --- read back, in HF coordinates -------------------------------------------------------
    def mlogra_fingerprints(self, names: list[str]) -> dict[str, float]:
        """This worker's share of each tensor's fingerprint (its primary pieces)."""
        return self._mlogra_shards().fingerprints(names)

    def mlogra_pieces(self, names: list[str]) -> list[tuple[str, int, int, int | None, torch.Tensor]]:
        """This worker's primary pieces (name, row0, row1, col0, a CPU copy of the values)."""
        return self._mlogra_shards().pieces(names)


_MISSING = [rpc.value for rpc in WorkerRPC if not hasattr(VllmWorkerExtension, rpc.value)]
if _MISSING:
    raise ImportError(f"protocol.WorkerRPC names methods the worker extension lacks: {_MISSING}")
