"""``CheckpointManager``: training's checkpoint rules in one place (collective calls).

As torchtitan's manager does, it owns what a training checkpoint holds beside the model
and the optimizer (the resumable parts, ``register``-ed by name: the scheduler, RL's
reward baseline, the KL controller), its meta (``CheckpointMeta``: the model, the run's
config, the optimizer's sharding), when one is written (``--save-interval`` and the
end), how many are kept (``--save-keep``) and which one a run starts from. The loop
says ``save(step, last=...)``; ``training.prepare`` says ``load(...)``:

- ``load``: under ``--auto-resume`` or a torchrun restart, the newest checkpoint in
  ``--save`` that verifies (damaged ones passed over, and said so); else ``--load``: a
  training checkpoint to resume (or, with ``--finetune``, its weights alone) or an HF
  folder (``load_hf``); else nothing. It returns the step to start from; the resumed
  parts' states are given to each part as it registers.
- ``save``: at every ``--save-interval``-th step and the last, model + optimizer + the
  registered parts, written all-or-nothing (``checkpoint.save``); a failed interval save
  is reported and training goes on, a failed last save raises.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from megatron_logra.checkpoint.config import CheckpointConfig
from megatron_logra.checkpoint.layout import resolve_load_dir
from megatron_logra.checkpoint.load import find_resume_checkpoint, load_checkpoint
from megatron_logra.checkpoint.meta import CheckpointMeta, optimizer_sharding
from megatron_logra.checkpoint.save import save_or_report
from megatron_logra.checkpoint.state import ResumableState, Stateful


def restarted_by_torchrun() -> bool:
    """torchrun --max-restarts: the workers of a restarted job see a count above 0."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def save_due(ck: CheckpointConfig, done: int, last: bool) -> bool:
    """Whether a checkpoint is written after ``done`` updates."""
    return bool(ck.save) and (last or bool(ck.save_interval and done % ck.save_interval == 0))


class CheckpointManager:
    def __init__(self, cfg: CheckpointConfig, objs, *, arch, run_config: dict,
                 distributed_optimizer: bool, is_logger: bool):
        """``objs``: the run's ``TrainingObjects`` (model, optimizer, scheduler);
        ``arch``: its ``ModelArch``; ``run_config``: ``RunConfig.to_dict()``, recorded in
        every checkpoint's meta; ``distributed_optimizer``: its state is sharded over data
        parallel (a checkpoint resumes only into the same sharding); ``is_logger``: this
        rank reports (rank 0)."""
        self.cfg, self.objs, self.is_logger = cfg, objs, is_logger
        self.sharding = optimizer_sharding(distributed_optimizer)
        self._meta = {"arch": arch.to_dict(), "config": run_config,
                      "optimizer_sharding": self.sharding}
        self.resumable = ResumableState()
        self.last_saved: Path | None = None

    def register(self, name: str, part: Stateful, *, required: bool = False) -> None:
        """A part saved with every checkpoint, restored when the run resumed
        (``ResumableState.register``)."""
        self.resumable.register(name, part, required=required)

    # --- which checkpoint a run starts from ---------------------------------------------
    def resume_checkpoint(self) -> Path | None:
        """The checkpoint to resume from under --auto-resume or a torchrun restart: the
        newest in --save that verifies (collective), or None (then --load as given)."""
        ck = self.cfg
        if not ck.save or not (ck.auto_resume or restarted_by_torchrun()):
            return None
        found, passed_over = find_resume_checkpoint(ck.save)
        if self.is_logger:
            for why in passed_over:
                print(f"auto-resume: passing over a damaged checkpoint: {why}", flush=True)
            if found is None:
                print(f"auto-resume: no complete checkpoint in {ck.save}; starting from "
                      f"{ck.load or 'the initial weights'}", flush=True)
        return found

    def load(self, load_hf: Callable[[str], None]) -> int:
        """Resume (``--auto-resume``, a torchrun restart, or ``--load`` of a training
        checkpoint) or load weights (``load_hf(folder)`` for an HF folder, or
        ``--finetune``) -> the step to start from; the resumed parts' states wait for
        their parts to register."""
        step, resumed = self._load(load_hf)
        self.resumable = ResumableState(resumed)
        return step

    def _load(self, load_hf: Callable[[str], None]) -> tuple[int, dict]:
        ck, objs = self.cfg, self.objs
        resume = self.resume_checkpoint()
        if resume is not None:
            resumed, meta = load_checkpoint(resume, objs, weights_only=False,
                                            sharding=self.sharding)
            if self.is_logger:
                print(f"resumed from {resume} at step {meta.step}", flush=True)
            return meta.step, resumed
        if ck.load and ck.load_format == "hf":
            load_hf(ck.load)
            return 0, {}
        if ck.load:
            resumed, meta = load_checkpoint(ck.load, objs, weights_only=ck.finetune,
                                            sharding=self.sharding)
            start = 0 if ck.finetune else meta.step
            if self.is_logger:
                print(f"loaded {resolve_load_dir(ck.load)} "
                      f"({'weights only' if ck.finetune else f'resuming at step {start}'})",
                      flush=True)
            return start, resumed
        return 0, {}

    # --- when a checkpoint is written -----------------------------------------------------
    def save(self, step: int, *, last: bool) -> Path | None:
        """After ``step`` updates: the checkpoint when one is due (``save_due``), else
        None; None too when an interval save failed (reported, training goes on)."""
        if not save_due(self.cfg, step, last):
            return None
        meta = CheckpointMeta(step=step, **self._meta)
        saved = save_or_report(self.cfg.save, self.cfg.save_keep, self.objs,
                               self.resumable.state_dict(), meta, last=last)
        self.last_saved = saved or self.last_saved
        return saved
