"""What every weight-sync transport shares (every call a collective), and the interface
the delta transports follow (``DeltaTransport``); one file per transport:
``full_push``, ``sparse_delta_push``, ``sketch_delta_push`` (LoGRA),
``lora_adapter_push`` (LoRA).

``TrainerWeights`` is what every transport reads: the policy's chunks in the Megatron
layout, who sends each parameter (``gathered_weights.plan_push``), the engine dtype, for
sparse deltas what each sender last sent, and the channel (``weight_sync.channel``) over
which every rank sends each vLLM server worker its own pieces. Rank 0 talks to the
server (a ``contract.PushTarget``: ``rollout.vllm_server.VllmServer``; None on every
other rank). A delta's
``deliver`` gets it to the server, which refuses (nothing applied) unless it serves the
base version.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from megatron_logra.model.hf_mapping import hf_sources
from megatron_logra.runtime.collectives import from_rank0
from megatron_logra.weight_sync.channel import DirectChannel
from megatron_logra.weight_sync.contract import (Delivery, EngineError, PushRefused, PushTarget,
                                                 Transport)
from megatron_logra.weight_sync.gathered_weights import gathered_buckets, plan_push


class TrainerWeights:
    """The policy's weights as weight sync reads them (built collectively, once per run)."""

    def __init__(self, model_chunks: list, arch, dtype: torch.dtype, bucket_bytes: int,
                 engine_tp: int, merged: bool = True, group_backend: str | None = None):
        """``merged``: full pushes carry LoRA's adapters merged into their weights (an
        engine serving the adapter on its own takes the base: False). ``engine_tp``: the
        server's TP size (its worker count); ``group_backend``: the weight group's
        (``DirectChannel``; None: the device's)."""
        self.model, self.arch, self.dtype, self.bucket_bytes = model_chunks, arch, dtype, bucket_bytes
        self.merged = merged
        self.rank = dist.get_rank()
        self.plan = plan_push(model_chunks, arch)
        self.direct = DirectChannel(model_chunks, arch, self.plan, dtype, engine_tp,
                                    bucket_bytes, group_backend, merged=merged)
        self.hf_source = hf_sources(arch)  # HF tensor name -> canonical megatron param
        # sparse-delta: what each sender last sent (engine dtype), and its version
        self.shadow: dict[str, torch.Tensor] | None = None
        self.shadow_version = -1

    def track_changes(self) -> None:
        """Record what every full push sends (the base of sparse deltas; one engine-dtype
        copy of the parameters each sender sends). Takes effect at the next full push."""
        if self.shadow is None:
            self.shadow = {}

    def buckets(self, names: list[str] | None = None):
        """Full HF tensors in buckets on rank 0 (see ``gathered_weights.gathered_buckets``)."""
        return gathered_buckets(self.model, self.arch, self.plan, dtype=self.dtype,
                         bucket_bytes=self.bucket_bytes, names=names, merged=self.merged)


class DeltaTransport(Protocol):
    """What every delta transport (``--weight-sync`` other than full) declares and does;
    ``sync.WeightSync`` drives them through it (every method a collective)."""

    transport: Transport
    verifiable: bool
    """Whether the server then holds what a full push would send (the checks apply)."""

    def ready(self, version: int) -> bool:
        """Whether a delta to ``version`` can be built (rank 0 decides)."""

    def deliver(self, engine: PushTarget | None, version: int) -> Delivery:
        """Every rank's part to the server; refused (nothing applied) unless it serves
        ``version - 1``."""

    def applied(self, version: int) -> None:
        """The server took it: the new base."""


def deliver_through_rank0(delta, engine, version: int) -> Delivery:
    """Every rank's part of ``delta`` gathered on rank 0, which sends it to the engine;
    the outcome broadcast to every rank."""
    payload = delta.gather()

    def send() -> Delivery:
        try:
            return Delivery(sent=delta.send(engine, payload, version))
        except PushRefused as exc:
            return Delivery(refused=str(exc))
        except EngineError as exc:
            return Delivery(failed=str(exc))
    # every rank must know of a failure too: what follows a push is collective
    return from_rank0(send)
