"""Trainer rank 0 runs vLLM's own server as its rollout engine (no ``--rollout-engine-url``).

The server is the one a user would start (``rollout.vllm_server`` drives it over HTTP),
launched as a child process of trainer rank 0 on a free port:

- the model folder holds config and tokenizer only: the server starts on vLLM's dummy
  weights (``--load-format dummy``) and the first push (full, through the ``mlogra``
  weight-transfer backend) brings the trainer's; with ``--weight-sync lora-adapter`` it
  serves LoRA adapters loaded at runtime (``engine_lora``);
- its placement (``rollout.placement``) is its environment (``CUDA_VISIBLE_DEVICES``,
  ``VLLM_CPU_OMP_THREADS_BIND``) and, on CPU with dedicated cores, its affinity;
- on CPU: linear weights kept live (``MLOGRA_LIVE_WEIGHTS=1``), a token budget that
  never splits a prompt, and at TP1 the engine in the server's own process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: it starts in ~15 s instead of ~30 s);
- it dies with trainer rank 0 (``PR_SET_PDEATHSIG``, kept across exec; its engine core
  and workers die with it: ``weight_sync.vllm_plugin``); ``stop`` and
  ``kill`` end its main process, then what is left of its process group, and unlink
  the /dev/shm files its processes had mapped (found by inode);
- vLLM's cache (``VLLM_CACHE_ROOT``: the user's, else vLLM's default ``~/.cache/vllm``)
  is shared by every start, of this run and of others: with it warm, a start skips
  vLLM's model-class inspection, a subprocess that imports vLLM again (~5 s on CPU);
- ``MLOGRA_ENGINE_START`` numbers the servers this run started (fault injection,
  ``runtime.faults``); its output goes to ``OUTPUT_DIR/engine.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from megatron_logra.rollout.lora_adapter import RUNTIME_LORA_ENV, lora_server_args
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.runtime.device import free_port
from megatron_logra.runtime.faults import ENV as FAULT_ENV
from megatron_logra.weight_sync.contract import BACKEND
from megatron_logra.weight_sync.cpu_live_weights import LIVE_WEIGHTS_ENV
from megatron_logra.weight_sync.vllm_plugin import DIE_WITH_PARENT_ENV

ENGINE_START_ENV = "MLOGRA_ENGINE_START"
SHM = Path("/dev/shm")


def server_argv(cfg: ServerSpec, port: int, *, cuda: bool, host: str = "127.0.0.1"
                ) -> list[str]:
    """vLLM's server command line for ``cfg`` (the flags docs/usage.md explains), listening
    on ``host`` (an engine node's: every interface, ``slurm.engine_task``)."""
    engine = cfg.engine
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", cfg.model_dir, "--host", host, "--port", str(port),
            "--dtype", engine.dtype, "--max-model-len", str(cfg.max_model_len),
            "--seed", str(engine.seed), "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--max-num-seqs", str(cfg.max_num_seqs), "--enforce-eager",
            "--kv-cache-memory-bytes", str(int(engine.kv_cache_gib * 2**30)),
            "--logprobs-mode", "processed_logprobs", "--load-format", cfg.load_format,
            "--weight-transfer-config", json.dumps({"backend": BACKEND}),
            "--disable-log-stats", "--uvicorn-log-level", "warning"]
    if engine.tensor_parallel_size == 1:
        argv += ["--distributed-executor-backend", "uni"]
    argv += lora_server_args(cfg.lora_rank)
    if cuda:
        if cfg.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", str(cfg.gpu_memory_utilization)]
        if cfg.sleep_mode:
            argv += ["--enable-sleep-mode"]
    else:
        # seeded requests fail on CPU when their prefill is chunked ("CPU Generator does
        # not use offset"): a token budget that never splits a prompt over steps
        argv += ["--max-num-batched-tokens", str(cfg.max_model_len * cfg.max_num_seqs)]
    return argv


def server_env(cfg: ServerSpec, engine_start: int, *, cuda: bool) -> dict[str, str]:
    """The server's environment: this process's, the run's settings for vLLM, then
    ``cfg.env`` (its placement; it wins)."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1")
    env[ENGINE_START_ENV] = str(engine_start)
    env[DIE_WITH_PARENT_ENV] = "1"  # every process of it dies with its parent (vllm_plugin)
    if cfg.lora_rank:
        env[RUNTIME_LORA_ENV] = "True"
    if not cuda:
        env[LIVE_WEIGHTS_ENV] = "1"
        if cfg.engine.tensor_parallel_size == 1:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND",
                           "|".join(str(i) for i in range(cfg.engine.tensor_parallel_size)))
    if cfg.replica:  # an injected fault (tests) strikes the first engine only
        env.pop(FAULT_ENV, None)
    env.update(dict(cfg.env))
    return env


class LocalServer:
    """One vLLM server process at a time, started by trainer rank 0 (or by an engine
    node's task: ``slurm.engine_task``, which listens on ``host`` at a fixed ``port``)."""

    def __init__(self, cfg: ServerSpec, log_path: str | Path, *, cuda: bool,
                 host: str = "127.0.0.1", port: int | None = None):
        self.cfg, self.log_path, self.cuda = cfg, Path(log_path), cuda
        self.host, self.port = host, port  # port None: a free one at each start
        self.proc: subprocess.Popen | None = None
        self.starts = 0
        self.shm_at_start: set[Path] = set()  # what it had mapped once up (``note_shm``)

    def start(self) -> str:
        """Launch a fresh server; returns its URL (it may still be starting up). A server
        started before is killed first, not stopped: a restart follows a failure, and
        vLLM's API server whose engine core died can take 30 s to answer SIGTERM."""
        self.kill()
        self.shm_at_start = set()
        self.starts += 1
        port = self.port or free_port()
        cores = self.cfg.cpu_cores

        def in_child() -> None:
            from megatron_logra.runtime.processes import die_with_parent

            die_with_parent()
            if cores:  # dedicated cores: trainer rank 0's affinity excludes them
                os.sched_setaffinity(0, cores)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a") as log:
            log.write(f"--- vLLM server start {self.starts} ---\n")
            log.flush()
            self.proc = subprocess.Popen(
                server_argv(self.cfg, port, cuda=self.cuda, host=self.host),
                env=server_env(self.cfg, self.starts, cuda=self.cuda), stdout=log,
                stderr=subprocess.STDOUT, preexec_fn=in_child, start_new_session=True)
        return f"http://127.0.0.1:{port}"

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def exit_note(self) -> str:
        """Why a server that should answer does not (for error messages)."""
        if self.proc is None or self.proc.poll() is None:
            return ""
        return f"the vLLM server exited with code {self.proc.returncode}; see {self.log_path}"

    def kill(self) -> None:
        """The server dies at once, as in a crash (tests, fault injection): its main
        process is SIGKILLed, then whatever is left of its process group, and the shared
        memory its processes had mapped is unlinked."""
        if self.proc is None:
            return
        shm = self._mapped_shm() | self.shm_at_start
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self._reap_group()
        _unlink_inodes(shm)

    def stop(self) -> None:
        """End the server (SIGTERM: vLLM shuts its workers down) and everything it
        started (its process group)."""
        if self.proc is None:
            return
        shm = self._mapped_shm() | self.shm_at_start
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self._reap_group()
        _unlink_inodes(shm)
        self.proc = None

    def note_shm(self) -> None:
        """Record the shared memory the server maps once it is up: if one of its processes
        dies first (a worker crash), its files are unlinked at ``stop`` all the same."""
        self.shm_at_start = self._mapped_shm()

    def _group_pids(self) -> list[int]:
        """The live processes of the server's process group (its workers included)."""
        pids = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # its group, alive
                pids.append(int(stat.parent.name))
        return pids

    def _mapped_shm(self) -> set[int]:
        """The inodes of the /dev/shm files the server's processes have mapped (vLLM's
        shared-memory queues, multiprocessing's semaphores): a killed server cannot
        unlink them. Inodes, not names: glibc creates a semaphore under a temporary name,
        maps it, links it as ``sem.mp-*`` and unlinks the temporary name, so the maps
        name a file that is gone while the semaphore's file stays."""
        out = set()
        for pid in self._group_pids():
            try:
                maps = Path(f"/proc/{pid}/maps").read_text()
            except OSError:
                continue
            for line in maps.splitlines():
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(str(SHM) + "/"):
                    out.add(int(fields[4]))
        return out

    def _reap_group(self, grace_s: float = 15.0) -> None:
        """Kill what is left of the server's process group (vLLM's engine core outlives a
        killed API server) and wait, at most ``grace_s``, until it is gone."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while self._group_pids() and time.monotonic() < deadline:
            time.sleep(0.1)


def _unlink_inodes(inodes: set[int]) -> None:
    """Unlink the /dev/shm files with these inodes (what a server that is gone left)."""
    if not inodes:
        return
    for entry in os.scandir(SHM):
        try:
            if entry.inode() in inodes:
                os.unlink(entry.path)
        except FileNotFoundError:
            pass
