"""The dry run's settings (``--dry-run``, ``--dry-run-*``), checked when built; no torch."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_logra.flags import check_fields, flag_spec


def parse_ranks(spec: str) -> tuple[int, ...] | None:
    """"0,3,5-7" -> (0, 3, 5, 6, 7); "all" -> () (every rank); "" -> None (the default)."""
    spec = spec.strip()
    if not spec:
        return None
    if spec == "all":
        return ()
    out: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            out += range(int(first), int(last or first) + 1)
        except ValueError:
            raise ValueError(f"--dry-run-ranks {spec!r}: give ranks and ranges like 0,3,5-7, "
                             f"or all") from None
    return tuple(sorted(set(out)))


@dataclass(frozen=True)
class DryRunConfig:
    FLAG_PREFIX: ClassVar[str] = "dry-run-"

    enabled: bool = field(default=False, metadata=flag_spec(flag="--dry-run"))
    """Trace one training update of this command line at full size on this machine's CPU
    (fake CUDA tensors, fake NCCL: no GPU, no memory for the weights) for the ranks of
    --dry-run-world-size GPUs, and report each one's peak GPU memory by category, its
    collectives and the first weight push's messages (--output-dir/dry_run.json and a
    table); nothing is trained. One process: python launch/pretrain_rl.py --dry-run."""
    world_size: int | None = field(default=None, metadata=flag_spec(minimum=1))
    """GPUs of the job the dry run traces (default: TP x PP; the rest is data parallel)."""
    ranks: tuple[int, ...] | None = field(default=None, metadata=flag_spec(
        parse=parse_ranks, cli_default=None))
    """Ranks to trace, e.g. 0,3,5-7, or all (default: per pipeline stage the ranks that
    stand for the others: TP and DP rank 0, and the last TP and DP rank when there are
    several; the report says which ranks each one stands for)."""
    gpus_per_node: int = field(default=8, metadata=flag_spec(minimum=1))
    """GPUs per node of the traced job (local ranks; the rollout engine's placement)."""
    gpu_gib: float = field(default=80.0, metadata=flag_spec(minimum=1))
    """GPU size the report checks each rank's peak against (90% of it usable)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.enabled and (self.world_size is not None or self.ranks is not None):
            raise ValueError("--dry-run-world-size / --dry-run-ranks need --dry-run")

    def world(self, tp: int, pp: int) -> int:
        """The traced job's world size."""
        return self.world_size or tp * pp
