"""Generation beside training (``--async-rollouts``): rank 0 generates the next batches
in a background thread while every rank trains on this one.

Per update u at weights version v (``rl.stage.RLStage.step``):

1. ``take(u, v)``: batch u's samples on every rank (generated earlier, at version
   ``v - 1`` one step off, or now if none was started);
2. ``start(u + k, v)`` for k = 1 .. --max-staleness: the engines generate the coming
   batches with weights v, in order, in rank 0's thread;
3. the trainer trains on batch u (every rank), making version v + 1;
4. ``wait_idle()``: rank 0 waits until the engines finish what they were generating
   (the push replaces their weights in place), then every rank pushes v + 1.

What an update waits for at 1 and 4 is its ``time_waiting_s`` (``training.throughput``);
the background generation's own seconds (``rollout_time_s``) overlap training and are
not part of the update's time split.

An update takes max(generation, training) + push instead of their sum. The thread does
rank 0's own work only (generation, scoring, advantages: no collective); whatever it
hits (an engine that died) comes back at ``take``, where every rank learns it: the
batches in flight are discarded, the engines are restarted and resynced, and the batch
is generated again at the current weights, counted in ``rollouts_regenerated``. No
sample is lost silently.
"""

from __future__ import annotations

import copy
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from megatron_logra.rl.policy_loss import RolloutSample
from megatron_logra.rl.sample_source import SampleSource
from megatron_logra.weight_sync.contract import EngineError
from megatron_logra.runtime.collectives import from_rank0


class SamplesAhead:
    def __init__(self, source: SampleSource, train_iters: int):
        self.source, self.train_iters = source, train_iters
        self.rank0 = source.rank == 0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollouts") if self.rank0 else None
        self.started: dict[int, int] = {}  # update -> the version generating it (every rank)
        self.futures: dict[int, Future] = {}  # rank 0
        self.baseline = None  # rank 0: the generating side's reward baseline (its own copy)

    def start(self, update: int, version: int) -> None:
        """Batch ``update`` is generated at ``version`` in the background (every rank
        calls; rank 0 starts it). Nothing past the run's last update, nothing twice."""
        if update in self.started or update >= self.train_iters:
            return
        self.started[update] = version
        if self.rank0:
            if self.baseline is None:  # from the trainer's (restored when resuming)
                self.baseline = copy.deepcopy(self.source.baseline)
            self.futures[update] = self.pool.submit(self.source.produce_here, update, version,
                                                    self.baseline)

    def take(self, update: int, version: int) -> tuple[list[RolloutSample], dict]:
        """Batch ``update``'s samples and figures on every rank (collective); a batch whose
        generation failed is generated again now, at ``version``."""
        self.start(update, version)
        t0 = time.perf_counter()
        outcome = from_rank0(lambda: self._collect(update))
        self.started.pop(update)
        if outcome[0] == "failed":
            samples, stats = self._regenerate(update, version, outcome[1])
        else:
            samples, stats = outcome[1]
            self.source.baseline.value = stats["baseline"]  # the trainer's copy moves here
        wall = time.perf_counter() - t0
        stats["rollout_wait_s"] = wall
        # generated beside training, the batch cost this update only the wait for it; one
        # generated again (a failure) cost its generation and scoring (they are its own)
        stats.setdefault("time_generation_s", 0.0)
        stats.setdefault("time_scoring_s", 0.0)
        stats["time_waiting_s"] = wall - stats["time_generation_s"] - stats["time_scoring_s"]
        return samples, stats

    def _collect(self, update: int) -> tuple:
        """Rank 0: ("done", (samples, stats)) or ("failed", why)."""
        try:
            return "done", self.futures.pop(update).result()
        except EngineError as exc:
            return "failed", str(exc)

    def _regenerate(self, update: int, version: int,
                    why: str) -> tuple[list[RolloutSample], dict]:
        if self.rank0:
            print(f"rollouts of update {update + 1} failed beside training ({why}); "
                  f"discarding the batches in flight and generating them again", flush=True)
            self.wait_idle()
            self.futures.clear()
            self.baseline = None  # the batches in flight advanced it: start again from ours
        self.started.clear()
        samples, stats = self.source.rollout_batch(update, version)  # restarts and resyncs
        stats["rollouts_regenerated"] = 1
        return samples, stats

    def wait_idle(self) -> float:
        """Rank 0 waits until nothing is being generated (before a push); the seconds."""
        t0 = time.perf_counter()
        if self.rank0 and self.futures:
            wait(list(self.futures.values()))
        return time.perf_counter() - t0

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
