"""The weight-sync settings (``--weight-sync*``, ``--sync-bucket-mb``); no torch, no megatron."""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_logra.bridge.protocol import Channel, Transport
from megatron_logra.flags import flag_spec


@dataclass(frozen=True)
class WeightSyncConfig:
    transport: Transport = field(default=Transport.FULL,
                                 metadata=flag_spec(flag="--weight-sync"))
    """full: HF tensors (LoRA: merged); sparse-delta: the engine-dtype elements that changed
    (exact); sketch-delta (LoGRA): per sketched weight D and its seed, the engine
    regenerates A and applies the update; lora-adapter (--peft lora): the adapter only,
    served by vLLM's LoRA support on the unmerged base."""
    channel: Channel = field(default=Channel.PIPE, metadata=flag_spec(
        flag="--weight-sync-channel"))
    """pipe: every push goes to trainer rank 0 and over its pipe to the engine process,
    and each vLLM worker receives all of it and keeps its shard; direct: every trainer rank
    sends each vLLM worker only its own pieces, over a torch.distributed group between
    them (gloo on CPU, NCCL on CUDA), and the engine starts from dummy weights that the
    first push replaces (not with --weight-sync lora-adapter)."""
    anchor_interval: int = field(default=0, metadata=flag_spec(
        flag="--weight-sync-anchor-interval", minimum=0))
    """A full push every N updates (0: only when a delta cannot be used)."""
    verify_interval: int = field(default=1, metadata=flag_spec(
        flag="--weight-sync-verify-interval", minimum=0))
    """Compare per-tensor fingerprints every N delta pushes (0: never); a mismatch resyncs
    that tensor."""
    bucket_mb: int = field(default=64, metadata=flag_spec(flag="--sync-bucket-mb", minimum=1))
    """Weight-push bucket size (MiB)."""
