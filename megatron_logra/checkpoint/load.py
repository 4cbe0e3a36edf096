"""Opening and loading a checkpoint: the one "open" (resolve, verify, read meta, check the
model) of training's resume, ``--finetune``, the converters and the parity tools.

``open_checkpoint(path, arch)`` -> ``(folder, meta)`` or a ValueError naming what is wrong
(no checkpoint there, a damaged file, another model). ``load_checkpoint`` loads weights,
optimizer state and the resumable parts into ``TrainingObjects``;
``load_model_weights`` the weights alone into a model. All collective: every rank calls.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from megatron.core import dist_checkpointing

from megatron_logra.checkpoint import layout, manifest
from megatron_logra.checkpoint.meta import CheckpointMeta, read_meta
from megatron_logra.checkpoint.sharded_state import (load_state_checked,
                                                     model_sharded_state_dict,
                                                     training_state_dict,
                                                     without_missing_added_params)
from megatron_logra.runtime.collectives import every_rank, rank_and_world
from megatron_logra.runtime.megatron_optimizer import materialize_adam_state, torch_optimizers


def damaged_files(ckpt: Path) -> list[str]:
    """The problems of checkpoint folder ``ckpt`` against its manifest, each naming its file;
    every file is hashed once over all ranks (collective). A checkpoint of format 1 (no
    manifest) has nothing to check."""
    rank, world = rank_and_world()
    try:
        meta = read_meta(ckpt)
        mine = manifest.check(ckpt, rank, world) if meta.format_version >= 2 else []
    except (OSError, ValueError) as exc:
        mine = [f"{ckpt / layout.META} is unreadable ({type(exc).__name__})"] if rank == 0 else []
    return [p for part in every_rank(mine) for p in part]


def open_checkpoint(path: str | os.PathLike, arch=None) -> tuple[Path, CheckpointMeta]:
    """The checkpoint folder ``path`` names (SAVE or one ``iter_*``) and its meta, checked
    against its manifest and, given ``arch``, against the model (collective)."""
    ckpt = layout.resolve_load_dir(path)
    problems = damaged_files(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems))
    meta = read_meta(ckpt)
    if arch is not None:
        meta.check_arch(arch, ckpt)
    return ckpt, meta


def find_resume_checkpoint(save_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of ``save_dir`` that verifies: the one ``latest`` selects, or
    failing that the newest older one (collective) -> (folder or None, why each newer one
    was passed over)."""
    root = Path(save_dir)
    if not root.is_dir():
        return None, []
    passed_over = []
    for ckpt in layout.resume_candidates(root):
        if not layout.is_complete(ckpt):
            passed_over.append(f"{ckpt}: {layout.META} is missing")
            continue
        problems = damaged_files(ckpt)
        if not problems:
            return ckpt, passed_over
        passed_over.append(f"{ckpt}: " + "; ".join(problems))
    return None, passed_over


def load_model_weights(path: str | os.PathLike, model: list, arch) -> CheckpointMeta:
    """Load only the weights of checkpoint ``path`` into ``model`` (this rank's chunks, any
    TP/PP layout); returns its meta. Added parameters (LoRA's adapters) the checkpoint
    lacks keep their values."""
    ckpt, meta = open_checkpoint(path, arch)
    model_sd, left_out = without_missing_added_params(ckpt, model, arch,
                                                     model_sharded_state_dict(model))
    loaded = dist_checkpointing.load({"model": model_sd}, str(ckpt))
    load_state_checked(model, loaded["model"], left_out)
    return meta


def load_checkpoint(path: str | os.PathLike, objs, *, weights_only: bool,
                    sharding: str) -> tuple[dict, CheckpointMeta]:
    """Load into ``TrainingObjects`` ``objs`` in place -> (the resumable parts' states,
    meta). ``weights_only`` skips the optimizer and the resumable parts (then refreshes
    the optimizers' main copies); otherwise ``sharding`` (``meta.optimizer_sharding``)
    must be the checkpoint's."""
    if weights_only:
        meta = load_model_weights(path, objs.model, objs.arch)
        objs.reload_main_params()
        return {}, meta
    ckpt, meta = open_checkpoint(path, objs.arch)
    meta.check_resumable(sharding, ckpt)
    materialize_adam_state(objs.dense_optimizer)
    state = training_state_dict(objs, is_loading=True, with_optimizer=True)
    state["extra"] = None
    loaded = dist_checkpointing.load(state, str(ckpt))
    load_state_checked(objs.model, loaded["model"], set())
    objs.optimizer.load_state_dict(loaded["optimizer"])
    for torch_opt in torch_optimizers(objs.dense_optimizer):
        # After load every param shares ONE step tensor; foreach AdamW would then
        # bump it once per param (megatron-core 0.16.1). Give each its own.
        for param_state in torch_opt.state.values():
            if isinstance(param_state.get("step"), torch.Tensor):
                param_state["step"] = param_state["step"].clone()
    return loaded.get("extra") or {}, meta
