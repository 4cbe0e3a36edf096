"""``EngineLink``: the RL stage's one handle on the rollout engines (collective calls).

It owns the engines (trainer rank 0 only: ``rollout.vllm_server.VllmServer``, vLLM's own
server, started here or at ``--rollout-engine-url``; ``--rollout-replicas`` of them) and
the trainer's side of weight sync (``sync.WeightSync``), and keeps every engine serving
the trainer's weights:

- ``push(version)``: the trainer's weights become ``version`` in every engine, one after
  the other (each has its own weight group). The very first push starts (or connects to)
  the servers, which run on dummy weights until it brings the trainer's. A failed push
  restarts that engine alone and pushes to it again (three tries); the others go on.
- a server started here is (re)started only at a push, where every rank takes part: an
  engine on GPUs the trainer shares is sized just before from what those GPUs have free
  then (``sizer``: ``rollout.engine_memory``), since the trainer's state and cached
  blocks grow after the first start; a failure ends the server (``VllmServer.halt``) and
  the next push starts it again.
- ``generate(requests, version)``: completions from the engines serving ``version``
  (rank 0; None elsewhere): the requests in ``replicas`` contiguous parts, one per
  engine, generated at the same time and returned in order; a failure restarts the
  engines that failed, pushes the weights to them again and retries (three tries).
- ``generate_here``: the same on rank 0 alone, no restart (an error is raised): what
  generation beside training (``--async-rollouts``) uses; the stage recovers later.
"""

from __future__ import annotations

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from megatron_logra.rollout.types import Completion, SampleRequest, ServerSpec
from megatron_logra.rollout.vllm_server import VllmServer
from megatron_logra.runtime.collectives import barrier, from_rank0, rank0_value
from megatron_logra.runtime.device import current_device, release_cached_memory
from megatron_logra.runtime.progress import Progress
from megatron_logra.weight_sync.contract import EngineError
from megatron_logra.weight_sync.sync import SyncStats, WeightSync

TRIES = 3


def speed_note(vllm_postfix: str) -> str:
    """vLLM's "est. speed input: X toks/s, output: Y toks/s" -> "Y tokens/s out"."""
    match = re.search(r"output: ([0-9.]+) toks/s", vllm_postfix)
    return f"{float(match.group(1)):.0f} tokens/s out" if match else vllm_postfix


def split_evenly(items: list, parts: int) -> list[list]:
    """``items`` in ``parts`` contiguous runs, the first ones one longer where they do not
    divide (a fixed split: the same requests always go to the same engine)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(items[start:end])
        start = end
    return out


class EngineLink:
    def __init__(self, sync: WeightSync, engine_cfgs: list[ServerSpec] | None,
                 sleep_mode: bool = False, replicas: int = 1, sizer=None):
        """``engine_cfgs``: rank 0's settings of each engine (None on every other rank): a
        server at its ``url``, or one started here from its ``model_dir`` (config and
        tokenizer; the first push brings the weights). ``replicas`` (every rank): how many.
        ``sleep_mode`` (every rank): the engines are colocated and take turns
        (``release``; pushes and generation wake them). ``sizer`` (every rank; None: the
        configs' memory fraction): ``sizer(replicas)`` -> {replica: vLLM's
        ``gpu_memory_utilization``}, collective (``engine_memory.SharedGpuSizer``)."""
        self.sync, self.engine_cfgs, self.sleep_mode = sync, engine_cfgs, sleep_mode
        self.replicas, self.sizer = replicas, sizer
        self.rank = dist.get_rank()
        self.engines: list[VllmServer | None] = [None] * replicas  # rank 0, from the 1st push
        self.asleep: list[set[str]] = [set() for _ in range(replicas)]  # rank 0, colocated
        self.pool = ThreadPoolExecutor(replicas) if replicas > 1 and self.rank == 0 else None

    @property
    def engine(self) -> VllmServer | None:
        """Rank 0's first engine (None elsewhere, and before the first push)."""
        return self.engines[0]

    @property
    def stats(self) -> SyncStats:
        return self.sync.stats

    # --- pushes --------------------------------------------------------------------------
    def push(self, version: int, transport: str | None = None) -> None:
        """Push the trainer's weights as ``version`` into every engine; restart an engine
        and push to it again on failure. ``transport`` forces one (tests, benchmarks)."""
        if self.replicas > 1:  # start the ones not running all at once
            self._start_engines(list(range(self.replicas)))
        for replica in range(self.replicas):
            self.push_to(replica, version, transport)

    def push_to(self, replica: int, version: int, transport: str | None = None) -> None:
        """Push to engine ``replica`` alone (collective)."""
        self._wake(replica, ["weights"])
        self.sync.use(replica)
        for _ in range(TRIES):
            t0 = time.perf_counter()
            failed, sent = self._push_once(replica, version, transport)
            failed = rank0_value(failed)  # rank 0's outcome decides for every rank
            self.stats.seconds += time.perf_counter() - t0
            if not failed:
                self.stats.bytes += sent
                self.stats.pushes += 1
                return
            if self.rank == 0:
                print(f"weight push{' to ' + self._name(replica) if self.replicas > 1 else ''} "
                      f"failed ({failed}); "
                      f"restarting the engine", flush=True)
                self._restart(replica)
        raise RuntimeError(f"weight push failed {TRIES} times: see the engine errors above")

    def _push_once(self, replica: int, version: int, transport: str | None) -> tuple[str, int]:
        """(failure message or "", bytes sent)."""
        failed = self._start_engines([replica])[replica]
        if failed:
            return failed, 0
        result = self.sync.push(self.engines[replica], version, transport)
        return result.failed, result.sent

    def _start_engines(self, replicas: list[int]) -> dict[int, str]:
        """Collective. Rank 0 starts (or connects to) those of ``replicas`` that are not
        running, at the same time (each in a thread of ``pool``), each sized by ``sizer``
        first (every rank takes part; a start that cannot fit is refused on every rank):
        {replica: its failure, or ""} on every rank (one that failed is started again by
        its push)."""
        down = rank0_value([r for r in replicas if self._needs_start(r)]
                           if self.rank == 0 else None)
        if not down:
            return {r: "" for r in replicas}
        sizes = self.sizer(down) if self.sizer is not None else {}

        def start() -> dict[int, str]:  # rank 0
            if self.pool is not None and len(down) > 1:
                return dict(zip(down, self.pool.map(
                    lambda r: self._start_here(r, sizes.get(r)), down)))
            return {r: self._start_here(r, sizes.get(r)) for r in down}
        failed = from_rank0(start)
        return {r: failed.get(r, "") for r in replicas}

    def _needs_start(self, replica: int) -> bool:
        """Rank 0: engine ``replica`` was never started, or was ended by a failure."""
        engine = self.engines[replica]
        return engine is None or engine.down

    def _start_here(self, replica: int, utilization: float | None = None) -> str:
        """Rank 0 connects to engine ``replica``, starting it (again) if it is ours and not
        running, with vLLM's memory fraction ``utilization`` (None: the config's); the
        failure, or ""."""
        engine = self.engines[replica]
        if engine is not None and not engine.down:
            return ""
        cfg = self.engine_cfgs[replica]
        if utilization is not None:
            cfg = replace(cfg, gpu_memory_utilization=utilization)
        asked = "" if utilization is None else f", {utilization:.3f} of its GPUs' memory"
        which = f" {replica}" if self.replicas > 1 else ""
        try:
            if engine is not None:  # ours, ended by a failure: a fresh server in its place
                engine.start_again(utilization)
                print(f"rollout engine{which}: vLLM's server restarted in "
                      f"{engine.startup_s:.1f}s{asked}", flush=True)
                return ""
            url = cfg.engine.engine_url
            if url:  # a server the user runs: connect, the first push is full
                engine = VllmServer(url, cfg.request_timeout_s, cfg.startup_timeout_s,
                                    adapter_root=self._adapter_root(cfg))
                print(f"rollout engine: the vLLM server at {url} (TP{engine.world_size}, "
                      f"serving {engine.model}); its weights are replaced by the first push",
                      flush=True)
            else:  # vLLM's server, started here
                log = f"engine-{replica}.log" if replica else "engine.log"
                engine = VllmServer.local(cfg, Path(cfg.model_dir).parent / log,
                                          cuda=current_device().type == "cuda",
                                          adapter_root=self._adapter_root(cfg))
                print(f"rollout engine{which}: vLLM's server up in {engine.startup_s:.1f}s at "
                      f"{engine.url} (vLLM {cfg.engine.dtype}, "
                      f"TP{cfg.engine.tensor_parallel_size}, dummy "
                      f"weights until the first push{asked})", flush=True)
        except EngineError as exc:
            return f"engine start-up: {exc}"
        self.engines[replica] = engine
        return ""

    def _name(self, replica: int) -> str:
        """"engine R" when there are several engines, else "engine"."""
        return f"engine {replica}" if self.replicas > 1 else "engine"

    @staticmethod
    def _adapter_root(cfg: ServerSpec) -> str:
        name = f"adapters-{cfg.replica}" if cfg.replica else "adapters"
        return str(Path(cfg.model_dir).parent / name)

    # --- colocated (engines started with sleep_mode) ---------------------------------------
    def release(self) -> None:
        """Collective. The trainer's turn: colocated engines release their weights and KV
        cache (rank 0), and no rank goes on before they have (nothing for other
        placements). A failure ends the engine (the next push starts and resyncs it)."""
        if not self.sleep_mode:
            return
        if self.rank == 0:
            for replica, engine in enumerate(self.engines):
                if engine is None or engine.down:
                    continue
                try:
                    engine.sleep()
                    self.asleep[replica] = {"weights", "kv_cache"}
                except EngineError as exc:
                    print(f"{self._name(replica)} sleep failed ({exc}); restarting the "
                          f"engine", flush=True)
                    self._restart(replica)
        barrier()  # the others train only once the engines have let go of the GPUs

    def _wake(self, replica: int, tags: list[str]) -> None:
        """Collective. Every rank frees its cached device memory, and once all have, rank
        0's engine ``replica`` takes back ``tags`` (released by ``release``); a failure
        ends it (the push that follows starts it again)."""
        if not self.sleep_mode:
            return
        release_cached_memory()
        barrier()  # the engine takes its memory only after every rank gave its cache back
        wanted = [t for t in tags if t in self.asleep[replica]]
        if self.rank != 0 or not wanted:
            return
        try:
            self.engines[replica].wake(wanted)
            self.asleep[replica] -= set(wanted)
        except EngineError as exc:
            print(f"{self._name(replica)} wake-up failed ({exc}); restarting the "
                  f"engine", flush=True)
            self._restart(replica)

    def _restart(self, replica: int) -> None:
        """Rank 0, after a failure of engine ``replica``: a server started here ends now and
        the next push starts it again (``_start_engines``: sized then, with every rank);
        one the user runs is waited for and rejoined at the next push."""
        self.asleep[replica] = set()  # a fresh engine starts awake
        engine = self.engines[replica]
        if engine is None or engine.down:  # not running: the next push starts it
            return
        self.stats.restarts += 1
        if engine.owner is not None:
            engine.halt()
            return
        try:
            engine.restart()
        except EngineError as exc:  # the next push connects afresh
            print(f"{self._name(replica)} restart failed ({exc}); connecting anew at the "
                  f"next push", flush=True)
            self.engines[replica] = None

    # --- generation ------------------------------------------------------------------------
    def generate(self, requests: list[SampleRequest] | None, version: int,
                 phase: str = "rollouts") -> list[Completion] | None:
        """Completions of ``requests`` (rank 0), restarting and resyncing failed engines;
        a progress line ``[phase]`` shows samples done and vLLM's tokens/s."""
        for replica in range(self.replicas):
            self._wake(replica, ["weights", "kv_cache"])
        for _ in range(TRIES):
            done, failed = None, []
            if self.rank == 0:
                try:
                    done = self.generate_here(requests, version, phase)
                except _ReplicaErrors as exc:
                    failed = exc.replicas
                    which = f"s {failed}" if self.replicas > 1 else ""
                    print(f"rollout failed ({exc}); restarting the engine{which}", flush=True)
                    for replica in failed:
                        self._restart(replica)
            failed = rank0_value(failed)  # the others follow rank 0's engines
            if not failed:
                return done
            for replica in failed:
                self.push_to(replica, version)
        raise RuntimeError(f"rollouts failed {TRIES} times: see the engine errors above")

    def generate_here(self, requests: list[SampleRequest], version: int,
                      phase: str = "rollouts") -> list[Completion]:
        """Rank 0: the completions of ``requests`` from every engine serving ``version``, in
        order; raises EngineError (naming the engines that failed) without restarting."""
        parts = split_evenly(requests, self.replicas)
        with Progress(phase, len(requests), "samples") as progress:
            counts, lock = [0] * self.replicas, threading.Lock()

            def one(replica: int) -> list[Completion]:
                engine = self.engines[replica]
                if engine is None or engine.down:
                    raise EngineError(f"engine {replica} is not running")

                def on_progress(n, _, note):
                    with lock:
                        counts[replica] = n
                        progress.update(sum(counts), speed_note(note))
                return engine.generate(parts[replica], version, on_progress, phase)
            if self.pool is None:
                outcomes = [_outcome(one, 0)]
            else:
                outcomes = list(self.pool.map(lambda r: _outcome(one, r), range(self.replicas)))
        errors = {r: err for r, (_, err) in enumerate(outcomes) if err is not None}
        if errors:
            raise _ReplicaErrors(errors)
        return [c for done, _ in outcomes for c in done]

    def close(self) -> None:
        for engine in self.engines:
            if engine is not None:
                engine.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
        self.sync.close()


def _outcome(fn, replica: int) -> tuple[list | None, EngineError | None]:
    try:
        return fn(replica), None
    except EngineError as exc:
        return None, exc


class _ReplicaErrors(EngineError):
    """Engines that failed a generation: ``replicas`` (their indices) and why."""

    def __init__(self, errors: dict[int, EngineError]):
        self.replicas = sorted(errors)
        if list(errors) == [0]:
            super().__init__(str(errors[0]))  # one engine (or the first): its error as it is
        else:
            super().__init__("; ".join(f"engine {r}: {e}" for r, e in sorted(errors.items())))
