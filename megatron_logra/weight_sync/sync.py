"""``WeightSync``: one push per update, over the transport ``--weight-sync`` asks for.

``WeightSync.push(engine, version)`` picks the transport (the same on every rank: rank
0 decides and broadcasts), runs it (``full_push``, ``sparse_delta_push``,
``sketch_delta_push``, ``lora_adapter_push``) and returns what happened
(``contract.Delivery``); the engine is a ``contract.PushTarget``. A delta needs the
engine at exactly the previous version (and, for sparse, senders whose last sent tensors
are that version); otherwise, on an anchor update (``--weight-sync-anchor-interval``)
and after a refusal, the push is full. Every ``--weight-sync-verify-interval``-th delta
push is followed by a check of the server's weights against the trainer's (vLLM's
checksums); a mismatching tensor is resent in full and counted. A push that fails says
so; the caller restarts the engine (``rl.synced_engines``: never this package).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from megatron_logra.runtime.collectives import from_rank0
from megatron_logra.weight_sync.config import WeightSyncConfig
from megatron_logra.weight_sync.contract import (Delivery, EngineError, PushTarget, Transport,
                                                 needs)
from megatron_logra.weight_sync.full_push import FullPush
from megatron_logra.weight_sync.lora_adapter_push import LoraAdapterPush
from megatron_logra.weight_sync.sketch_delta_push import SketchDeltaPush
from megatron_logra.weight_sync.sparse_delta_push import SparseDeltaPush
from megatron_logra.weight_sync.transport import TrainerWeights


@dataclass
class SyncStats:
    """The pushes' running figures (every rank; ``bytes``: rank 0's count)."""

    bytes: int = 0
    seconds: float = 0.0
    pushes: int = 0
    delta_pushes: int = 0
    checksum_mismatches: int = 0
    last_transport: str = Transport.FULL


def choose_transport(wanted: str, *, version: int, engine_version: int,
                     shadow_version: int | None, anchor_interval: int) -> str:
    """The transport of the push of ``version``: ``wanted`` when a delta can be applied
    (the engine serves version - 1; for sparse-delta the senders' last sent tensors are
    version - 1 too, ``shadow_version``, None when not recorded) and this is not an
    anchor update (every ``anchor_interval``-th version, 0: none), else "full"."""
    if wanted == Transport.FULL or engine_version < 0 or engine_version != version - 1:
        return Transport.FULL  # (-1: nothing committed, e.g. an engine on dummy weights)
    if wanted == Transport.SPARSE_DELTA and shadow_version != version - 1:
        return Transport.FULL
    if anchor_interval and version % anchor_interval == 0:
        return Transport.FULL
    return Transport(wanted)


class WeightSync:
    """The trainer's side of weight sync (collective: every rank calls every method)."""

    def __init__(self, cfg: WeightSyncConfig, model_chunks: list, arch, dtype: torch.dtype,
                 optimizer=None, lora=None, engine_tp: int = 1,
                 group_backend: str | None = None):
        """``optimizer``: the ``LograOptimizer`` whose updates a sketch-delta push sends;
        ``lora``: the run's ``LoraConfig`` (LoRA runs), for lora-adapter pushes;
        ``engine_tp``: the server's TP size (its worker count); ``group_backend``: the
        weight group's (gloo for a server on the trainer's own GPUs; None: the device's).
        The engine is vLLM's server (``rollout.vllm_server``): pushes go through its
        weight-transfer routes, checks by vLLM's checksums."""
        self.cfg = cfg
        adapter_mode = needs(cfg.transport).engine_serves_adapter
        if adapter_mode and lora is None:
            raise ValueError("--weight-sync lora-adapter sends a LoRA adapter: train with "
                             "--peft lora")
        self.weights = TrainerWeights(model_chunks, arch, dtype, cfg.bucket_mb * 2**20,
                                      engine_tp, merged=not adapter_mode,
                                      group_backend=group_backend)
        self.rank = self.weights.rank
        self.stats = SyncStats()
        self.forced: Transport | None = None  # ``forcing``'s transport
        self.full = FullPush(self.weights)
        self.deltas = {}
        self.adapter = None
        if cfg.transport == Transport.SPARSE_DELTA:
            self.deltas[Transport.SPARSE_DELTA] = SparseDeltaPush(self.weights)
        elif cfg.transport == Transport.SKETCH_DELTA:
            self.deltas[Transport.SKETCH_DELTA] = SketchDeltaPush(self.weights, optimizer)
        elif adapter_mode:
            self.adapter = self.deltas[Transport.LORA_ADAPTER] = LoraAdapterPush(self.weights,
                                                                                lora)

    @property
    def plan(self):
        """Who sends each parameter (``gathered_weights.PushPlan``; tests and benchmarks
        gather the trainer's weights by it)."""
        return self.weights.plan

    def track_changes(self) -> None:
        """Make sparse deltas possible (forced ones too): record what full pushes send."""
        self.deltas.setdefault(Transport.SPARSE_DELTA, SparseDeltaPush(self.weights))

    @contextmanager
    def forcing(self, transport: str):
        """Within it every push asks for ``transport`` instead of ``--weight-sync``'s (tests,
        benchmarks; a delta still needs the engine at the previous version, and a delta
        transport this run did not set up is refused)."""
        before, self.forced = self.forced, Transport(transport)
        try:
            yield
        finally:
            self.forced = before

    def use(self, replica: int, engine_tp: int | None = None) -> None:
        """The next pushes and checks go to engine ``replica`` (its own weight group), an
        engine at TP ``engine_tp`` (None: as last said for it)."""
        self.weights.direct.use(replica, engine_tp)

    def close(self) -> None:
        if self.weights.direct is not None:
            self.weights.direct.close()

    def engine_mismatches(self, engine: PushTarget) -> int | None:
        """How many HF tensors the server holds differently from the trainer (vLLM's
        checksums; every rank); None when the check failed."""
        bad, _ = self.full.mismatches(engine)
        return None if bad is None else len(bad)

    # --- one push --------------------------------------------------------------------------
    def push(self, engine: PushTarget | None, version: int) -> Delivery:
        """Push the trainer's weights as ``version`` (the transport ``--weight-sync`` asks
        for, or ``forcing``'s, when a delta can be used: ``choose_transport``)."""
        chosen = self._choose(engine, version, self.forced)
        self.stats.last_transport = chosen
        if chosen != Transport.FULL:
            result = self._push_delta(engine, version, self.deltas[chosen])
            if result is not None:
                return result
            self.stats.last_transport = Transport.FULL  # refused, nothing applied: full
        result = self.full.push(engine, version)
        if self.adapter is not None:  # the base went in full: the adapter follows it
            result = self.adapter.follow_full(engine, version, result)
        return result

    def _choose(self, engine, version: int, wanted: str | None) -> str:
        wanted = Transport(wanted or self.cfg.transport)
        delta = self.deltas.get(wanted)
        if wanted != Transport.FULL and delta is None:  # the same on every rank
            raise ValueError(f"a {wanted} push on a run set up for {self.cfg.transport}")

        def choose() -> str:  # rank 0, which holds the engine
            if engine is None:
                return Transport.FULL
            try:
                serving = engine.version
            except EngineError:  # the server died: the full push fails, the caller restarts it
                return Transport.FULL
            base = version - 1 if delta is not None and delta.ready(version) else None
            return choose_transport(wanted, version=version, engine_version=serving,
                                    shadow_version=base, anchor_interval=self.cfg.anchor_interval)
        return from_rank0(choose)

    def _push_delta(self, engine, version: int, delta) -> Delivery | None:
        """Every rank's part reaches the engine (``delta.deliver``); each vLLM worker applies
        its shard of it in place. None: refused before anything was applied."""
        done = delta.deliver(engine, version)
        if done.refused:
            if self.rank == 0:
                print(f"{delta.transport} push refused ({done.refused}); pushing full weights",
                      flush=True)
            return None
        if done.failed:  # the engine died: the caller restarts it and pushes in full
            return Delivery(failed=done.failed)
        out = Delivery(sent=done.sent if self.rank == 0 else 0)
        self.stats.delta_pushes += 1
        delta.applied(version)
        every = self.cfg.verify_interval
        if delta.verifiable and every and self.stats.delta_pushes % every == 0:
            checked, mismatches = self.full.resend_mismatches(engine, version)
            self.stats.checksum_mismatches += mismatches
            out = replace(out, failed=checked.failed, sent=out.sent + checked.sent)
        return out
