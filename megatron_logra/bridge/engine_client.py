"""The trainer's handle on the rollout engine (``RolloutEngine``, on trainer rank 0 only).

It spawns the engine process (``engine_server.serve``) and talks to it over a pipe
(``protocol``). Versioning: a weight push is ``load`` per bucket, then
``commit(version)``. The engine answers ``generate`` only for the version the caller
expects, and neither ``generate`` nor ``prompt_logprobs`` while a push is in flight
(``PushInFlight``; both this client and the engine process check). Any other failure
(a dead child, an RPC error, which kills a vLLM engine for good) raises
``EngineError`` and the caller restarts the engine and pushes the weights again
(``RolloutEngine.restart``).
"""

from __future__ import annotations

import atexit
import time

import torch
import torch.multiprocessing as tmp

from megatron_logra.bridge.engine_server import serve
from megatron_logra.bridge.protocol import (IN_FLIGHT, Command, Completion, EngineConfig,
                                            EngineError, PushInFlight, PushRefused, Reply,
                                            SampleRequest, require_base)


_ENGINE_STARTS = [0]  # engines this process has started (``runtime.faults``: the k-th)


class RolloutEngine:
    """Client of the engine process (create it on one trainer rank only)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.restarts = 0
        self._proc = self._conn = None
        # the version committed in the engine (0: the export it started from; -1: nothing
        # yet, an engine started from dummy weights for the direct channel)
        self.version = 0
        self.start_id = 0  # which engine this process started (a fresh one per restart)
        self._pending: Command | None = None  # a command sent, its answer not read yet
        self._start()

    def _start(self) -> None:
        t0 = time.perf_counter()
        _ENGINE_STARTS[0] += 1
        self.start_id = _ENGINE_STARTS[0]
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # vLLM's TP executor starts worker processes, which a daemonic process may not:
        # a TP > 1 engine is not daemonic, and is killed at exit (before multiprocessing
        # would wait for it); it also exits by itself when this end of the pipe closes
        daemon = self.cfg.tensor_parallel_size == 1
        self._proc = ctx.Process(target=serve, args=(child, self.cfg, self.start_id),
                                 daemon=daemon)
        self._proc.start()
        if not daemon:
            atexit.register(self._kill)
        child.close()
        self._call_raw(None, None, self.cfg.startup_timeout_s)
        self.startup_s = time.perf_counter() - t0
        self.version = -1 if self.cfg.load_format == "dummy" else 0

    def _call_raw(self, command, payload, timeout: float, on_progress=None):
        """Send one command and wait for its answer; progress messages on the way go to
        ``on_progress(done, total, note)`` (``timeout``: the longest silence)."""
        if command is not None:
            self._begin(command, payload)
        return self._answer(command, timeout, on_progress)

    def _begin(self, command, payload) -> None:
        if self._pending is not None:
            raise EngineError(f"engine: {command} sent while {self._pending} is unanswered")
        try:
            self._conn.send((command, payload))
        except (OSError, BrokenPipeError) as exc:
            raise EngineError(f"engine process died before {command} "
                              f"({type(exc).__name__}; exit code {self._proc.exitcode})") from None
        self._pending = command

    def _answer(self, command, timeout: float, on_progress=None):
        self._pending = None
        try:
            while True:
                if not self._conn.poll(timeout):
                    raise EngineError(f"engine: no answer to {command or 'startup'} in "
                                      f"{timeout} s")
                status, value = self._conn.recv()
                if status != Reply.PROGRESS:
                    break
                if on_progress is not None:
                    on_progress(*value)
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise EngineError(f"engine process died during {command or 'startup'} "
                              f"({type(exc).__name__}; exit code {self._proc.exitcode})") from None
        if status == Reply.REFUSED:
            raise PushRefused(value)
        if status == Reply.IN_FLIGHT:
            raise PushInFlight(value)
        if status != Reply.OK:
            raise EngineError(value)
        return value

    def _call(self, command: Command, payload=None, on_progress=None):
        return self._call_raw(command, payload, self.cfg.request_timeout_s, on_progress)

    # --- weights ---------------------------------------------------------------------------
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket of full HF-named tensors (engine dtype); returns its bytes."""
        for name, t in bucket:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"weight push: {name} is not a floating-point tensor")
        self.version = -1
        return self._call(Command.LOAD, [(n, t.contiguous()) for n, t in bucket])

    def sketch_delta(self, updates: list, full: list[tuple[str, torch.Tensor]], *,
                     base_version: int, version: int) -> int:
        """Apply one update's sketch deltas (+ full non-sketched tensors) on top of
        ``base_version`` and commit ``version``; returns the bytes received. A refusal
        (``PushRefused``) leaves the engine serving its previous version."""
        return self._delta(Command.SKETCH_DELTA, (updates, [(n, t.contiguous()) for n, t in full]),
                           base_version, version)

    def sparse_delta(self, deltas: list, *, base_version: int, version: int) -> int:
        """Set the changed elements (``bridge.sparse_delta``) on top of ``base_version``
        and commit ``version``; a refusal leaves the previous version serving."""
        return self._delta(Command.SPARSE_DELTA, deltas, base_version, version)

    def _delta(self, command: Command, payload, base_version: int, version: int) -> int:
        if not self.cfg.delta_sync:
            raise PushRefused(f"{command} needs an engine started with delta_sync")
        require_base(base_version, self.version)
        sent = self._call(command, payload)
        self.version = -1
        self.commit(version)
        return sent

    def set_adapter(self, tensors: dict[str, torch.Tensor], config: dict, version: int) -> int:
        """Serve the base plus this LoRA adapter (PEFT's tensors and adapter_config) from now
        on, as ``version``; the engine must serve ``version`` (its base just pushed) or
        ``version - 1``. Returns the bytes sent."""
        if not self.cfg.lora_rank:
            raise PushRefused("a LoRA adapter push needs an engine started with lora_rank")
        if self.version not in (version, version - 1):
            raise PushRefused(f"an adapter for version {version}, the engine serves "
                              f"{self.version}: push full weights")
        sent = self._call(Command.LORA_ADAPTER,
                          ({n: t.contiguous() for n, t in tensors.items()}, config, version))
        self.version = -1
        self.commit(version)
        return sent

    def fingerprints(self, names: list[str]) -> dict[str, float]:
        """``bridge.fingerprint`` of the engine's live weights, in HF coordinates."""
        return self._call(Command.FINGERPRINTS, names)

    def engine_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's live weights as HF tensors, read back from every vLLM worker
        (tests: bit-exactness against the trainer)."""
        return self._call(Command.WEIGHTS, names)

    def commit(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"weight push: version {version} must be >= 0")
        self.version = self._call(Command.COMMIT, version)

    # --- rollouts --------------------------------------------------------------------------
    def generate(self, requests: list[SampleRequest], expected_version: int,
                 on_progress=None, phase: str = "rollouts") -> list[Completion]:
        """``on_progress(done, total, note)``: called as samples finish (vLLM's speed note);
        ``phase``: what the samples are for ("rollouts N", "eval"; progress and faults)."""
        if self.version != expected_version:
            raise EngineError(f"engine serves weights version {self.version}, the trainer is at "
                              f"{expected_version}: push before generating")
        return self._call(Command.GENERATE, (requests, phase), on_progress)

    def prompt_logprobs(self, rows: list[list[int]]) -> list[list[float]]:
        """log p(row[t] | row[:t]) for t >= 1 under the committed weights."""
        if self.version < 0:
            raise PushInFlight(IN_FLIGHT)
        return self._call(Command.PROMPT_LOGPROBS, rows)

    def assume_version(self, version: int) -> None:
        """The engine was started from weights the caller wrote for ``version``."""
        self.version = int(version)

    def engine_version(self) -> int:
        """The version the engine itself reports (-1 while a push is in flight)."""
        return self._call(Command.VERSION)

    # --- colocated: sleep and wake (an engine started with sleep_mode) ---------------------
    def sleep(self) -> None:
        """Release the weights (to host memory) and the KV cache until ``wake``."""
        self._call(Command.SLEEP)

    def wake(self, tags: list[str]) -> None:
        """Take back ``["weights"]`` (before a push) or ``["kv_cache"]`` (before generating)."""
        self._call(Command.WAKE, tags)

    # --- life cycle ------------------------------------------------------------------------
    def restart(self) -> None:
        """Kill the engine process and start a fresh one (version 0: push again)."""
        self._kill()
        self.restarts += 1
        self._start()

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return None if self._proc is None else self._proc.pid

    def kill_for_test(self) -> None:
        """Simulate an engine crash (tests)."""
        self._proc.kill()
        self._proc.join(10)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(30)
        self._proc = self._conn = self._pending = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._call_raw(Command.SHUTDOWN, None, 30)
            except EngineError:
                pass
            self._proc.join(30)
        self._kill()
