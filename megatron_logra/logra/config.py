"""LoGRA's settings (``--optimizer logra``, flags ``--logra-*``): sketches and RowAdam.

No torch, no megatron: the run config is built from these before anything heavy, and
checks itself (``__post_init__``). ``training.build`` hands it as it is to the sketches
(``logra.sketches.SketchSet``) and RowAdam (``logra.optimizer.LograOptimizer``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.model.arch import LINEAR_TARGETS

DEFAULT_TARGETS = LINEAR_TARGETS
TARGETS = LINEAR_TARGETS + ("embedding", "output")
"""What ``--logra-targets`` may name: a layer's linears, and the word embedding and the
output layer (``embedding``/``output``; when they are tied, one matrix, either target
sketches both uses)."""


def parse_targets(spec: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in spec.split(",") if t.strip())


def check_targets(flag: str, targets: tuple[str, ...], allowed: tuple[str, ...]) -> None:
    """Refuse an empty ``targets`` or one naming a linear outside ``allowed`` (``flag``
    names the setting in the error)."""
    if not targets or any(t not in allowed for t in targets):
        raise ValueError(f"{flag} {','.join(targets)!r}: choose a comma list "
                         f"from {','.join(allowed)}")


@dataclass(frozen=True)
class LograConfig:
    """LoGRA's sketch and RowAdam settings (``--optimizer logra``)."""

    FLAG_PREFIX: ClassVar[str] = "logra-"

    rank: int = 256
    """Sketch rank r per weight (the paper uses 256)."""
    projection: Literal["rademacher", "gaussian"] = "rademacher"
    """Entries of the random projection A."""
    refresh_interval: int = 1
    """Draw new projections every N updates."""
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS,
                                     metadata=flag_spec(parse=parse_targets))
    """Comma list of sketched weights: qkv, proj, fc1, fc2, embedding, output (a tied
    embedding/output matrix is sketched for both uses)."""
    beta2: float = 0.95
    """RowAdam second-moment decay."""
    eps: float = field(default=1e-8, metadata=flag_spec(minimum=0))
    """RowAdam epsilon, relative to the layer's mean row scale."""
    update_ratio: float | None = field(default=6e-5, metadata=flag_spec(zero_is_none=True))
    """Norm-ratio step: ||c D A|| = ratio * ||W|| over all sketched weights, as the paper;
    0: the step is --lr instead (for plain RowAdam, --no-logra-norm-restoration, whose D is
    O(1) per element; a restored D carries the token-normalised sketch's norm)."""
    master_weights: Literal["fp32", "none"] = "fp32"
    """With --bf16: keep an fp32 master of sketched weights, or none (bf16 only,
    deterministic stochastic rounding)."""
    norm_restoration: bool = True
    """Rescale each HF module's (q, k, v, o, gate, up, down) RowAdam direction to its
    sketch's Frobenius norm, as the paper's reference does; --no-... gives plain RowAdam."""
    untargeted: Literal["frozen", "adam"] = "frozen"
    """Parameters that are not sketched (norms, biases, unsketched embedding and output
    layer): frozen, as the paper (no optimizer state, no gradient buffers), or trained by
    Adam at --lr, clipped by --clip-grad."""
    update_factor_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Round the final factor alpha c D to this dtype before applying it (the reference
    rounds to bfloat16); float32 keeps it exact (not with --logra-master-weights none)."""
    keep_updates: bool = field(default=False, metadata=flag_spec(cli=False))
    """Keep each update's (D, coefficient, seed) for a receiver: set (not a flag) when
    --weight-sync sketch-delta sends them to the rollout engine."""

    def __post_init__(self) -> None:
        check_fields(self)
        check_targets("--logra-targets", self.targets, TARGETS)
        if self.rank < 1:
            raise ValueError(f"--logra-rank {self.rank} must be >= 1 (the paper uses 256)")
        if self.refresh_interval < 1:
            raise ValueError(f"--logra-refresh-interval {self.refresh_interval} must be >= 1")
        if not 0.0 <= self.beta2 < 1.0:
            raise ValueError(f"--logra-beta2 {self.beta2} must be in [0, 1)")
        if self.update_ratio is not None and self.update_ratio < 0:
            raise ValueError(f"--logra-update-ratio {self.update_ratio} must be > 0 "
                             f"(the reference runs use 6e-5), or 0 to step by --lr")
        if self.master_weights == "none" and self.update_factor_dtype != "bfloat16":
            raise ValueError("--logra-master-weights none applies bf16 factors (the exact, "
                             "reproducible update a rollout engine repeats): drop "
                             "--logra-update-factor-dtype float32 or keep an fp32 master")

    def check_fits(self, num_kv_heads: int, tensor_parallel_size: int) -> None:
        """Refuse (ValueError) targets the layout cannot sketch: qkv needs TP <= the model's
        kv heads. Asked where the architecture is known: the CLI, once it has read the
        model's config.json, and ``memory.forecast.cli_accepts``."""
        tp = tensor_parallel_size
        if "qkv" in self.targets and num_kv_heads < tp:
            raise ValueError(f"LoGRA cannot sketch linear_qkv when num_key_value_heads "
                             f"({num_kv_heads}) < TP ({tp}): megatron replicates the kv heads "
                             f"over TP ranks; use --tensor-model-parallel-size <= "
                             f"{num_kv_heads} or drop qkv from --logra-targets")
