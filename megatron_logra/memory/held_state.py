"""The model state one rank holds, by category, from its live objects (every tensor the
model, DDP and the optimizers hold, each storage counted once).

What ``rank_bytes.model_state`` predicts, counted: ``benchmarks/_train_probe.py`` counts it
on a rank that trains, the dry run (``dry_run.trace``) on a rank traced on fake tensors
(storages are told apart by identity, not address: a fake tensor has none).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    """{storage identity: its bytes} of ``tensors`` (empty ones and None skipped). torch
    keeps one Python object per storage, so views of one storage share its key."""
    out = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage") and t.numel():
            storage = t.untyped_storage()
            out[id(storage)] = storage.nbytes()
    return out


def optimizer_tensors(megatron_opt) -> Iterator[torch.Tensor]:
    """Every tensor a megatron optimizer holds: inner torch state and its fp32 main params."""
    from megatron_logra.runtime.megatron_optimizer import (fp32_main_copies, sub_optimizers,
                                                            torch_optimizers)

    for inner in torch_optimizers(megatron_opt):
        for state in inner.state.values():
            yield from (v for v in state.values() if hasattr(v, "untyped_storage"))
        for group in inner.param_groups:
            yield from group["params"]  # fp32 main shards (or the params themselves)
    for sub in sub_optimizers(megatron_opt):
        yield from fp32_main_copies(sub)


def model_state_bytes(objs) -> dict[str, int]:
    """Bytes by category of ``objs`` (``training.build.TrainingObjects``), each storage
    counted once (params first, so views are not doubled): params, grads (DDP's buffers),
    dense_optimizer (megatron's mains and Adam moments), LoGRA's (``logra_*``), total.
    Adam creates its moments at its first step: count after one."""
    model = objs.model[0]
    params = storage_bytes(list(model.parameters())
                           + [b.param_data for b in model.buffers if b.param_data is not None])
    grads = {k: v for k, v in storage_bytes([b.grad_data for b in model.buffers]).items()
             if k not in params}
    opt = {k: v for k, v in storage_bytes(list(optimizer_tensors(objs.dense_optimizer))).items()
           if k not in params and k not in grads}
    out = {"params": sum(params.values()), "grads": sum(grads.values()),
           "dense_optimizer": sum(opt.values())}
    if objs.logra is not None:
        out.update({f"logra_{k}": v for k, v in objs.logra.state_bytes().items()})
    out["total"] = sum(out.values())
    return out
