"""``EngineLink``: the RL loop's one handle on the rollout engine (collective calls).

It owns the engine (trainer rank 0 only: ``rollout.vllm_server.VllmServer``, vLLM's own
server, started here or at ``--rollout-engine-url``) and the trainer's side of weight
sync (``sync.WeightSync``), and keeps them serving the trainer's weights:

- ``push(version)``: the trainer's weights become ``version`` in the engine. The very
  first push starts (or connects to) the server, which runs on dummy weights until this
  push brings the trainer's. A failed push restarts the engine and pushes again (three
  tries).
- ``generate(requests, version)``: completions from the engine serving ``version``
  (rank 0; None elsewhere); a failure restarts the engine, pushes the weights again
  and retries (three tries).
If the engine dies or fails a request, rank 0 restarts it (a server the user runs: waits
for it and reconnects) and every rank takes part in the full push that follows.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch.distributed as dist

from megatron_logra.rollout.types import Completion, EngineConfig, EngineError, SampleRequest
from megatron_logra.weight_sync.sync import SyncStats, WeightSync
from megatron_logra.rollout.vllm_server import VllmServer
from megatron_logra.runtime.collectives import from_rank0, rank0_value
from megatron_logra.runtime.device import current_device, release_cached_memory
from megatron_logra.runtime.progress import Progress

TRIES = 3


def speed_note(vllm_postfix: str) -> str:
    """vLLM's "est. speed input: X toks/s, output: Y toks/s" -> "Y tokens/s out"."""
    match = re.search(r"output: ([0-9.]+) toks/s", vllm_postfix)
    return f"{float(match.group(1)):.0f} tokens/s out" if match else vllm_postfix


class EngineLink:
    def __init__(self, sync: WeightSync, engine_cfg: EngineConfig | None,
                 sleep_mode: bool = False):
        """``engine_cfg``: rank 0's engine settings (None on every other rank): a server at
        its ``url``, or one started here from its ``model_dir`` (config and tokenizer; the
        first push brings the weights). ``sleep_mode`` (every rank): the engine is
        colocated and takes turns (``release``; pushes and generation wake it)."""
        self.sync, self.engine_cfg, self.sleep_mode = sync, engine_cfg, sleep_mode
        self.rank = dist.get_rank()
        self.engine: VllmServer | None = None  # rank 0, from the first push on
        self.asleep: set[str] = set()  # rank 0, colocated: what the engine has released

    @property
    def stats(self) -> SyncStats:
        return self.sync.stats

    def push(self, version: int, transport: str | None = None) -> None:
        """Push the trainer's weights as ``version``; restart the engine and retry on
        failure. ``transport`` forces one (tests, benchmarks)."""
        self._wake(["weights"])
        for _ in range(TRIES):
            t0 = time.perf_counter()
            failed, sent = self._push_once(version, transport)
            failed = rank0_value(failed)  # rank 0's outcome decides for every rank
            self.stats.seconds += time.perf_counter() - t0
            if not failed:
                self.stats.bytes += sent
                self.stats.pushes += 1
                return
            if self.rank == 0:
                print(f"weight push failed ({failed}); restarting the engine", flush=True)
                self._restart()
        raise RuntimeError(f"weight push failed {TRIES} times: see the engine errors above")

    def _push_once(self, version: int, transport: str | None) -> tuple[str, int]:
        """(failure message or "", bytes sent)."""
        failed = self._start()
        if failed:
            return failed, 0
        result = self.sync.push(self.engine, version, transport)
        return result.failed, result.sent

    def _start(self) -> str:
        """Rank 0 connects to the engine, starting it if it is ours and not running
        (collective: the failure, or "", on every rank)."""
        return from_rank0(self._start_here)

    def _start_here(self) -> str:
        """Rank 0: ``_start``'s connection or start-up."""
        if self.engine is not None:
            return ""
        cfg = self.engine_cfg
        try:
            if cfg.url:  # a server the user runs: connect, the first push is full
                self.engine = VllmServer(cfg.url, cfg.request_timeout_s,
                                         cfg.startup_timeout_s,
                                         adapter_root=self._adapter_root())
                print(f"rollout engine: the vLLM server at {cfg.url} (TP"
                      f"{self.engine.world_size}, serving {self.engine.model}); its "
                      f"weights are replaced by the first push", flush=True)
            else:  # vLLM's server, started here
                self.engine = VllmServer.local(
                    cfg, Path(cfg.model_dir).parent / "engine.log",
                    cuda=current_device().type == "cuda",
                    adapter_root=self._adapter_root())
                print(f"rollout engine: vLLM's server up in {self.engine.startup_s:.1f}s "
                      f"at {self.engine.url} (vLLM {cfg.dtype}, TP"
                      f"{cfg.tensor_parallel_size}, dummy weights until the first push)",
                      flush=True)
        except EngineError as exc:
            return f"engine start-up: {exc}"
        return ""

    def _adapter_root(self) -> str:
        return str(Path(self.engine_cfg.model_dir).parent / "adapters")

    # --- colocated (an engine started with sleep_mode) -------------------------------------
    def release(self) -> None:
        """The trainer's turn: a colocated engine releases its weights and KV cache (rank 0;
        nothing for other placements). A failure restarts it (the next push resyncs)."""
        if self.rank != 0 or self.engine is None or not self.sleep_mode:
            return
        try:
            self.engine.sleep()
            self.asleep = {"weights", "kv_cache"}
        except EngineError as exc:
            print(f"engine sleep failed ({exc}); restarting the engine", flush=True)
            self._restart()

    def _wake(self, tags: list[str]) -> None:
        """Every rank frees its cached device memory, then rank 0's engine takes back
        ``tags`` (released by ``release``); a failure restarts it (awake)."""
        if not self.sleep_mode:
            return
        release_cached_memory()
        wanted = [t for t in tags if t in self.asleep]
        if self.rank != 0 or not wanted:
            return
        try:
            self.engine.wake(wanted)
            self.asleep -= set(wanted)
        except EngineError as exc:
            print(f"engine wake-up failed ({exc}); restarting the engine", flush=True)
            self._restart()

    def _restart(self) -> None:
        self.asleep = set()  # a fresh engine starts awake
        if self.engine is None:  # it never started: the next push starts it
            return
        self.stats.restarts += 1
        try:
            self.engine.restart()
        except EngineError as exc:  # the next push starts a fresh one from current weights
            print(f"engine restart failed ({exc}); starting anew at the next push", flush=True)
            self.engine = None

    def generate(self, requests: list[SampleRequest] | None, version: int,
                 phase: str = "rollouts") -> list[Completion] | None:
        """Completions of ``requests`` (rank 0), restarting and resyncing the engine if needed;
        a progress line ``[phase]`` shows samples done and vLLM's tokens/s."""
        self._wake(["weights", "kv_cache"])
        for _ in range(TRIES):
            done, status = None, ""
            if self.rank == 0:
                try:
                    if self.engine is None:
                        raise EngineError("the engine is not running")
                    with Progress(phase, len(requests), "samples") as progress:
                        done = self.engine.generate(
                            requests, version,
                            lambda n, _, note: progress.update(n, speed_note(note)), phase)
                except EngineError as exc:
                    status = str(exc)
                    print(f"rollout failed ({status}); restarting the engine", flush=True)
                    self._restart()
            if not rank0_value(status):  # the others follow rank 0's engine
                return done
            self.push(version)
        raise RuntimeError(f"rollouts failed {TRIES} times: see the engine errors above")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.sync.close()
