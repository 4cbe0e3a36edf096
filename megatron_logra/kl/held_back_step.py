"""Scaling a megatron-core optimizer's step after it is taken (megatron-core 0.16.x).

Not a patch: no megatron function is replaced or changed. The optimizer internals it
needs (sub-optimizers, main params, their fp32 copies, the main -> model copy and the DP
all-gather) are read through ``runtime.megatron_optimizer``, the one module tied to
their layout; ``HeldBackStep`` refuses another megatron-core version
(``runtime.versions``, as the patches do).

Why: predicted-KL control needs the update direction before it is applied, and Adam's
direction exists only once Adam has stepped (its moments advance once, as usual).
``HeldBackStep`` snapshots the params, lets megatron step, turns the change into the
model-layout tangent, restores the model to the old weights for the tangent pass, and
finally applies ``old + alpha * (new - old)`` to the main params (copied to the model
params and all-gathered over DP as megatron's own step does). With alpha = 1 the result
equals megatron's step up to one fp32 rounding.

The tangent of a bf16 param is its fp32 main param's change (placed by megatron's own
main -> model mapping: ``float16_groups`` / ``fp32_from_float16_groups``, or the
distributed optimizer's shard ranges, summed over DP), in the param's dtype. The bf16
params' own difference would be wrong: a realistic step (lr 1e-6) is far below bf16's
resolution, so most elements do not change and the rest move by one ulp.

Memory while stepping: one fp32 copy of the main params this rank steps and one copy
of the stepped model params in their dtype (under LoGRA only the small unsketched ones).
"""

from __future__ import annotations

import torch

from megatron_logra.runtime import versions
from megatron_logra.runtime.megatron_optimizer import (copy_main_to_model, data_parallel_group,
                                                        fp32_copies, gather_model_params,
                                                        main_params, sub_optimizers)


class HeldBackStep:
    """snapshot() -> megatron step -> tangents() -> (tangent pass) -> apply(alpha)."""

    def __init__(self, optimizer, model_params: dict[str, torch.nn.Parameter]):
        """model_params: the stepped model params by name (those that require grad)."""
        versions.require("megatron-core", "megatron_logra.kl.held_back_step")
        self.subs = sub_optimizers(optimizer)
        self.model_params = model_params
        storages = {id(p.untyped_storage()) for p in model_params.values()}
        self.mains = [main_params(sub) for sub in self.subs]
        # a main param that lives in a model param's storage is restored with the model
        self.shared = [[id(m.untyped_storage()) in storages for m in mains]
                       for mains in self.mains]
        self.main_deltas: list[list[torch.Tensor]] = []
        self.old_model: dict[str, torch.Tensor] = {}

    def snapshot(self) -> None:
        self.main_deltas = [[m.detach().clone() for m in mains] for mains in self.mains]
        self.old_model = {n: p.detach().clone() for n, p in self.model_params.items()}

    @torch.no_grad()
    def tangents(self) -> dict[str, torch.Tensor]:
        """After megatron's step: the update of every model param [its shape] (the tangent);
        the model params are back at their old values."""
        for mains, deltas in zip(self.mains, self.main_deltas):
            for m, d in zip(mains, deltas):
                d.sub_(m).neg_()  # new - old
        from_mains = self._tangents_from_mains()
        out = {}
        for name, p in self.model_params.items():
            old = self.old_model[name]
            out[name] = from_mains[id(p)] if id(p) in from_mains else p.detach() - old
            p.copy_(old)
        self.old_model = {}
        return out

    def _tangents_from_mains(self) -> dict[int, torch.Tensor]:
        """id(model param) -> its tangent, for the lower-precision params: the fp32 copies'
        changes placed in one flat buffer per dtype that lists every such stepped param in
        the same order on every rank (so shards line up), summed over DP when the
        distributed optimizer gives each rank a shard (each element is owned once: the sum
        is exact)."""
        flats, offsets, dp_group = {}, {}, None
        for p in self.model_params.values():
            if p.dtype != torch.float32:
                size = flats.get(p.dtype, 0)
                offsets[id(p)], flats[p.dtype] = size, size + p.numel()
        flats = {dtype: torch.zeros(n, dtype=dtype, device=next(iter(
            self.model_params.values())).device) for dtype, n in flats.items()}
        for sub, mains, deltas in zip(self.subs, self.mains, self.main_deltas):
            copies = fp32_copies(sub)
            for main, delta in zip(mains, deltas):
                if id(main) in copies:
                    param, start, end = copies[id(main)]
                    base = offsets[id(param)]
                    flats[param.dtype][base + start:base + end] = delta.view(-1)
            dp_group = data_parallel_group(sub) or dp_group
        if dp_group is not None and torch.distributed.get_world_size(dp_group) > 1:
            for flat in flats.values():
                torch.distributed.all_reduce(flat, group=dp_group)
        return {id(p): flats[p.dtype][offsets[id(p)]:offsets[id(p)] + p.numel()].view_as(p)
                for p in self.model_params.values() if id(p) in offsets}

    @torch.no_grad()
    def apply(self, alpha: float) -> None:
        """Main params <- old + alpha (new - old); model params follow as in megatron's step."""
        for sub, mains, deltas, shared in zip(self.subs, self.mains, self.main_deltas,
                                              self.shared):
            for m, d, is_shared in zip(mains, deltas, shared):
                if is_shared:  # back at old with the model params
                    m.add_(d, alpha=alpha)
                else:  # still at new
                    m.sub_(d, alpha=1.0 - alpha)
            if not all(shared):
                copy_main_to_model(sub)
            gather_model_params(sub)
        self.main_deltas = []

    def discard(self) -> None:
        """The step was skipped (non-finite grads): nothing changed."""
        self.main_deltas, self.old_model = [], {}
