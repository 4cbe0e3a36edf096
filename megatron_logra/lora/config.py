"""LoRA's settings (``--peft lora``, flags ``--lora-*``), checked when built; no torch, no
megatron."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.logra.config import DEFAULT_TARGETS, check_targets, parse_targets
from megatron_logra.model.arch import LINEAR_TARGETS

TARGETS = LINEAR_TARGETS
"""What ``--lora-targets`` may name: a layer's linears."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters W + (alpha / r) B A on the targeted linears; the base is frozen."""

    FLAG_PREFIX: ClassVar[str] = "lora-"

    rank: int = field(default=16, metadata=flag_spec(minimum=1))
    """Adapter rank r (PEFT's ``r``)."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by alpha / r (PEFT's
    ``lora_alpha``)."""
    dropout: float = field(default=0.0, metadata=flag_spec(minimum=0))
    """Dropout on the adapter's input (PEFT's ``lora_dropout``)."""
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS,
                                     metadata=flag_spec(parse=parse_targets))
    """Comma list of adapted linears: qkv, proj, fc1, fc2 (PEFT's ``target_modules``, in
    megatron's fused names: qkv is q, k and v; fc1 is gate and up)."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_targets("--lora-targets", self.targets, TARGETS)
        if self.dropout >= 1:
            raise ValueError(f"--lora-dropout {self.dropout} must be in [0, 1)")
