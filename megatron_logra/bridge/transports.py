"""The trainer side of each weight-sync transport: one class each, every call a collective.

``TrainerWeights`` is what every transport reads: the policy's chunks in the Megatron
layout, who sends each parameter (``full_weights.plan_push``), the engine dtype, for
sparse deltas what each sender last sent, and the channel (``bridge.direct``) over which
every rank sends each vLLM server worker its own pieces. Rank 0 talks to the server
(``rollout.vllm_server.VllmServer``, None on every other rank).

- ``FullPush``: every parameter (or some), each rank its own shard's pieces, then the
  version; a check of the server's weights (vLLM's checksums) resends what differs.
- ``SparseDeltaPush``: each sender's changed engine-dtype elements against what it last
  sent (exact); needs a recorded base at the previous version.
- ``SketchDeltaPush`` (LoGRA): every rank's own rows of D with seeds, plus the unsketched
  params that train, in full (none when they are frozen, the paper's setting).
- ``LoraAdapterPush`` (LoRA): the adapter only, in PEFT's format, which vLLM serves on
  top of the base (its runtime LoRA loading); the full push before it carries the base
  unmerged.
A delta's ``deliver`` (collective) gets it to the server, which refuses (nothing applied)
unless it serves the base version.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.bridge.direct import DirectChannel
from megatron_logra.bridge.full_weights import full_push, gather_adapters, plan_push
from megatron_logra.bridge.protocol import Delivery, EngineError, PushRefused, Transport
from megatron_logra.model.hf_mapping import hf_sources, megatron_param_names
from megatron_logra.model.provider import canonical_param_names, unwrap


@dataclass
class PushResult:
    failed: str = ""  # the engine's error ("" when it worked)
    sent: int = 0  # bytes


class TrainerWeights:
    """The policy's weights as the bridge reads them (built collectively, once per run)."""

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
                                    bucket_bytes, group_backend)
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
        """Full HF tensors in buckets on rank 0 (see ``full_weights.full_push``)."""
        return full_push(self.model, self.arch, self.plan, dtype=self.dtype,
                         bucket_bytes=self.bucket_bytes, names=names, merged=self.merged)


class FullPush:
    transport = Transport.FULL

    def __init__(self, weights: TrainerWeights):
        self.weights = weights

    def push(self, engine, version: int, names: list[str] | None = None) -> PushResult:
        """Every parameter (or ``names``, canonical) in full, then the version: every rank
        sends each server worker its pieces (the server must be running)."""
        w = self.weights
        done = w.direct.full(engine, version, names, record=w.shadow is not None)
        if w.shadow is not None and names is None and not (done.failed or done.refused):
            w.shadow_version = version
        return PushResult(failed=done.failed or done.refused, sent=done.sent)

    def mismatches(self, engine) -> tuple[list[str] | None, str]:
        """(HF names whose server copy differs from the trainer's, "") on every rank, or
        (None, the server's error): vLLM's own checksums against the ones the trainer's
        weights make (``weight_sync.checksums``)."""
        return self._checksum_mismatches(engine)

    def _checksum_mismatches(self, engine) -> tuple[list[str] | None, str]:
        """The HF tensors behind every vLLM parameter whose checksum on the server differs
        from what the trainer's weights make (``weight_sync.checksums``); the full weights
        stream to rank 0 a bucket at a time (a TP gather per parameter, as a full push
        over the pipe), so this costs a full push's gathers without its sends."""
        from megatron_logra.weight_sync.checksums import ChecksumBuilder

        w = self.weights
        builder = ChecksumBuilder(w.arch, w.direct.engine_tp) if w.rank == 0 else None
        for bucket in w.buckets():  # rank 0; the others send inside
            for name, tensor in bucket:
                builder.add(name, tensor)
        bad, failed = [[]], ""
        if w.rank == 0:
            try:
                bad = [builder.mismatched(engine.checksums())]
            except EngineError as exc:
                bad, failed = [None], str(exc)
        dist.broadcast_object_list(bad, src=0)
        return bad[0], failed

    def resend_mismatches(self, engine, version: int) -> tuple[PushResult, int]:
        """Compare the server's weights with the trainer's (checksums) and resend the
        mismatching tensors in full: (result, number of mismatching tensors)."""
        w = self.weights
        bad, failed = self.mismatches(engine)
        if bad is None:
            return PushResult(failed=failed or "checksum check failed"), 0
        if not bad:
            return PushResult(), 0
        if w.rank == 0:
            print(f"weight sync: checksum mismatch in {len(bad)} tensors "
                  f"({bad[:3]}...); resending them in full", flush=True)
        names = sorted({w.hf_source[h] for h in bad})
        return self.push(engine, version, names=names), len(bad)


class SparseDeltaPush:
    transport = Transport.SPARSE_DELTA
    verifiable = True  # the server holds what a full push would send: checksums apply

    def __init__(self, weights: TrainerWeights):
        self.weights = weights
        weights.track_changes()

    def ready(self, version: int) -> bool:
        """Whether the senders' recorded base is ``version - 1`` (rank 0 decides)."""
        w = self.weights
        return w.shadow is not None and w.shadow_version == version - 1

    def deliver(self, engine, version: int) -> Delivery:
        return self.weights.direct.sparse(engine, version)

    def applied(self, version: int) -> None:
        self.weights.shadow_version = version


class SketchDeltaPush:
    transport = Transport.SKETCH_DELTA
    verifiable = True

    def __init__(self, weights: TrainerWeights, optimizer):
        """Collective. ``optimizer``: a ``LograOptimizer`` keeping each update's (D,
        coefficient, seed) (``keep_updates``, set from ``--weight-sync sketch-delta``)."""
        if not getattr(optimizer, "keep_updates", False):
            raise ValueError("sketch-delta weight sync needs a LograOptimizer that keeps its "
                             "updates (keep_updates): run with --optimizer logra "
                             "--weight-sync sketch-delta")
        self.weights, self.optimizer = weights, optimizer
        names = canonical_param_names(weights.model[0], weights.arch)
        trained = {names[n] for n, p in unwrap(weights.model[0]).named_parameters()
                   if p.requires_grad}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ([s.name for s in optimizer.sketches.slots], trained))
        sketched = {n for ns, _ in everyone for n in ns}
        trained = set().union(*(t for _, t in everyone))
        # the unsketched params that train go in full with each delta; frozen ones
        # (--logra-untargeted frozen) never change and are not sent
        self.unsketched = [n for n in megatron_param_names(weights.arch)
                           if n not in sketched and n in trained]

    def ready(self, version: int) -> bool:
        return True

    def deliver(self, engine, version: int) -> Delivery:
        return self.weights.direct.sketch(engine, version, self.optimizer, self.unsketched)

    def applied(self, version: int) -> None:
        pass


class LoraAdapterPush:
    """LoRA: the server keeps the frozen base (pushed in full, unmerged) and serves the
    adapter through vLLM's LoRA support (runtime loading); each update sends the adapter
    only, in PEFT's format (q/k/v and gate/up sharing the fused layer's A)."""

    transport = Transport.LORA_ADAPTER
    verifiable = False  # the server's weights are the base: nothing more to check

    def __init__(self, weights: TrainerWeights, lora):
        """``lora``: the run's ``LoraConfig``; ``weights`` must push the base unmerged."""
        if weights.merged:
            raise ValueError("lora-adapter sync needs the base weights pushed unmerged")
        self.weights, self.lora = weights, lora

    def ready(self, version: int) -> bool:
        return True

    def deliver(self, engine, version: int) -> Delivery:
        return deliver_through_rank0(self, engine, version)

    def gather(self):
        """(PEFT's adapter tensors in the engine dtype, its adapter_config) on rank 0."""
        from megatron_logra.convert.lora_export import (adapted_weights, peft_config,
                                                        peft_tensors)

        w = self.weights
        adapters = gather_adapters(w.model, w.arch)
        if adapters is None:
            return None
        tensors = {k: v.to(w.dtype) for k, v in peft_tensors(
            w.arch, adapters.__getitem__, adapted_weights(list(adapters))).items()}
        return tensors, peft_config(self.lora, tensors, base_model="")

    def send(self, engine, payload, version: int) -> int:
        return engine.set_adapter(*payload, version)

    def applied(self, version: int) -> None:
        pass

    def follow_full(self, engine, version: int, result: PushResult) -> PushResult:
        """After a full push of the base: the adapter too (collective)."""
        payload = self.gather()
        if self.weights.rank != 0 or result.failed:
            return result
        try:
            result.sent += self.send(engine, payload, version)
        except (EngineError, ValueError) as exc:
            result.failed = str(exc)
        return result


def deliver_through_rank0(delta, engine, version: int) -> Delivery:
    """Every rank's part of ``delta`` gathered on rank 0, which sends it to the engine;
    the outcome broadcast to every rank."""
    payload = delta.gather()
    status = ["", "", 0]  # [refused, failed, sent]: rank 0's on every rank
    if dist.get_rank() == 0:
        try:
            status[2] = delta.send(engine, payload, version)
        except PushRefused as exc:
            status[0] = str(exc)
        except EngineError as exc:
            status[1] = str(exc)
    # every rank must know of a failure too: what follows a push is collective
    dist.broadcast_object_list(status, src=0)
    return Delivery(*status)
