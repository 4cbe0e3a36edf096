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

from megatron_logra.model import checkpoint_verify as verify
from megatron_logra.model.checkpoint_dir import (FORMAT_VERSION, LATEST, META, check_arch,
                                                 checkpoint_problems,
                                                 iter_dir_name, load_state_checked,
                                                 model_sharded_state_dict, read_meta,
                                                 resolve_load_dir, without_missing_added_params)
from megatron_logra.runtime.faults import maybe_fail
from megatron_logra.training.megatron_optimizer import (materialize_adam_state,
                                                        reload_model_params, torch_optimizers)

_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


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


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, say): nothing of it was kept, and the
    previous checkpoint stays selected."""


def _rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _local_error(action) -> str:
    """Run ``action`` (local work of this rank); its OSError as text, or ""."""
    try:
        action()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def _gather(value) -> list:
    """Every rank's ``value``, in rank order (collective)."""
    parts = [None] * _rank_world()[1]
    if dist.is_initialized():
        dist.all_gather_object(parts, value)
    else:
        parts = [value]
    return parts


class _Save:
    """One checkpoint save in phases; every rank runs every collective whatever failed
    locally, and a phase that failed anywhere ends the save on every rank together."""

    def __init__(self, root: Path, step: int):
        self.root, self.final = root, root / iter_dir_name(step)
        self.partial = root / (iter_dir_name(step) + ".partial")
        self.step, self.rank0 = step, _rank_world()[0] == 0

    def check(self, error: str, what: str) -> None:
        errors = [e for e in _gather(error) if e]
        if errors:
            if self.rank0:
                shutil.rmtree(self.partial, ignore_errors=True)
            _barrier()
            raise CheckpointSaveError(
                f"checkpoint {self.final} not saved: {what} failed ({errors[0]}); the partial "
                f"save is removed and {self.root / LATEST} still selects the previous "
                f"checkpoint")

    def start(self) -> None:
        def make():
            self.root.mkdir(parents=True, exist_ok=True)
            if self.partial.exists():
                shutil.rmtree(self.partial)
            self.partial.mkdir()
        self.check(_local_error(make) if self.rank0 else "", f"creating {self.partial}")

    def write_state(self, state: dict) -> None:
        """megatron's torch_dist save (a write failure on any rank reaches every rank
        through torch's own collective reporting)."""
        try:
            dist_checkpointing.save(state, str(self.partial), content_metadata=None)
            error = ""
        except Exception as exc:  # noqa: BLE001 - every rank reports it below
            error = f"{type(exc).__name__}: {exc}"
        self.check(error, "writing the state")

    def write_meta(self, meta: dict) -> None:
        def write():
            maybe_fail("save-enospc", self.step)
            full_meta = {"format_version": FORMAT_VERSION, "step": self.step, **meta}
            (self.partial / META).write_text(json.dumps(full_meta, indent=1))
        self.check(_local_error(write) if self.rank0 else "", f"writing {META}")

    def write_manifest(self) -> None:
        """Every rank hashes its share of the files; rank 0 writes the manifest."""
        rank, world = _rank_world()
        entries: dict = {}

        def hash_mine():
            files = verify.checkpoint_files(self.partial)
            entries.update(verify.manifest_entries(
                self.partial, verify.files_for_rank(files, rank, world)))
        error = _local_error(hash_mine)
        parts = _gather(None if error else entries)
        if self.rank0 and not error:
            if any(part is None for part in parts):
                error = "hashing the files failed on another rank"
            else:
                error = _local_error(lambda: verify.write_manifest(
                    self.partial, {k: v for part in parts for k, v in part.items()}))
        self.check(error, f"writing {verify.MANIFEST}")

    def commit(self, keep: int | None) -> None:
        """Rank 0 moves the save in place and selects it (then prunes to ``keep``)."""
        if self.rank0:
            stale = self.final.with_name(self.final.name + ".old")
            if self.final.exists():  # re-saving a step: keep the old copy until the new one
                if stale.exists():     # is in place
                    shutil.rmtree(stale)
                os.replace(self.final, stale)
            os.replace(self.partial, self.final)
            _write_text_atomic(self.root / LATEST, self.final.name + "\n")
            if stale.exists():
                shutil.rmtree(stale)
            if keep:
                prune_checkpoints(self.root, keep)
        _barrier()


def save_checkpoint(save_dir: str | os.PathLike, step: int, objs, extra_state: dict,
                    meta: dict, keep: int | None = None) -> Path:
    """Save model + optimizer + ``extra_state`` (picklable, rank-0 common state) atomically,
    with a manifest of every file (size, CRC32) written last; ``keep``: then delete all but
    the newest ``keep`` checkpoints. A failure on any rank (``CheckpointSaveError``, on
    every rank) removes the partial save and leaves ``latest`` as it was."""
    save = _Save(Path(save_dir), step)
    save.start()
    state = _sharded_state_dict(objs, is_loading=False, with_optimizer=True)
    state["extra"] = extra_state
    save.write_state(state)
    maybe_fail("save", step)
    save.write_meta(meta)
    save.write_manifest()
    save.commit(keep)
    return save.final


def save_or_report(ck, step: int, objs, extra_state: dict, meta: dict, *,
                   last: bool) -> Path | None:
    """A training loop's save (``CheckpointConfig`` ``ck``): the checkpoint's folder, or None
    when an interval save failed (said on rank 0; the previous checkpoint stays selected
    and training goes on, so a full disk can be cleared while it runs). A failed save at
    the end of training raises: the run's last updates would be lost."""
    rank0 = _rank_world()[0] == 0
    try:
        saved = save_checkpoint(ck.save, step, objs, extra_state, meta, keep=ck.save_keep)
    except CheckpointSaveError as exc:
        if last:
            raise
        if rank0:
            print(f"warning: {exc}; training continues", flush=True)
        return None
    if rank0:
        print(f"saved checkpoint {saved}", flush=True)
    return saved


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` (>= 1) complete checkpoints of ``root``, never the
    one ``latest`` selects; returns the deleted folders."""
    selected = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else None
    done = sorted((p for p in root.glob("iter_*") if p.is_dir() and (p / META).is_file()),
                  key=lambda p: p.name)
    deleted = [p for p in done[:-keep] if p.name != selected] if keep >= 1 else []
    for path in deleted:
        shutil.rmtree(path)
    return deleted


def verify_checkpoint(ckpt: Path) -> list[str]:
    """The problems of a checkpoint folder against its manifest, every file checked once
    over all ranks (collective; ``checkpoint_dir.checkpoint_problems``)."""
    return [p for part in _gather(checkpoint_problems(ckpt, *_rank_world())) for p in part]


def find_resume_checkpoint(save_dir: str | os.PathLike) -> tuple[Path | None, list[str]]:
    """The newest checkpoint of ``save_dir`` that verifies: the one ``latest`` selects, or
    failing that the newest older one (collective) -> (folder or None, why each newer one
    was passed over)."""
    root = Path(save_dir)
    if not root.is_dir():
        return None, []
    selected = (root / LATEST).read_text().strip() if (root / LATEST).is_file() else ""
    candidates = sorted((p for p in root.glob("iter_*") if p.is_dir()
                         and not p.name.endswith((".partial", ".old"))),
                        key=lambda p: (p.name == selected, p.name), reverse=True)
    passed_over = []
    for ckpt in candidates:
        if not (ckpt / META).is_file():
            passed_over.append(f"{ckpt}: {META} is missing")
            continue
        problems = verify_checkpoint(ckpt)
        if not problems:
            return ckpt, passed_over
        passed_over.append(f"{ckpt}: " + "; ".join(problems))
    return None, passed_over


def optimizer_sharding(use_distributed_optimizer: bool) -> str:
    return "distributed" if use_distributed_optimizer else "replicated"


def load_checkpoint(load: str | os.PathLike, objs, *, weights_only: bool,
                    sharding: str) -> tuple[dict, dict]:
    """Load into ``objs`` in place; returns (extra_state, meta).

    weights_only skips the optimizer; ``sharding`` (see ``optimizer_sharding``) must
    match the checkpoint's when the optimizer state is loaded.
    """
    ckpt = resolve_load_dir(load)
    problems = verify_checkpoint(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems))
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
        materialize_adam_state(objs.dense_optimizer)
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
        for torch_opt in torch_optimizers(objs.dense_optimizer):
            # After load every param shares ONE step tensor; foreach AdamW would then
            # bump it once per param (megatron-core 0.16.1). Give each its own.
            for param_state in torch_opt.state.values():
                if isinstance(param_state.get("step"), torch.Tensor):
                    param_state["step"] = param_state["step"].clone()
    # Model params changed underneath the optimizer's fp32 main copies: refresh them.
    if weights_only:
        reload_main_params(objs)
    return (loaded.get("extra") or {}), meta


def reload_main_params(objs) -> None:
    """Refresh the optimizers' fp32 main copies (LoGRA's masters, megatron's main params)
    after the model weights changed underneath."""
    if objs.logra is not None:
        objs.logra.reload_masters()
    reload_model_params(objs.dense_optimizer)
