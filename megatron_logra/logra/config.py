"""LoGRA's settings (``--optimizer logra``, flags ``--logra-*``): sketches and RowAdam.

No torch, no megatron: the run config is built from these before anything heavy.
``training.setup`` splits them into ``logra.sketches.SketchConfig`` and
``logra.optimizer.RowAdamConfig``; the defaults live here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from megatron_logra.flags import flag_spec

DEFAULT_TARGETS = ("qkv", "proj", "fc1", "fc2")


def parse_targets(spec: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in spec.split(",") if t.strip())


@dataclass(frozen=True)
class LograConfig:
    """LoGRA's sketch and RowAdam settings (``--optimizer logra``)."""

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
