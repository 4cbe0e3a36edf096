"""``RolloutEngines``: the RL stage's rollout engines, vLLM's own servers (collective calls).

It owns where they run and what they are started with (``RolloutEngines.placed``: the
placement on node 0, ``place_engines`` and ``rollout.placement``, and one ``ServerSpec``
per ``--rollout-replicas`` engine, rank 0), the servers themselves (trainer rank 0 only:
``rollout.vllm_server.VllmServer``, started here or at ``--rollout-engine-url``) and
their life cycle:

- ``start(replicas)``: rank 0 starts (or connects to) those not running, at the same
  time; an engine on GPUs the trainer shares is sized just before from what those GPUs
  have free then (``sizer``: ``rollout.engine_memory``), since the trainer's state and
  cached blocks grow after the first start. A server started here runs on dummy
  weights until a push brings the trainer's.
- ``restart(replica)``: after a failure a server started here ends
  (``VllmServer.halt``) and the next ``start`` starts it again; one the user runs is
  waited for and rejoined. Every restart is counted (``restarts``).
- ``release`` / ``wake``: colocated engines take turns with the trainer (sleep mode).
- ``try_generate(requests, version)``: completions from the engines serving ``version``
  (rank 0; None elsewhere): the requests in ``replicas`` contiguous parts, one per
  engine, generated at the same time and returned in order. Engines that failed are
  restarted and reported to the caller, which must push the weights to them again
  before they serve (``rl.synced_engines``: this package never pushes).
- ``generate_here``: the same on rank 0 alone, no restart (an error is raised): what
  generation beside training (``--async-rollouts``) uses; the stage recovers later.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch.distributed as dist

from megatron_logra.rollout.config import EngineConfig
from megatron_logra.rollout.engine_memory import shared_gpu_sizer
from megatron_logra.rollout.placement import EnginePlacement, plan_placement, split_replicas
from megatron_logra.rollout.types import Completion, SampleRequest, ServerSpec
from megatron_logra.rollout.vllm_server import VllmServer
from megatron_logra.runtime.collectives import barrier, from_rank0, rank0_value
from megatron_logra.runtime.device import (current_device, node_devices,
                                           release_cached_memory)
from megatron_logra.runtime.progress import Progress
from megatron_logra.weight_sync.contract import EngineError


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


def place_engines(engine: EngineConfig) -> tuple[EnginePlacement, list[EnginePlacement]]:
    """Collective. Rank 0 plans where the engines run on its node (``rollout.placement``;
    a refusal is raised on every rank) -> (the whole placement, on every rank; each
    engine's share, on rank 0, empty elsewhere); node 0's trainer ranks keep off a
    dedicated engine's CPU cores."""
    cuda = current_device().type == "cuda"
    shares: list[EnginePlacement] = []

    def plan() -> EnginePlacement:
        remote = bool(engine.engine_urls)
        whole = plan_placement(
            engine.placement, engine.devices, engine_tp=engine.tensor_parallel_size,
            cuda=cuda, node_devices=node_devices(),
            local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
            remote_engine=remote, replicas=engine.engines)
        shares.extend([whole] * engine.engines if remote else split_replicas(
            whole, engine.replicas, engine.tensor_parallel_size, cuda=cuda,
            node_devices=node_devices(), visible=os.environ.get("CUDA_VISIBLE_DEVICES")))
        return whole
    placement = from_rank0(plan)
    if placement.trainer_cores and os.environ.get("GROUP_RANK", "0") == "0":
        os.sched_setaffinity(0, placement.trainer_cores)
    if dist.get_rank() == 0 and (placement.note or placement.devices):
        kind = "cores" if placement.trainer_cores else "GPUs"
        print(placement.note or f"rollout engine on {kind} {list(placement.devices)} of "
              f"node 0, dedicated", flush=True)
    return placement, shares


def engine_init_dir(model_dir: str, output_dir: str) -> Path:
    """Rank 0: ``OUTPUT_DIR/engine_init``, the model folder's config and tokenizer (the
    weights come with the first push)."""
    out = Path(output_dir) / "engine_init"
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                and not f.name.endswith(".index.json"):
            shutil.copy2(f, out / f.name)
    return out


class RolloutEngines:
    def __init__(self, specs: list[ServerSpec] | None, *, replicas: int = 1,
                 sleep_mode: bool = False, sizer=None,
                 placement: EnginePlacement | None = None):
        """``specs``: rank 0's settings of each engine (None on every other rank): a
        server at its ``engine.engine_url``, or one started here from its ``model_dir``
        (config and tokenizer; the first push brings the weights). ``replicas`` (every
        rank): how many. ``sleep_mode`` (every rank): the engines are colocated and take
        turns (``release``; ``wake`` before a push or generation). ``sizer`` (every rank;
        None: the specs' memory fraction): ``sizer(replicas)`` -> {replica: vLLM's
        ``gpu_memory_utilization``}, collective (``engine_memory.SharedGpuSizer``).
        ``placement``: where they run (``place_engines``; every rank)."""
        self.specs, self.sleep_mode, self.sizer = specs, sleep_mode, sizer
        self.replicas, self.placement = replicas, placement or EnginePlacement("inherit")
        self.rank = dist.get_rank()
        self.servers: list[VllmServer | None] = [None] * replicas  # rank 0, once started
        self.asleep: list[set[str]] = [set() for _ in range(replicas)]  # rank 0, colocated
        self.pool = ThreadPoolExecutor(replicas) if replicas > 1 and self.rank == 0 else None
        self.restarts = 0  # engine restarts after a failure (rank 0's count, every rank)

    @classmethod
    def placed(cls, engine: EngineConfig, *, model_dir: str, output_dir: str,
               max_model_len: int, lora_rank: int, arch) -> RolloutEngines:
        """Collective: the run's engines (``rl.rollout``) placed on node 0, each one's
        ``ServerSpec`` on rank 0 (``max_model_len``: --seq-length; ``lora_rank``: the
        adapter rank it serves, 0: none; ``arch``: the model's ``ModelArch``, which sizes
        an engine on the trainer's GPUs)."""
        placement, shares = place_engines(engine)

        def specs() -> list[ServerSpec]:  # rank 0
            init_dir = str(engine_init_dir(model_dir, output_dir))
            urls = engine.engine_urls
            return [ServerSpec(init_dir, max_model_len=max_model_len, engine=engine,
                               lora_rank=lora_rank, env=tuple(placed.env.items()),
                               cpu_cores=placed.engine_cores, sleep_mode=placed.sleep_mode,
                               replica=replica, url=urls[replica] if urls else "")
                    for replica, placed in enumerate(shares)]
        made = from_rank0(specs)
        return cls(made if dist.get_rank() == 0 else None, replicas=engine.engines,
                   sleep_mode=placement.sleep_mode, placement=placement,
                   sizer=shared_gpu_sizer(engine, arch, placement, shares))

    @property
    def server(self) -> VllmServer | None:
        """Rank 0's first engine (None elsewhere, and before the first start)."""
        return self.servers[0]

    # --- starts and restarts ---------------------------------------------------------------
    def start(self, replicas: list[int]) -> dict[int, str]:
        """Collective. Rank 0 starts (or connects to) those of ``replicas`` that are not
        running, at the same time (each in a thread of ``pool``), each sized by ``sizer``
        first (every rank takes part; a start that cannot fit is refused on every rank):
        {replica: its failure, or ""} on every rank (one that failed is started again by
        the next call)."""
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
        server = self.servers[replica]
        return server is None or server.down

    def _start_here(self, replica: int, utilization: float | None = None) -> str:
        """Rank 0 connects to engine ``replica``, starting it (again) if it is ours and not
        running, with vLLM's memory fraction ``utilization`` (None: the spec's); the
        failure, or ""."""
        server = self.servers[replica]
        if server is not None and not server.down:
            return ""
        cfg = self.specs[replica]
        if utilization is not None:
            cfg = replace(cfg, gpu_memory_utilization=utilization)
        asked = "" if utilization is None else f", {utilization:.3f} of its GPUs' memory"
        which = f" {replica}" if self.replicas > 1 else ""
        try:
            if server is not None:  # ours, ended by a failure: a fresh server in its place
                server.start_again(utilization)
                print(f"rollout engine{which}: vLLM's server restarted in "
                      f"{server.startup_s:.1f}s{asked}", flush=True)
                return ""
            url = cfg.url
            if url:  # a server the user runs: connect, the first push is full
                server = VllmServer(url, cfg.request_timeout_s, cfg.engine.engine_url_wait_s,
                                    adapter_root=self._adapter_root(cfg), replica=replica)
                print(f"rollout engine{which}: the vLLM server at {url} (TP{server.world_size}, "
                      f"serving {server.model}); its weights are replaced by the first push",
                      flush=True)
            else:  # vLLM's server, started here
                log = f"engine-{replica}.log" if replica else "engine.log"
                server = VllmServer.local(cfg, Path(cfg.model_dir).parent / log,
                                          cuda=current_device().type == "cuda",
                                          adapter_root=self._adapter_root(cfg))
                print(f"rollout engine{which}: vLLM's server up in {server.startup_s:.1f}s at "
                      f"{server.url} (vLLM {cfg.engine.dtype}, "
                      f"TP{cfg.engine.tensor_parallel_size}, dummy "
                      f"weights until the first push{asked})", flush=True)
        except EngineError as exc:
            return f"engine start-up: {exc}"
        self.servers[replica] = server
        return ""

    def name(self, replica: int) -> str:
        """"engine R" when there are several engines, else "engine"; a server the user
        runs with its URL ("engine 1 (http://HOST:PORT)"). Rank 0."""
        name = f"engine {replica}" if self.replicas > 1 else "engine"
        url = self.specs[replica].url if self.specs else ""
        return f"{name} ({url})" if url else name

    @staticmethod
    def _adapter_root(cfg: ServerSpec) -> str:
        name = f"adapters-{cfg.replica}" if cfg.replica else "adapters"
        return str(Path(cfg.model_dir).parent / name)

    def restart(self, replica: int) -> None:
        """Rank 0, after a failure of engine ``replica``: a server started here ends now and
        the next ``start`` starts it again (sized then, with every rank); one the user runs
        is waited for and rejoined at the next push."""
        self.asleep[replica] = set()  # a fresh engine starts awake
        server = self.servers[replica]
        if server is None or server.down:  # not running: the next start starts it
            return
        self.restarts += 1
        if server.owner is not None:
            server.halt()
            return
        try:
            server.restart()
        except EngineError as exc:  # the next push connects afresh
            print(f"{self.name(replica)} restart failed ({exc}); connecting anew at the "
                  f"next push", flush=True)
            self.servers[replica] = None

    # --- colocated (engines started with sleep_mode) ---------------------------------------
    def release(self) -> None:
        """Collective. The trainer's turn: colocated engines release their weights and KV
        cache (rank 0), and no rank goes on before they have (nothing for other
        placements). A failure ends the engine (the next push starts and resyncs it)."""
        if not self.sleep_mode:
            return
        if self.rank == 0:
            for replica, server in enumerate(self.servers):
                if server is None or server.down:
                    continue
                try:
                    server.sleep()
                    self.asleep[replica] = {"weights", "kv_cache"}
                except EngineError as exc:
                    print(f"{self.name(replica)} sleep failed ({exc}); restarting the "
                          f"engine", flush=True)
                    self.restart(replica)
        barrier()  # the others train only once the engines have let go of the GPUs

    def wake(self, replica: int, tags: list[str]) -> None:
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
            self.servers[replica].wake(wanted)
            self.asleep[replica] -= set(wanted)
        except EngineError as exc:
            print(f"{self.name(replica)} wake-up failed ({exc}); restarting the "
                  f"engine", flush=True)
            self.restart(replica)

    # --- generation ------------------------------------------------------------------------
    def try_generate(self, requests: list[SampleRequest] | None, version: int,
                     phase: str = "rollouts") -> tuple[list[Completion] | None, list[int]]:
        """Collective: (the completions of ``requests`` on rank 0, None elsewhere; the
        engines that failed, restarted now, on every rank: they serve no weights until a
        push, and the completions are None when any failed). A progress line ``[phase]``
        shows samples done and vLLM's tokens/s."""
        done, failed = None, []
        if self.rank == 0:
            try:
                done = self.generate_here(requests, version, phase)
            except _ReplicaErrors as exc:
                failed = exc.replicas
                which = f"s {failed}" if self.replicas > 1 else ""
                urls = [self.specs[r].url for r in failed if self.specs[r].url]
                at = f" ({', '.join(urls)})" if urls else ""
                print(f"rollout failed ({exc}); restarting the engine{which}{at}", flush=True)
                for replica in failed:
                    self.restart(replica)
        failed = rank0_value(failed)  # the others follow rank 0's engines
        return (None if failed else done), failed

    def generate_here(self, requests: list[SampleRequest], version: int,
                      phase: str = "rollouts") -> list[Completion]:
        """Rank 0: the completions of ``requests`` from every engine serving ``version``, in
        order; raises EngineError (naming the engines that failed) without restarting."""
        parts = split_evenly(requests, self.replicas)
        with Progress(phase, len(requests), "samples") as progress:
            counts, lock = [0] * self.replicas, threading.Lock()

            def one(replica: int) -> list[Completion]:
                server = self.servers[replica]
                if server is None or server.down:
                    raise EngineError(f"engine {replica} is not running")

                def on_progress(n, _, note):
                    with lock:
                        counts[replica] = n
                        progress.update(sum(counts), speed_note(note))
                return server.generate(parts[replica], version, on_progress, phase)
            if self.pool is None:
                outcomes = [_outcome(one, 0)]
            else:
                outcomes = list(self.pool.map(lambda r: _outcome(one, r), range(self.replicas)))
        errors = {r: err for r, (_, err) in enumerate(outcomes) if err is not None}
        if errors:
            raise _ReplicaErrors(errors)
        return [c for done, _ in outcomes for c in done]

    def close(self) -> None:
        for server in self.servers:
            if server is not None:
                server.close()
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


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
