"""Resharding checkpoints with megatron-core dist_checkpointing (torch_dist), written atomically.

The folder layout (``SAVE/latest``, ``SAVE/iter_*``) is ``model.checkpoint_dir``'s.
A checkpoint is written into ``*.partial``, renamed when every rank has
finished, and only then does ``latest`` (replaced atomically) point to it, so a
crash mid-save leaves the previous checkpoint intact and selected. Model and
optimizer state are sharded tensors with global shapes, so a checkpoint saved at
one TP/PP/DP loads at another (optimizer in the ``fully_reshardable`` format).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing

from megatron_logra.model.checkpoint_dir import (FORMAT_VERSION, LATEST, META, check_arch,
                                                 iter_dir_name, load_state_checked,
                                                 model_sharded_state_dict, read_meta,
                                                 resolve_load_dir, without_missing_added_params)

_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _megatron_optimizers(optimizer) -> list:
    """The megatron optimizers inside a ChainedOptimizer (or the optimizer itself); LoGRA's
    optimizer contributes the dense one it wraps."""
    optimizer = getattr(optimizer, "dense", optimizer)
    if optimizer is None:  # LoGRA with every unsketched parameter frozen
        return []
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def _inner_torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    return [opt.optimizer for opt in _megatron_optimizers(optimizer)
            if getattr(opt, "optimizer", None) is not None]


def _sharded_state_dict(objs, is_loading: bool, with_optimizer: bool) -> dict:
    model_sd = model_sharded_state_dict(objs.model)
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = objs.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                               metadata=_OPT_METADATA)
    return state


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_checkpoint(save_dir: str | os.PathLike, step: int, objs, extra_state: dict,
                    meta: dict) -> Path:
    """Save model + optimizer + ``extra_state`` (picklable, rank-0 common state) atomically."""
    root = Path(save_dir)
    final = root / iter_dir_name(step)
    partial_dir = root / (iter_dir_name(step) + ".partial")
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        root.mkdir(parents=True, exist_ok=True)
        if partial_dir.exists():
            shutil.rmtree(partial_dir)
        partial_dir.mkdir()
    _barrier()
    state = _sharded_state_dict(objs, is_loading=False, with_optimizer=True)
    state["extra"] = extra_state
    dist_checkpointing.save(state, str(partial_dir), content_metadata=None)
    _barrier()
    if rank0:
        full_meta = {"format_version": FORMAT_VERSION, "step": step, **meta}
        (partial_dir / META).write_text(json.dumps(full_meta, indent=1))
        stale = final.with_name(final.name + ".old")
        if final.exists():  # re-saving a step: keep the old copy until the new one is in place
            if stale.exists():
                shutil.rmtree(stale)
            os.replace(final, stale)
        os.replace(partial_dir, final)
        _write_text_atomic(root / LATEST, final.name + "\n")
        if stale.exists():
            shutil.rmtree(stale)
    _barrier()
    return final


def optimizer_sharding(use_distributed_optimizer: bool) -> str:
    return "distributed" if use_distributed_optimizer else "replicated"


def load_checkpoint(load: str | os.PathLike, objs, *, weights_only: bool,
                    sharding: str) -> tuple[dict, dict]:
    """Load into ``objs`` in place; returns (extra_state, meta).

    weights_only skips the optimizer; ``sharding`` (see ``optimizer_sharding``) must
    match the checkpoint's when the optimizer state is loaded.
    """
    ckpt = resolve_load_dir(load)
    meta = read_meta(ckpt)
    saved_sharding = meta.get("optimizer_sharding")
    if not weights_only and saved_sharding not in (None, sharding):
        flag = "with" if saved_sharding == "distributed" else "without"
        raise ValueError(f"checkpoint {ckpt} holds {saved_sharding} optimizer state; resume "
                         f"{flag} --use-distributed-optimizer, or pass --finetune to load only "
                         f"the weights")
    if not weights_only and meta.get("weights_only"):
        raise ValueError(f"checkpoint {ckpt} holds weights only (written by "
                         f"{meta.get('source', {}).get('tool', 'a converter')}): load it with "
                         f"--finetune")
    check_arch(meta, objs.arch, ckpt)
    if not weights_only:
        _materialize_optimizer_state(objs.optimizer)
    state = _sharded_state_dict(objs, is_loading=True, with_optimizer=not weights_only)
    left_out: set[str] = set()
    if weights_only:  # a base model's checkpoint: LoRA's adapters keep their fresh values
        state["model"], left_out = without_missing_added_params(ckpt, objs.model, objs.arch,
                                                                state["model"])
    else:
        state["extra"] = None
    loaded = dist_checkpointing.load(state, str(ckpt))
    load_state_checked(objs.model, loaded["model"], left_out)
    if not weights_only:
        objs.optimizer.load_state_dict(loaded["optimizer"])
        for torch_opt in _inner_torch_optimizers(objs.optimizer):
            # After load every param shares ONE step tensor; foreach AdamW would then
            # bump it once per param (megatron-core 0.16.1). Give each its own.
            for param_state in torch_opt.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()
    # Model params changed underneath the optimizer's fp32 main copies: refresh them.
    if weights_only:
        reload_main_params(objs.optimizer)
    return (loaded.get("extra") or {}), meta


def _materialize_optimizer_state(optimizer) -> None:
    """Give every param Adam state with one common ``step`` before loading into it.

    megatron-core 0.16.1's DistributedOptimizer.state_dict() asserts a single distinct
    step, which a never-stepped torch Adam lacks; the values are overwritten by the load.
    """
    for torch_opt in _inner_torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            for param in group["params"]:
                state = torch_opt.state[param]
                state.setdefault("exp_avg", torch.zeros_like(param))
                state.setdefault("exp_avg_sq", torch.zeros_like(param))
                state.setdefault("step", torch.tensor(0.0))


def reload_main_params(optimizer) -> None:
    """Refresh the optimizer's fp32 main copies after the model weights changed underneath."""
    reload_masters = getattr(optimizer, "reload_masters", None)
    if reload_masters is not None:
        reload_masters()
    for opt in _megatron_optimizers(optimizer):
        reload = getattr(opt, "reload_model_params", None)
        if reload is not None:
            reload()
