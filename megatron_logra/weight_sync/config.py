"""The weight-sync settings (``--weight-sync*``, ``--sync-bucket-mb``), checked when built;
no torch, no megatron.

``RLConfig.weight_sync`` holds them: the transport ``--weight-sync`` picks is
``rl.weight_sync.transport`` wherever it is read (``transport``: this package's word for
one way of pushing, ``contract.Transport``, on the wire too; what each one needs of the
run: ``contract.NEEDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.weight_sync.contract import Transport


@dataclass(frozen=True)
class WeightSyncConfig:
    FLAG_PREFIX: ClassVar[str] = "weight-sync-"

    transport: Transport = field(default=Transport.FULL,
                                 metadata=flag_spec(flag="--weight-sync"))
    """full: every trainer rank sends each vLLM server worker its own pieces of every
    tensor (LoRA: merged); sparse-delta: the engine-dtype elements that changed (exact);
    sketch-delta (LoGRA): per sketched weight D and its seed, the workers regenerate A and
    apply the update; lora-adapter (--peft lora): the adapter only, served by vLLM's LoRA
    support on the unmerged base."""
    anchor_interval: int = field(default=0, metadata=flag_spec(minimum=0))
    """A full push every N updates (0: only when a delta cannot be used)."""
    verify_interval: int = field(default=1, metadata=flag_spec(minimum=0))
    """Check the server's weights against the trainer's (vLLM's checksums) every N delta
    pushes (0: never); a mismatching tensor is pushed again in full."""
    bucket_mb: int = field(default=64, metadata=flag_spec(flag="--sync-bucket-mb", minimum=1))
    """Weight-push bucket size (MiB)."""

    def __post_init__(self) -> None:
        check_fields(self)
