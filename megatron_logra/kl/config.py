"""The predicted-KL step control's settings (``--kl-*``), checked when built; no torch, no
megatron."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_logra.flags import check_fields, flag_spec


@dataclass(frozen=True)
class KLControlConfig:
    """Predicted-KL step control (docs/method.md, section 3)."""

    FLAG_PREFIX: ClassVar[str] = "kl-"

    control: Literal["none", "predicted", "measure"] = "none"
    """Scale every update so its predicted KL meets the budget (predicted); take it as it
    is but measure its predicted and realized KL (measure: a fixed step whose KL is
    logged, at the cost of the control's probe passes); or neither (none)."""
    budget: float = 2e-4
    """KL budget at the first update, cosine-decayed ..."""
    budget_final: float = 2e-5
    """... to this budget ..."""
    budget_steps: int = field(default=300, metadata=flag_spec(minimum=1))
    """... over this many updates (the final budget is reached at update N - 1)."""
    alpha_max: float = 3.0
    """The largest step scale alpha."""
    probe_responses: int = field(default=2, metadata=flag_spec(minimum=1))
    """Responses per DP rank the KL prediction uses."""
    probe_max_tokens: int = field(default=4096, metadata=flag_spec(minimum=1))
    """Each probe response is cut at this many tokens, prompt included (the reference's
    cap; the forward-mode pass's cost grows with it)."""
    mismatch_adjust: bool = True
    """Take the rollout/trainer mismatch average m off the budget (the reference's control;
    --no-kl-mismatch-adjust: the budget schedule alone, m still measured and logged)."""
    mismatch_decay: float = field(default=0.7, metadata=flag_spec(cli=False))
    """m <- decay m + (1 - decay) max(0, mean(gen - prev)) (the reference's constant)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not 0 < self.budget_final <= self.budget:
            raise ValueError("need 0 < --kl-budget-final <= --kl-budget")
        if self.alpha_max <= 0:
            raise ValueError("--kl-alpha-max must be > 0")
