"""The trainer side of weight sync (``--weight-sync``): one push per update, a collective.

``WeightSync.push(engine, version)`` picks the transport (the same on every rank:
rank 0 decides and broadcasts), runs it and returns what happened; rank 0 talks to the
engine (``rl.engine.RolloutEngine``, None on other ranks and before it has started).

- full: every parameter streamed to rank 0 as HF tensors in buckets (``full_push``);
  before the engine exists, the tensors are returned for its start-up weights instead.
- sparse-delta: each sender's changed engine-dtype elements against what it last sent.
- sketch-delta (LoGRA): every rank's own rows of D with seeds; the unsketched params that
  train in full (none when they are frozen, the paper's setting).
A delta needs the engine at exactly the previous version (and, for sparse, senders
whose last sent tensors are that version); otherwise, on an anchor update
(``--weight-sync-anchor-interval``) and after a refusal, the push is full. Every
``--weight-sync-verify-interval``-th delta push is followed by a fingerprint check of
every HF tensor; a mismatching tensor is resent in full and counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_logra.bridge.fingerprint import same_fingerprint
from megatron_logra.bridge.sketch_delta import owned_updates
from megatron_logra.config import RLConfig
from megatron_logra.model.hf_mapping import hf_sources, megatron_param_names
from megatron_logra.model.provider import canonical_param_names, unwrap
from megatron_logra.rl.engine import EngineError, PushRefused
from megatron_logra.rl.weight_push import (full_push, plan_push, sparse_push,
                                           trainer_fingerprints)


@dataclass
class SyncStats:
    bytes: int = 0
    seconds: float = 0.0
    restarts: int = 0
    pushes: int = 0
    delta_pushes: int = 0
    fingerprint_mismatches: int = 0
    last_transport: str = "full"


@dataclass
class PushResult:
    failed: str = ""  # the engine's error ("" when it worked)
    sent: int = 0  # bytes
    startup_tensors: dict[str, torch.Tensor] | None = field(default=None)  # rank 0, no engine


def choose_transport(wanted: str, *, version: int, engine_version: int,
                     shadow_version: int | None, anchor_interval: int) -> str:
    """The transport of the push of ``version``: ``wanted`` when a delta can be applied
    (the engine serves version - 1; for sparse-delta the senders' last sent tensors are
    version - 1 too, ``shadow_version``, None when not recorded) and this is not an
    anchor update (every ``anchor_interval``-th version, 0: none), else "full"."""
    if wanted == "full" or engine_version != version - 1:
        return "full"
    if wanted == "sparse-delta" and shadow_version != version - 1:
        return "full"
    if anchor_interval and version % anchor_interval == 0:
        return "full"
    return wanted


class WeightSync:
    def __init__(self, objs, rl: RLConfig, dtype: torch.dtype):
        self.objs, self.rl, self.dtype = objs, rl, dtype
        self.rank = dist.get_rank()
        self.plan = plan_push(objs.model, objs.arch)
        self.hf_source = hf_sources(objs.arch)
        self.stats = SyncStats()
        # sparse-delta: what each sender last sent (engine dtype), and its version
        self.shadow: dict[str, torch.Tensor] | None = None
        self.shadow_version = -1
        if rl.weight_sync == "sparse-delta":
            self.track_changes()
        self.unsketched: list[str] | None = None
        if rl.weight_sync == "sketch-delta":
            self.keep_sketch_updates()

    def track_changes(self) -> None:
        """Record what every full push sends (the base of sparse deltas; one engine-dtype
        copy of the parameters each sender sends). Takes effect at the next full push."""
        if self.shadow is None:
            self.shadow = {}

    def keep_sketch_updates(self) -> None:
        """Keep each update's (D, coefficient, seed) for sketch deltas (collective). The
        unsketched params that train (any rank's, by canonical name) go in full with each
        delta; frozen ones (``--logra-untargeted frozen``) never change and are not sent."""
        optimizer = self.objs.optimizer
        optimizer.keep_updates = True
        names = canonical_param_names(self.objs.model[0], self.objs.arch)
        trained = {names[n] for n, p in unwrap(self.objs.model[0]).named_parameters()
                   if p.requires_grad}
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, ([s.name for s in optimizer.sketches.slots], trained))
        sketched = {n for ns, _ in everyone for n in ns}
        trained = set().union(*(t for _, t in everyone))
        self.unsketched = [n for n in megatron_param_names(self.objs.arch)
                           if n not in sketched and n in trained]

    # --- one push --------------------------------------------------------------------------
    def push(self, engine, version: int, transport: str | None = None) -> PushResult:
        """Push the trainer's weights as ``version``; ``transport`` forces one (tests,
        benchmarks; a delta still needs the engine at the previous version)."""
        self.stats.last_transport = self._transport(engine, version, transport)
        if self.stats.last_transport != "full":
            result = self._push_delta(engine, version, self.stats.last_transport)
            if result is not None:
                return result
            self.stats.last_transport = "full"  # refused (nothing applied): full weights
        return self._push_full(engine, version)

    def _transport(self, engine, version: int, wanted: str | None) -> str:
        choice = ["full"]
        if self.rank == 0 and engine is not None:
            shadow_version = self.shadow_version if self.shadow is not None else None
            choice = [choose_transport(wanted or self.rl.weight_sync, version=version,
                                       engine_version=engine.version,
                                       shadow_version=shadow_version,
                                       anchor_interval=self.rl.weight_sync_anchor_interval)]
        dist.broadcast_object_list(choice, src=0)
        return choice[0]

    def _full_buckets(self, names: list[str] | None = None, record: bool = True):
        return full_push(self.objs.model, self.objs.arch, self.plan, dtype=self.dtype,
                         bucket_bytes=self.rl.sync_bucket_mb * 2**20, names=names,
                         shadow=self.shadow if record else None)

    def _push_full(self, engine, version: int, names: list[str] | None = None) -> PushResult:
        """Every parameter (or ``names``) in full, then the commit. Without an engine
        (rank 0, start-up) the tensors come back in ``startup_tensors``."""
        starting = self.rank == 0 and engine is None
        out, saved = PushResult(), {}
        for bucket in self._full_buckets(names):  # rank 0; others send inside the generator
            if starting:
                saved.update(bucket)
            elif not out.failed:  # after a failure: drain, the other ranks are still sending
                try:
                    out.sent += engine.load(bucket)
                except (EngineError, ValueError) as exc:
                    out.failed = str(exc)
        if self.shadow is not None and names is None:
            self.shadow_version = version
        if self.rank != 0:
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

    def _push_delta(self, engine, version: int, kind: str) -> PushResult | None:
        """Every rank sends its own part to rank 0; each vLLM worker applies its shard of it
        in place. None: refused before anything was applied."""
        full = []
        if kind == "sketch-delta":
            mine = owned_updates(self.objs.optimizer)
            full = [t for bucket in self._full_buckets(self.unsketched) for t in bucket]
        else:
            mine = sparse_push(self.objs.model, self.objs.arch, self.plan, dtype=self.dtype,
                               shadow=self.shadow)
        everyone = [None] * dist.get_world_size() if self.rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        out, refused = PushResult(), [False]
        if self.rank == 0:
            payload = [x for part in everyone for x in part]
            versions = {"base_version": version - 1, "version": version}
            try:
                if kind == "sketch-delta":
                    out.sent = engine.sketch_delta(payload, full, **versions)
                else:
                    out.sent = engine.sparse_delta(payload, **versions)
            except PushRefused as exc:
                print(f"{kind} push refused ({exc}); pushing full weights", flush=True)
                refused = [True]
            except EngineError as exc:
                out.failed = str(exc)
        dist.broadcast_object_list(refused, src=0)
        if refused[0]:
            return None
        self.stats.delta_pushes += 1
        if kind == "sparse-delta":
            self.shadow_version = version
        every = self.rl.weight_sync_verify_interval
        if not out.failed and every and self.stats.delta_pushes % every == 0:
            checked = self._verify_fingerprints(engine, version)
            out.failed, out.sent = checked.failed, out.sent + checked.sent
        return out

    def _verify_fingerprints(self, engine, version: int) -> PushResult:
        """Trainer vs engine fingerprints of every HF tensor; resend the mismatches."""
        mine = trainer_fingerprints(self.objs.model, self.objs.arch, self.plan, dtype=self.dtype)
        bad = [[]]
        if self.rank == 0:
            try:
                theirs = engine.fingerprints(sorted(mine))
                bad = [[n for n in sorted(mine) if not same_fingerprint(mine[n], theirs[n])]]
            except EngineError as exc:
                bad = [None]
                failed = str(exc)
        dist.broadcast_object_list(bad, src=0)
        if bad[0] is None:
            return PushResult(failed=failed if self.rank == 0 else "fingerprint check failed")
        if not bad[0]:
            return PushResult()
        self.stats.fingerprint_mismatches += len(bad[0])
        if self.rank == 0:
            print(f"weight sync: fingerprint mismatch in {len(bad[0])} tensors "
                  f"({bad[0][:3]}...); resending them in full", flush=True)
        return self._push_full(engine, version, names=sorted({self.hf_source[h] for h in bad[0]}))
