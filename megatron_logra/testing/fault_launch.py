"""Fault-test launches: a torchrun job, and what it left behind.

``launch(...)`` runs ``torchrun --max-restarts 1 launch/pretrain_rl.py`` with a planned
fault (``runtime.faults``); ``launch_nodes`` runs it as several torchrun "nodes" on this
host, through the c10d rendezvous. The job's environment carries a tag of its own,
which every process it starts inherits, at any depth. Once torchrun has exited, a
process still carrying the tag is an orphan (a rollout engine, a scoring process, a
checkpoint-writer queue server of a killed rank...), and a /dev/shm entry that appeared
during the run and is still there leaked. Both are reported on the result (and the
orphans killed).

``RL_FLAGS`` is the RL job that tests/distributed/test_rl_faults.py and
benchmarks/faults.py fault; ``compared`` is what of its metrics two runs must share.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from megatron_logra.runtime.device import free_port
from megatron_logra.testing.shm import leaked_shm, shm_entries

REPO = Path(__file__).resolve().parents[2]  # the checkout (its launch/pretrain_rl.py)
JOB_TAG = "MEGATRON_LOGRA_TEST_JOB"  # in the job's environment, inherited by all it starts

# the faulted RL job: DP2 on gloo, the embedded tiny model, LoGRA in bf16 with sketch-delta
# sync and predicted-KL control, 4 updates, a checkpoint every 2
RL_FLAGS = ["--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", "8",
            "--responses-per-prompt", "1", "--micro-batch-size", "4", "--seq-length", "96",
            "--max-new-tokens", "16", "--lr", "3e-3", "--dataset-size", "60",
            "--eval-prompts", "4", "--train-iters", "4", "--seed", "3",
            "--algorithm", "reinforce", "--optimizer", "logra", "--logra-rank", "16",
            "--logra-update-ratio", "2e-2", "--bf16", "--logra-master-weights", "none",
            "--rollout-dtype", "bfloat16", "--weight-sync", "sketch-delta",
            "--weight-sync-anchor-interval", "3", "--kl-control", "predicted",
            "--kl-budget", "5e-4", "--kl-budget-final", "1e-4", "--kl-budget-steps", "4",
            "--kl-probe-responses", "2", "--save-interval", "2"]
# what may differ between two runs with the same results: clocks, memory, and how the
# weights travelled (a restarted engine is resynced in full)
UNCOMPARED = {"engine_restarts", "sync_bytes", "sync_transport", "peak_mem_bytes"}


@dataclass
class Launch:
    returncode: int
    log: str
    orphans: list[str] = field(default_factory=list)  # command lines
    leaked_shm: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the job's wall time


def _tagged(tag: str) -> dict[int, str]:
    """The live processes whose environment carries ``JOB_TAG=tag``: every process the
    job started, at any depth (torchrun starts each worker in a session of its own, so
    sessions and process groups do not tell)."""
    out, needle = {}, f"{JOB_TAG}={tag}".encode()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pid = int(environ.parent.name)
                out[pid] = (environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError):
            continue
    out.pop(os.getpid(), None)
    return out


def launch(tmp: Path, name: str, argv: list[str], *, fault: str | None = None,
           nproc: int = 2, timeout: int = 600) -> Launch:
    """One single-node job: ``torchrun --standalone --nproc-per-node nproc``."""
    return launch_nodes(tmp, name, argv, fault=fault, nproc=nproc, timeout=timeout)


def launch_nodes(tmp: Path, name: str, argv: list[str], *, nodes: int = 1,
                 fault: str | None = None, nproc: int = 2, timeout: int = 600) -> Launch:
    """One job of ``nodes`` torchrun agents on this host (``nodes`` > 1: each a "node" of
    ``nproc`` processes, meeting through the c10d rendezvous at a free local port, as
    the agents of a multi-node job do); their logs are joined, node 0's first."""
    tag = uuid.uuid4().hex
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               **{JOB_TAG: tag})
    env.pop("MEGATRON_LOGRA_FAULT", None)
    if fault:
        env["MEGATRON_LOGRA_FAULT"] = fault
    if nodes == 1:
        where = [["--standalone"]]
    else:
        port = free_port()
        where = [["--nnodes", str(nodes), "--node-rank", str(node), "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name]
                 for node in range(nodes)]
    shm_before = shm_entries()
    logs = [tmp / f"{name}.log" if nodes == 1 else tmp / f"{name}.node{node}.log"
            for node in range(nodes)]  # kept for a failure's diagnosis
    t0 = time.perf_counter()
    procs = []
    for flags, log_path in zip(where, logs):
        cmd = [sys.executable, "-m", "torch.distributed.run", *flags, "--nproc-per-node",
               str(nproc), "--max-restarts", "1", str(REPO / "launch" / "pretrain_rl.py"),
               *argv]
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
    try:
        returncode = max(abs(proc.wait(timeout)) for proc in procs)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid for proc in procs] + list(_tagged(tag)):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    seconds = time.perf_counter() - t0
    left = {}
    for _ in range(20):  # a helper finishing its own shutdown gets a few seconds
        left = _tagged(tag)
        if not left:
            break
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return Launch(returncode, "".join(path.read_text() for path in logs),
                  sorted(left.values()), leaked_shm(shm_before), seconds)




def ok(run: Launch) -> str:
    """The log of a job that succeeded and left nothing behind."""
    errors = [line for line in run.log.splitlines() if "Error" in line and "Warning" not in line]
    assert run.returncode == 0, "\n".join(errors[-20:]) + run.log[-3000:]
    assert not run.orphans, run.orphans
    assert not run.leaked_shm, run.leaked_shm
    return run.log


def records(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict per line."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def is_clock(key: str) -> bool:
    """A metric that is a time (``*_s``) or a rate over one (``*_per_s*``: tokens/s)."""
    return key.endswith("_s") or "_per_s" in key


def compared(record: dict) -> dict:
    """A metrics record less what two runs with the same results may differ in
    (``UNCOMPARED`` and every time or rate, ``is_clock``)."""
    return {k: v for k, v in record.items() if k not in UNCOMPARED and not is_clock(k)}


def checkpoint_model(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint folder (torch's DCP reader, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parents[2] / f"{ckpt.parents[1].name}-{ckpt.name}.pt"  # outside the run
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)
            and not k.startswith("optimizer")}
