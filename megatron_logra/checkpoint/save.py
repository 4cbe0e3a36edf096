"""Writing a checkpoint, all or nothing: the one commit path of training and the converters.

A save goes into ``SAVE/iter_N.partial``; the state is written (megatron's torch_dist
format, sharded tensors with global shapes, so a checkpoint saved at one TP/PP/DP loads
at another), then the meta, then the manifest (every rank hashes its share of the
files); only then is the folder renamed into place and ``latest`` (replaced atomically)
pointed at it. A crash or a failure on any rank at any phase leaves the previous
checkpoint intact and selected. Every rank runs every collective whatever failed
locally, so a failure ends the save on every rank together (``CheckpointSaveError``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from megatron.core import dist_checkpointing

from megatron_logra.checkpoint import layout, manifest
from megatron_logra.checkpoint.meta import CheckpointMeta
from megatron_logra.checkpoint.sharded_state import training_state_dict
from megatron_logra.runtime.collectives import barrier, every_rank, rank_and_world
from megatron_logra.runtime.faults import maybe_fail


class CheckpointSaveError(RuntimeError):
    """A save that failed on some rank (a full disk, say): nothing of it was kept, and the
    previous checkpoint stays selected."""


def _local_error(action: Callable[[], None], catch: type[Exception] = OSError) -> str:
    """Run ``action`` (local work of this rank); its ``catch`` exception as text, or ""."""
    try:
        action()
    except catch as exc:  # every rank reports it (CheckpointCommit.check)
        return f"{type(exc).__name__}: {exc}"
    return ""


class CheckpointCommit:
    """One save in phases (collective): ``start``, ``write`` (the files), ``write_meta``,
    ``write_manifest``, ``commit``."""

    def __init__(self, root: str | os.PathLike, step: int):
        self.root, self.step = Path(root), step
        self.final = self.root / layout.iter_dir_name(step)
        self.partial = self.root / (self.final.name + layout.PARTIAL)
        self.rank0 = rank_and_world()[0] == 0

    def check(self, error: str, what: str) -> None:
        """End the save on every rank when ``what`` failed on any (``error``: this rank's)."""
        errors = [e for e in every_rank(error) if e]
        if errors:
            if self.rank0:
                shutil.rmtree(self.partial, ignore_errors=True)
            barrier()
            raise CheckpointSaveError(
                f"checkpoint {self.final} not saved: {what} failed ({errors[0]}); the partial "
                f"save is removed and {self.root / layout.LATEST} still selects the previous "
                f"checkpoint")

    def start(self) -> None:
        def make():
            self.root.mkdir(parents=True, exist_ok=True)
            if self.partial.exists():
                shutil.rmtree(self.partial)
            self.partial.mkdir()
        self.check(_local_error(make) if self.rank0 else "", f"creating {self.partial}")

    def write(self, write_files: Callable[[Path], None], what: str = "writing the state") -> None:
        """``write_files(partial_dir)`` on every rank (each writes its share; whatever it
        raises ends the save: megatron's writers report another rank's failure so)."""
        self.check(_local_error(lambda: write_files(self.partial), Exception), what)

    def write_meta(self, meta: CheckpointMeta) -> None:
        def write():
            maybe_fail("save-enospc", self.step)
            meta.write(self.partial)
        self.check(_local_error(write) if self.rank0 else "", f"writing {layout.META}")

    def write_manifest(self) -> None:
        """Every rank hashes its share of the files; rank 0 writes the manifest."""
        rank, world = rank_and_world()
        entries: dict = {}

        def hash_mine():
            files = manifest.checkpoint_files(self.partial)
            entries.update(manifest.manifest_entries(
                self.partial, manifest.files_for_rank(files, rank, world)))
        error = _local_error(hash_mine)
        parts = every_rank(None if error else entries)
        if self.rank0 and not error:
            if any(part is None for part in parts):
                error = "hashing the files failed on another rank"
            else:
                error = _local_error(lambda: manifest.write_manifest(
                    self.partial, {k: v for part in parts for k, v in part.items()}))
        self.check(error, f"writing {manifest.MANIFEST}")

    def commit(self, keep: int | None = None) -> Path:
        """Rank 0 moves the save in place and selects it (then prunes to ``keep``)."""
        if self.rank0:
            stale = self.final.with_name(self.final.name + layout.OLD)
            if self.final.exists():  # re-saving a step: keep the old copy until the new one
                if stale.exists():     # is in place
                    shutil.rmtree(stale)
                os.replace(self.final, stale)
            os.replace(self.partial, self.final)
            layout.select(self.root, self.final.name)
            if stale.exists():
                shutil.rmtree(stale)
            if keep:
                layout.prune(self.root, keep)
        barrier()
        return self.final


def commit_checkpoint(root: str | os.PathLike, meta: CheckpointMeta,
                     write_files: Callable[[Path], None], keep: int | None = None) -> Path:
    """Every phase of a save at ``meta.step`` (collective); returns the checkpoint's folder."""
    save = CheckpointCommit(root, meta.step)
    save.start()
    save.write(write_files)
    maybe_fail("save", meta.step)
    save.write_meta(meta)
    save.write_manifest()
    return save.commit(keep)


def save_checkpoint(save_dir: str | os.PathLike, objs, resumable: dict,
                    meta: CheckpointMeta, keep: int | None = None) -> Path:
    """Save model + optimizer + ``resumable`` (``ResumableState.state_dict()``, rank-0
    common state) atomically at ``meta.step``; ``keep``: then delete all but the newest
    ``keep`` checkpoints. A failure on any rank (``CheckpointSaveError``, on every rank)
    removes the partial save and leaves ``latest`` as it was."""
    state = training_state_dict(objs, is_loading=False, with_optimizer=True)
    state["extra"] = resumable
    return commit_checkpoint(save_dir, meta, lambda partial: dist_checkpointing.save(
        state, str(partial), content_metadata=None), keep)


def save_or_report(save_dir: str, keep: int | None, objs, resumable: dict,
                   meta: CheckpointMeta, *, last: bool) -> Path | None:
    """A training loop's save: the checkpoint's folder, or None when an interval save failed
    (said on rank 0; the previous checkpoint stays selected and training goes on, so a
    full disk can be cleared while it runs). A failed save at the end of training raises:
    the run's last updates would be lost."""
    rank0 = rank_and_world()[0] == 0
    try:
        saved = save_checkpoint(save_dir, objs, resumable, meta, keep=keep)
    except CheckpointSaveError as exc:
        if last:
            raise
        if rank0:
            print(f"warning: {exc}; training continues", flush=True)
        return None
    if rank0:
        print(f"saved checkpoint {saved}", flush=True)
    return saved
