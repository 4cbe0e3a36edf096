"""A checkpoint's meta (``megatron_logra.json``): what it holds and what wrote it.

``CheckpointMeta`` is typed and frozen; ``read_meta(ckpt)`` reads it (format 1 and 2 alike),
``meta.write(ckpt)`` writes it. The checks every loader makes against it live here too:
the model it was saved for (``check_arch``) and the optimizer state it holds
(``check_resumable``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from megatron_logra.checkpoint.layout import FORMAT_VERSION, META

SHARDINGS = ("distributed", "replicated")


def optimizer_sharding(use_distributed_optimizer: bool) -> str:
    """How a run's optimizer state is laid out (``--use-distributed-optimizer`` or not)."""
    return SHARDINGS[0] if use_distributed_optimizer else SHARDINGS[1]


@dataclass(frozen=True)
class CheckpointMeta:
    step: int
    arch: dict | None = None
    """``ModelArch.to_dict()`` of the model saved (None: not recorded)."""
    config: dict | None = None
    """``RunConfig.to_dict()`` of the training run that saved it (None for converters)."""
    optimizer_sharding: str | None = None
    """``SHARDINGS``, or None where no optimizer state is held."""
    weights_only: bool = False
    source: dict = field(default_factory=dict)
    """What wrote a weights-only checkpoint: {"tool": ..., ...}."""
    format_version: int = FORMAT_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    def write(self, ckpt: Path) -> None:
        (ckpt / META).write_text(json.dumps(self.to_dict(), indent=1))

    def check_arch(self, arch, ckpt: Path) -> None:
        """Raise ValueError naming the differing fields when ``arch`` is not the model saved."""
        if self.arch is not None and self.arch != arch.to_dict():
            diff = {k: (self.arch.get(k), v) for k, v in arch.to_dict().items()
                    if self.arch.get(k) != v}
            raise ValueError(f"checkpoint {ckpt} was saved for another model: (saved, now) = "
                             f"{diff}; pass the --model-dir it was trained with")

    def check_resumable(self, sharding: str, ckpt: Path) -> None:
        """Raise ValueError with the flag to pass when the optimizer state cannot be resumed
        by a run whose optimizer is laid out as ``sharding``."""
        if self.weights_only:
            raise ValueError(f"checkpoint {ckpt} holds weights only (written by "
                             f"{self.source.get('tool', 'a converter')}): load it with "
                             f"--finetune")
        if self.optimizer_sharding not in (None, sharding):
            flag = "with" if self.optimizer_sharding == "distributed" else "without"
            raise ValueError(f"checkpoint {ckpt} holds {self.optimizer_sharding} optimizer "
                             f"state; resume {flag} --use-distributed-optimizer, or pass "
                             f"--finetune to load only the weights")


def read_meta(ckpt: str | Path) -> CheckpointMeta:
    """The meta of checkpoint folder ``ckpt``; ValueError naming the file when it is not one
    this package wrote."""
    path = Path(ckpt) / META
    try:
        raw = json.loads(path.read_text())
        return CheckpointMeta(**{"format_version": 1, "source": raw.get("source") or {},
                                 **{k: v for k, v in raw.items() if k != "source"}})
    except (json.JSONDecodeError, TypeError) as exc:
        raise ValueError(f"{path} is unreadable ({type(exc).__name__}: {exc})") from None
