"""The checkpoint settings (``--save*``, ``--load``, ``--auto-resume``, ``--finetune``),
checked when built; no torch, no megatron. ``checkpoint.manager.CheckpointManager``
takes them as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_logra.flags import check_fields, flag_spec


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    """Checkpoint directory."""
    save_interval: int = field(default=0, metadata=flag_spec(minimum=0))
    """Updates between checkpoints (0: only at the end)."""
    save_keep: int | None = field(default=None, metadata=flag_spec(minimum=0,
                                                                   zero_is_none=True))
    """Keep only the newest N checkpoints in --save (0: keep all); the one 'latest'
    selects is never deleted."""
    auto_resume: bool = False
    """Resume from the newest checkpoint in --save that verifies, when there is one,
    instead of --load (always on when torchrun restarts the job: --max-restarts); a
    damaged newest checkpoint is passed over, and said so."""
    load: str | None = None
    """Checkpoint directory (or one iter_* folder in it) to resume from, or an HF model
    folder / converted checkpoint to start from (weights only)."""
    load_format: Literal["megatron", "hf"] = field(default="megatron",
                                                   metadata=flag_spec(cli=False))
    """megatron (a checkpoint folder) | hf (an HF model folder): what --load names."""
    finetune: bool = False
    """With --load: take the weights only (fresh optimizer, step 0)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load")
