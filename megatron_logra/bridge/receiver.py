"""The engine process's side of delta pushes: check every payload, then hand it to the workers.

Lives in the engine process (``engine_server``, for an engine started with
``delta_sync``). The workers apply deltas in place to vLLM's live, sharded parameters
(``vllm_worker.VllmWorkerExtension``); an exception inside a worker would kill the engine,
so everything is checked here first, against the model's HF shapes, and a refusal
(``PushRefused``) leaves the engine serving its previous version. Full pushes to such an
engine are copied in place too (``load``), not reloaded through vLLM. Memory: no copy
of the weights (the engine's own parameters are the ones updated).
"""

from __future__ import annotations

import torch

from megatron_logra.bridge.sketch_delta import check_updates
from megatron_logra.bridge.sparse_delta import check_deltas
from megatron_logra.model.arch import load_arch
from megatron_logra.model.hf_mapping import hf_param_shapes
from megatron_logra.bridge.protocol import PushRefused, WorkerRPC, call_workers


class InPlaceReceiver:
    """Checks pushes and has every worker apply them in place to its live weights; reads the live weights back in HF coordinates."""

    def __init__(self, model_dir: str, dtype: str):
        """model_dir: the engine's start-up folder (config.json)."""
        self.arch = load_arch(model_dir)
        self.shapes = hf_param_shapes(self.arch)
        self.dtype = getattr(torch, dtype)
        # what check_deltas compares against: shapes and the engine dtype, no storage
        self.meta = {n: torch.empty(s, dtype=self.dtype, device="meta")
                     for n, s in self.shapes.items()}

    def check_layout(self, llm) -> None:
        """Refuse to start when a worker's parameters are not where deltas would go."""
        problems = [p for worker in call_workers(llm, WorkerRPC.CHECK_LAYOUT) for p in worker]
        if problems:
            raise RuntimeError("in-place weight updates are not possible on this engine: "
                               + "; ".join(problems[:5]))

    def check_full(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            shape = self.shapes.get(name)
            if shape is None or tuple(t.shape) != shape:
                raise PushRefused(f"weight push: {name} {tuple(t.shape)} does not match the "
                                  f"engine's {shape}")

    def load(self, llm, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket of a full push, copied in place into every worker's pieces of the live
        parameters (checked first); returns the bytes received."""
        self.check_full(tensors)
        call_workers(llm, WorkerRPC.SET, tensors)
        return sum(t.numel() * t.element_size() for _, t in tensors)

    def sketch_delta(self, llm, payload) -> int:
        """Apply (sketch updates, full tensors) in place on every worker; checked first."""
        updates, full = payload
        self.check_full(full)
        try:
            check_updates(self.arch, updates, self.shapes)
        except ValueError as exc:
            raise PushRefused(str(exc)) from None
        call_workers(llm, WorkerRPC.SKETCH_DELTA, updates)
        if full:
            call_workers(llm, WorkerRPC.SET, [(n, t.to(self.dtype)) for n, t in full])
        return sum(u.nbytes() for u in updates) + sum(t.numel() * t.element_size()
                                                      for _, t in full)

    def sparse_delta(self, llm, deltas) -> int:
        """Set the changed elements in place on every worker (all checked first)."""
        try:
            check_deltas(deltas, self.meta)
        except ValueError as exc:
            raise PushRefused(str(exc)) from None
        call_workers(llm, WorkerRPC.SPARSE_DELTA, deltas)
        return sum(d.nbytes() for d in deltas)

    def fingerprints(self, llm, names: list[str]) -> dict[str, float]:
        """``bridge.fingerprint`` of the live HF tensors (the workers' shares added up)."""
        self._check_names(names)
        shares = call_workers(llm, WorkerRPC.FINGERPRINTS, names)
        return {n: sum(worker[n] for worker in shares) for n in names}

    def weights(self, llm, names: list[str]) -> dict[str, torch.Tensor]:
        """The live weights as whole HF tensors, put together from every worker's pieces."""
        self._check_names(names)
        out = {n: torch.full(self.shapes[n], float("nan"), dtype=self.dtype) for n in names}
        for worker in call_workers(llm, WorkerRPC.PIECES, names):
            for name, row0, row1, col0, values in worker:
                target = out[name][row0:row1]
                (target if col0 is None else target[:, col0:col0 + values.shape[1]]).copy_(values)
        return out

    def _check_names(self, names: list[str]) -> None:
        unknown = [n for n in names if n not in self.shapes]
        if unknown:
            raise PushRefused(f"the engine holds no tensors named {unknown[:3]}")
