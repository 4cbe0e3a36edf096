"""Engine starts and turns on GPUs the trainer shares (``rollout.engines``,
``rollout.engine_memory``), and the RL side's resync after a failed push
(``rl.synced_engines``), checked on CPU in a world of one with stand-in engines:

- every start of a server, the first and each restart after a failure, asks vLLM for the
  memory its GPUs have free at that moment (``SharedGpuSizer``: each rank frees its cached
  blocks and reports ``torch.cuda.mem_get_info``, here a stand-in whose free memory
  shrinks as Adam's state would), and one that cannot fit is refused with the fix;
- several colocated engines are each sized from their own GPUs;
- a colocated engine's turns are fenced: no rank goes on before rank 0's engines slept,
  and an engine wakes only after every rank gave back its cached blocks.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.rl.synced_engines import SyncedEngines
from megatron_logra.rollout import engines as engines_module
from megatron_logra.rollout.engines import RolloutEngines
from megatron_logra.rollout.engine_memory import (ENGINE_OVERHEAD_BYTES, GIB, GpuMemory,
                                                 SharedGpuSizer, size_engines)
from megatron_logra.rollout.placement import EnginePlacement
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.runtime import device
from megatron_logra.weight_sync.contract import Delivery, EngineError
from megatron_logra.weight_sync.sync import SyncStats


class FakeEngine:
    """A server started here: records how it was (re)started, slept and woken."""

    def __init__(self, cfg: ServerSpec, events: list):
        self.owner, self.down, self.start_id, self.startup_s = object(), False, 1, 0.0
        self.url, self.world_size = "http://fake", cfg.engine.tensor_parallel_size
        self.utilizations = [cfg.gpu_memory_utilization]
        self.events = events

    def halt(self):
        self.down = True
        self.events.append("halt")

    def start_again(self, utilization=None):
        self.utilizations.append(utilization)
        self.start_id += 1
        self.down = False

    def sleep(self):
        self.events.append("sleep")

    def wake(self, tags):
        self.events.append(f"wake {','.join(tags)}")

    def close(self):
        pass


class FakeSync:
    """``WeightSync``'s face to ``SyncedEngines``: ``fail`` pushes fail, then they work."""

    def __init__(self, fail: int = 0):
        self.stats, self.fail, self.pushed = SyncStats(), fail, []

    def use(self, replica, engine_tp=None):
        pass

    def push(self, engine, version):
        self.pushed.append((engine, version))
        if self.fail:
            self.fail -= 1
            return Delivery(failed="the engine died")
        return Delivery(sent=1)

    def close(self):
        pass


@pytest.fixture
def world_of_one(monkeypatch):
    device.init_runtime()
    events: list = []
    started: list = []

    def local(cfg, log, cuda, adapter_root=None):
        engine = FakeEngine(cfg, events)
        started.append(engine)
        return engine
    monkeypatch.setattr(engines_module.VllmServer, "local", staticmethod(local))
    return events, started


def test_every_start_is_sized_from_what_the_gpu_has_free_then(world_of_one, monkeypatch):
    """The first start sees 60 of 80 GiB free; after a failure (the trainer's Adam state
    and cached blocks now hold more) the restart sees 30 GiB and asks vLLM for that, not
    for the first start's fraction (vLLM would refuse it: free < utilization x total);
    cached blocks are released before each measurement. Then 5 GiB: refused, naming the
    settings to change, on every rank."""
    events, started = world_of_one
    free = [60 * GIB, 30 * GIB, 5 * GIB]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (free.pop(0), 80 * GIB))
    monkeypatch.setattr(device, "release_cached_memory", lambda: events.append("release cache"))
    sizer = SharedGpuSizer(needed=10 * GIB, engine_tp=1, placements=[EnginePlacement("inherit")])
    link = SyncedEngines(RolloutEngines([ServerSpec("/m/init", 64)], sizer=sizer),
                         FakeSync(fail=1))
    link.push(0)
    engine = started[0]
    first, again = engine.utilizations
    assert first * 80 * GIB == pytest.approx(60 * GIB - ENGINE_OVERHEAD_BYTES)
    assert again * 80 * GIB == pytest.approx(30 * GIB - ENGINE_OVERHEAD_BYTES)
    assert events == ["release cache", "halt", "release cache"]
    assert link.engines.restarts == 1 and not engine.down
    engine.halt()  # another failure; the GPU now has 5 GiB free
    with pytest.raises(ValueError, match="does not fit beside the trainer.*"
                                         "--rollout-kv-cache-gib"):
        link.push(1)


def test_each_colocated_engine_is_sized_from_its_own_gpus():
    """Two colocated TP2 engines on node 0's GPUs 0-1 and 2-3: each is sized by the
    fullest of its own two GPUs (node 1's ranks and the other engine's GPUs do not count);
    one engine alone sits on the first TP GPUs."""
    def report(node, local, free):
        return (node, local, GpuMemory(free * GIB, 80 * GIB))
    reports = [report("0", 0, 50), report("0", 1, 40), report("0", 2, 20), report("0", 3, 30),
               report("1", 0, 1), report("1", 1, 1)]
    placements = [EnginePlacement("colocated", (0, 1), sleep_mode=True),
                  EnginePlacement("colocated", (2, 3), sleep_mode=True)]
    sizes = size_engines(reports, placements, [0, 1], engine_tp=2, needed=8 * GIB)
    assert sizes[0] * 80 * GIB == pytest.approx(40 * GIB - ENGINE_OVERHEAD_BYTES)
    assert sizes[1] * 80 * GIB == pytest.approx(20 * GIB - ENGINE_OVERHEAD_BYTES)
    alone = size_engines(reports, [EnginePlacement("inherit")], [0], engine_tp=2,
                         needed=8 * GIB)
    assert alone[0] == sizes[0]  # GPUs 0 and 1
    with pytest.raises(ValueError, match=r"rollout engine 1 on node 0's GPUs \[2, 3\]"):
        size_engines(reports, placements, [1], engine_tp=2, needed=25 * GIB)


def test_colocated_turns_are_fenced_by_barriers(world_of_one, monkeypatch):
    """Rank 0 puts its engines to sleep, then every rank meets at a barrier before it
    trains (another rank's training would otherwise allocate beside an engine still
    holding its memory); before a wake every rank frees its cached blocks and meets at a
    barrier, and only then does the engine take its memory back."""
    events, started = world_of_one
    monkeypatch.setattr(engines_module, "barrier", lambda: events.append("barrier"))
    monkeypatch.setattr(engines_module, "release_cached_memory",
                        lambda: events.append("release cache"))
    link = SyncedEngines(RolloutEngines([ServerSpec("/m/init", 64)], sleep_mode=True),
                         FakeSync())
    link.push(0)
    events.clear()
    link.release()
    assert events == ["sleep", "barrier"]
    events.clear()
    link.push(1)  # wakes the weights first
    assert events == ["release cache", "barrier", "wake weights"]
    link.engines.rank = 1  # what every other rank does: no engine, the same fences
    events.clear()
    link.release()
    link.engines.wake(0, ["kv_cache"])
    assert events == ["barrier", "release cache", "barrier"]


def test_a_failed_sleep_ends_the_engine_and_the_next_push_starts_it(world_of_one):
    events, started = world_of_one

    def refuse():
        raise EngineError("sleep refused")
    link = SyncedEngines(RolloutEngines([ServerSpec("/m/init", 64)], sleep_mode=True),
                         FakeSync())
    link.push(0)
    started[0].sleep = refuse
    link.release()
    assert started[0].down and link.engines.restarts == 1
    with pytest.raises(EngineError, match="not running"):
        link.generate_here([], 0)
    link.push(0)
    assert not started[0].down and len(started) == 1  # the same server object, started again
