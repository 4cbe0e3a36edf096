"""LoRA's settings (``--peft lora``, flags ``--lora-*``); no torch, no megatron."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.flags import flag_spec
from megatron_logra.logra.config import DEFAULT_TARGETS, parse_targets


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters W + (alpha / r) B A on the targeted linears; the base is frozen."""

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
