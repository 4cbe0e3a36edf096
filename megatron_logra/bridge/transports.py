"""The trainer side of each weight-sync transport: one class each, every call a collective.

``TrainerWeights`` is what every transport reads: the policy's chunks in the Megatron
layout, who sends each parameter (``full_weights.plan_push``), the engine dtype, and
for sparse deltas what each sender last sent. Rank 0 talks to the engine
(``engine_client.RolloutEngine``, None on every other rank).

- ``FullPush``: every parameter (or some) streamed to rank 0 as HF tensors in buckets,
  then the commit; before the engine exists the tensors come back for its start-up.
- ``SparseDeltaPush``: each sender's changed engine-dtype elements against what it last
  sent (exact); needs a recorded base at the previous version.
- ``SketchDeltaPush`` (LoGRA): every rank's own rows of D with seeds, plus the unsketched
  params that train, in full (none when they are frozen, the paper's setting).
- ``LoraAdapterPush`` (LoRA): the adapter only, in PEFT's format, which vLLM serves on
  top of the base; the full push before it carries the base unmerged.
A delta's ``deliver`` (collective) gets it to the engine, which refuses (nothing applied)
unless it serves the base version. Over the rank-0 pipe (``--weight-sync-channel pipe``)
``gather`` collects every rank's part on rank 0 and ``send`` hands it to the engine;
over the direct channel (``bridge.direct``) every rank sends each vLLM worker its own
pieces, for full pushes too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_logra.bridge.direct import DirectChannel
from megatron_logra.bridge.fingerprint import same_fingerprint
from megatron_logra.bridge.full_weights import (full_push, gather_adapters, plan_push,
                                                sparse_push, trainer_fingerprints)
from megatron_logra.bridge.protocol import Delivery, EngineError, PushRefused, Transport
from megatron_logra.bridge.sketch_delta import owned_updates
from megatron_logra.model.hf_mapping import hf_sources, megatron_param_names
from megatron_logra.model.provider import canonical_param_names, unwrap
from megatron_logra.runtime.progress import Progress


@dataclass
class PushResult:
    failed: str = ""  # the engine's error ("" when it worked)
    sent: int = 0  # bytes
    startup_tensors: dict[str, torch.Tensor] | None = field(default=None)  # rank 0, no engine
    startup_adapter: tuple | None = None  # rank 0, no engine, lora-adapter sync: its payload


class TrainerWeights:
    """The policy's weights as the bridge reads them (built collectively, once per run)."""

    def __init__(self, model_chunks: list, arch, dtype: torch.dtype, bucket_bytes: int,
                 merged: bool = True, direct_engine_tp: int = 0,
                 server_checksums: bool = False):
        """``merged``: full pushes carry LoRA's adapters merged into their weights (an
        engine serving the adapter on its own takes the base: False).
        ``direct_engine_tp``: > 0, pushes go over the direct channel to an engine of this
        TP size (``direct``); 0: over the rank-0 pipe. ``server_checksums``: the engine is a
        vLLM server, checked by vLLM's weight checksums instead of fingerprints."""
        self.model, self.arch, self.dtype, self.bucket_bytes = model_chunks, arch, dtype, bucket_bytes
        self.merged, self.server_checksums = merged, server_checksums
        self.rank = dist.get_rank()
        self.plan = plan_push(model_chunks, arch)
        self.direct = DirectChannel(model_chunks, arch, self.plan, dtype, direct_engine_tp,
                                    bucket_bytes) if direct_engine_tp else None
        self.hf_source = hf_sources(arch)  # HF tensor name -> canonical megatron param
        # sparse-delta: what each sender last sent (engine dtype), and its version
        self.shadow: dict[str, torch.Tensor] | None = None
        self.shadow_version = -1

    def track_changes(self) -> None:
        """Record what every full push sends (the base of sparse deltas; one engine-dtype
        copy of the parameters each sender sends). Takes effect at the next full push."""
        if self.shadow is None:
            self.shadow = {}

    def buckets(self, names: list[str] | None = None, record: bool = True):
        """Full HF tensors in buckets on rank 0 (see ``full_weights.full_push``)."""
        return full_push(self.model, self.arch, self.plan, dtype=self.dtype,
                         bucket_bytes=self.bucket_bytes, names=names,
                         shadow=self.shadow if record else None, merged=self.merged)

    def fingerprints(self) -> dict[str, float]:
        return trainer_fingerprints(self.model, self.arch, self.plan, dtype=self.dtype)


class FullPush:
    transport = Transport.FULL

    def __init__(self, weights: TrainerWeights):
        self.weights = weights

    def push(self, engine, version: int, names: list[str] | None = None) -> PushResult:
        """Every parameter (or ``names``, canonical) in full, then the commit. Without an
        engine (rank 0, start-up) the tensors come back in ``startup_tensors``."""
        w = self.weights
        if w.direct is not None:
            return self._push_direct(engine, version, names)
        starting = w.rank == 0 and engine is None
        out, saved = PushResult(), {}
        progress, moved = Progress("weight sync", None, "MB", enabled=w.rank == 0), 0
        for bucket in w.buckets(names):  # rank 0; the others send inside the generator
            if starting:
                saved.update(bucket)
            elif not out.failed:  # after a failure: drain, the other ranks are still sending
                try:
                    out.sent += engine.load(bucket)
                except (EngineError, ValueError) as exc:
                    out.failed = str(exc)
            moved += sum(t.numel() * t.element_size() for _, t in bucket)
            progress.update(moved // 10**6)
        progress.close()
        if w.shadow is not None and names is None:
            w.shadow_version = version
        if w.rank != 0:
            return PushResult()
        if starting:
            return PushResult(sent=sum(t.numel() * t.element_size() for t in saved.values()),
                              startup_tensors=saved)
        if not out.failed:
            try:
                engine.commit(version)
            except EngineError as exc:
                out.failed = str(exc)
        return out

    def _push_direct(self, engine, version: int, names: list[str] | None) -> PushResult:
        """Every rank sends each vLLM worker its pieces; the engine must be running."""
        w = self.weights
        done = w.direct.full(engine, version, names, record=w.shadow is not None)
        if w.shadow is not None and names is None and not (done.failed or done.refused):
            w.shadow_version = version
        return PushResult(failed=done.failed or done.refused, sent=done.sent)

    def mismatches(self, engine) -> tuple[list[str] | None, str]:
        """(HF names whose trainer and engine fingerprints differ, "") on every rank, or
        (None, the engine's error). A vLLM server is checked by vLLM's own checksums."""
        if self.weights.server_checksums:
            return self._checksum_mismatches(engine)
        mine = self.weights.fingerprints()
        bad, failed = [[]], ""
        if self.weights.rank == 0:
            try:
                theirs = engine.fingerprints(sorted(mine))
                bad = [[n for n in sorted(mine) if not same_fingerprint(mine[n], theirs[n])]]
            except EngineError as exc:
                bad, failed = [None], str(exc)
        dist.broadcast_object_list(bad, src=0)
        return bad[0], failed

    def _checksum_mismatches(self, engine) -> tuple[list[str] | None, str]:
        """The HF tensors behind every vLLM parameter whose checksum on the server differs
        from what the trainer's weights make (``weight_sync.checksums``); the full weights
        stream to rank 0 a bucket at a time (a TP gather per parameter, as a full push
        over the pipe), so this costs a full push's gathers without its sends."""
        from megatron_logra.weight_sync.checksums import ChecksumBuilder

        w = self.weights
        builder = ChecksumBuilder(w.arch, w.direct.engine_tp) if w.rank == 0 else None
        for bucket in w.buckets(record=False):  # rank 0; the others send inside
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
        """Compare trainer and engine fingerprints of every HF tensor and resend the
        mismatching ones in full: (result, number of mismatching tensors)."""
        w = self.weights
        bad, failed = self.mismatches(engine)
        if bad is None:
            return PushResult(failed=failed or "fingerprint check failed"), 0
        if not bad:
            return PushResult(), 0
        if w.rank == 0:
            print(f"weight sync: fingerprint mismatch in {len(bad)} tensors "
                  f"({bad[:3]}...); resending them in full", flush=True)
        names = sorted({w.hf_source[h] for h in bad})
        return self.push(engine, version, names=names), len(bad)


class SparseDeltaPush:
    transport = Transport.SPARSE_DELTA
    verifiable = True  # the engine holds what a full push would send: fingerprints apply

    def __init__(self, weights: TrainerWeights):
        self.weights = weights
        weights.track_changes()

    def ready(self, version: int) -> bool:
        """Whether the senders' recorded base is ``version - 1`` (rank 0 decides)."""
        w = self.weights
        return w.shadow is not None and w.shadow_version == version - 1

    def deliver(self, engine, version: int) -> Delivery:
        w = self.weights
        if w.direct is not None:
            return w.direct.sparse(engine, version)
        return deliver_through_rank0(self, engine, version)

    def gather(self) -> list | None:
        """Every sender's changed elements, on rank 0 (None elsewhere)."""
        w = self.weights
        return _gather_to_rank0(sparse_push(w.model, w.arch, w.plan, dtype=w.dtype,
                                            shadow=w.shadow))

    def send(self, engine, payload, version: int) -> int:
        return engine.sparse_delta(payload, base_version=version - 1, version=version)

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
        w = self.weights
        if w.direct is not None:
            return w.direct.sketch(engine, version, self.optimizer, self.unsketched)
        return deliver_through_rank0(self, engine, version)

    def gather(self):
        """(every rank's rows of D with seeds, the unsketched tensors) on rank 0."""
        full = [t for bucket in self.weights.buckets(self.unsketched) for t in bucket]
        updates = _gather_to_rank0(owned_updates(self.optimizer))
        return None if updates is None else (updates, full)

    def send(self, engine, payload, version: int) -> int:
        updates, full = payload
        return engine.sketch_delta(updates, full, base_version=version - 1, version=version)

    def applied(self, version: int) -> None:
        pass


class LoraAdapterPush:
    """LoRA: the engine keeps the frozen base (pushed in full, unmerged) and serves the
    adapter through vLLM's LoRA support; each update sends the adapter only, in PEFT's
    format (q/k/v and gate/up sharing the fused layer's A)."""

    transport = Transport.LORA_ADAPTER
    verifiable = False  # the engine's weights are the base: nothing to fingerprint

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
        """After a full push of the base: the adapter too (collective). Before the engine
        exists (start-up) rank 0 keeps it in ``startup_adapter`` for the new engine."""
        payload = self.gather()
        if self.weights.rank != 0 or result.failed:
            return result
        if engine is None:
            result.startup_adapter = payload
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


def _gather_to_rank0(mine: list) -> list | None:
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    return [x for part in everyone for x in part] if everyone is not None else None
