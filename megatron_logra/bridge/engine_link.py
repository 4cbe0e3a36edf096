"""``EngineLink``: the RL loop's one handle on the rollout engine (collective calls).

It owns the engine (trainer rank 0 only: ``engine_client.RolloutEngine``) and the
trainer's side of weight sync (``sync.WeightSync``), and keeps them serving the
trainer's weights:

- ``push(version)``: the trainer's weights become ``version`` in the engine. The very
  first push writes the engine's start-up weights into its folder and starts it from
  them. A failed push restarts the engine and pushes again (three tries).
- ``generate(requests, version)``: completions from the engine serving ``version``
  (rank 0; None elsewhere); a failure restarts the engine, pushes the weights again
  and retries (three tries).
If the engine dies or refuses (any vLLM RPC failure kills it), rank 0 restarts it and
every rank takes part in the push that follows.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_logra.bridge.engine_client import RolloutEngine
from megatron_logra.bridge.protocol import Completion, EngineConfig, EngineError, SampleRequest
from megatron_logra.bridge.sync import SyncStats, WeightSync
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
        """``engine_cfg``: rank 0's engine settings (None on every other rank); its
        ``model_dir`` holds config and tokenizer, the first push adds the weights.
        ``sleep_mode`` (every rank): the engine is colocated and takes turns
        (``release``; pushes and generation wake it)."""
        self.sync, self.engine_cfg, self.sleep_mode = sync, engine_cfg, sleep_mode
        self.rank = dist.get_rank()
        self.engine: RolloutEngine | None = None  # rank 0, once the first push wrote its weights
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
            flag = torch.tensor([int(bool(failed))])
            dist.broadcast(flag, src=0)
            self.stats.seconds += time.perf_counter() - t0
            if not flag.item():
                self.stats.bytes += sent
                self.stats.pushes += 1
                return
            if self.rank == 0:
                print(f"weight push failed ({failed}); restarting the engine", flush=True)
                self._restart()
        raise RuntimeError(f"weight push failed {TRIES} times: see the engine errors above")

    def _push_once(self, version: int, transport: str | None) -> tuple[str, int]:
        """(failure message or "", bytes sent)."""
        if self.sync.direct:  # the engine starts on dummy weights; the push brings them
            failed = self._start_for_direct()
            if failed:
                return failed, 0
        result = self.sync.push(self.engine, version, transport)
        if result.startup_tensors is None:
            return result.failed, result.sent
        from safetensors.torch import save_file

        save_file(result.startup_tensors, str(Path(self.engine_cfg.model_dir) /
                                              "model.safetensors"))
        try:  # a failure is reported to every rank (push), never left to hang them
            self.engine = RolloutEngine(self.engine_cfg)
        except EngineError as exc:
            return f"engine start-up: {exc}", 0
        self.engine.assume_version(version)
        if result.startup_adapter is not None:  # lora-adapter sync: base + adapter
            try:
                result.sent += self.engine.set_adapter(*result.startup_adapter, version)
            except (EngineError, ValueError) as exc:
                return f"engine start-up (adapter): {exc}", 0
        cfg = self.engine_cfg
        print(f"rollout engine up in {self.engine.startup_s:.1f}s (vLLM {cfg.dtype}, "
              f"TP{cfg.tensor_parallel_size})", flush=True)
        return "", result.sent

    def _start_for_direct(self) -> str:
        """Rank 0 starts the engine if it is not running (collective: the failure, or "",
        on every rank)."""
        status = [""]
        if self.rank == 0 and self.engine is None:
            cfg = self.engine_cfg
            try:
                if cfg.url:  # a server the user runs: connect, the first push is full
                    from megatron_logra.rollout.vllm_server import VllmServer

                    self.engine = VllmServer(cfg.url, cfg.request_timeout_s,
                                             cfg.startup_timeout_s)
                    print(f"rollout engine: the vLLM server at {cfg.url} (TP"
                          f"{self.engine.world_size}, serving {self.engine.model}); its "
                          f"weights are replaced by the first push", flush=True)
                else:  # vLLM's server, started here
                    from megatron_logra.rollout.vllm_server import VllmServer

                    self.engine = VllmServer.local(
                        cfg, Path(cfg.model_dir).parent / "engine.log",
                        cuda=current_device().type == "cuda")
                    print(f"rollout engine: vLLM's server up in {self.engine.startup_s:.1f}s "
                          f"at {self.engine.url} (vLLM {cfg.dtype}, TP"
                          f"{cfg.tensor_parallel_size}, dummy weights until the first push)",
                          flush=True)
            except EngineError as exc:
                status = [f"engine start-up: {exc}"]
        dist.broadcast_object_list(status, src=0)
        return status[0]

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
            flag = torch.tensor([int(bool(status))])
            dist.broadcast(flag, src=0)
            if not flag.item():
                return done
            self.push(version)
        raise RuntimeError(f"rollouts failed {TRIES} times: see the engine errors above")

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        self.sync.close()
