"""Fault-test launches: a torchrun job in its own session, and what it left behind.

``launch(...)`` runs ``torchrun --max-restarts 1 launch/pretrain_rl.py`` with a planned
fault (``runtime.faults``) in a new session, so that every process the job started, at
any depth, carries the job's session id. Once torchrun has exited, a process still in
that session is an orphan (a rollout engine, a scoring process, a checkpoint-writer
queue server of a killed rank...), and a /dev/shm entry that appeared during the run
and is still there leaked. Both are reported on the result (and the orphans killed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")


@dataclass
class Launch:
    returncode: int
    log: str
    orphans: list[str] = field(default_factory=list)  # command lines
    leaked_shm: list[str] = field(default_factory=list)
    seconds: float = 0.0  # the job's wall time


def _session_members(sid: int) -> dict[int, str]:
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # after pid (comm): state ppid pgrp session
                pid = int(stat.parent.name)
                out[pid] = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
    return out


def launch(tmp: Path, name: str, argv: list[str], *, fault: str | None = None,
           nproc: int = 2, timeout: int = 600) -> Launch:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_LOGRA_FAULT", None)
    if fault:
        env["MEGATRON_LOGRA_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--max-restarts", "1", str(REPO / "launch" / "pretrain_rl.py"), *argv]
    shm_before = set(os.listdir(SHM)) if SHM.is_dir() else set()
    log_path = tmp / f"{name}.log"  # kept for a failure's diagnosis
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    seconds = time.perf_counter() - t0
    left = {}
    for _ in range(20):  # a helper finishing its own shutdown gets a few seconds
        left = _session_members(proc.pid)
        if not left:
            break
        time.sleep(0.5)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shm_after = set(os.listdir(SHM)) if SHM.is_dir() else set()
    return Launch(returncode, log_path.read_text(), sorted(left.values()),
                  sorted(shm_after - shm_before), seconds)


def ok(run: Launch) -> str:
    """The log of a job that succeeded and left nothing behind."""
    errors = [line for line in run.log.splitlines() if "Error" in line and "Warning" not in line]
    assert run.returncode == 0, "\n".join(errors[-20:]) + run.log[-3000:]
    assert not run.orphans, run.orphans
    assert not run.leaked_shm, run.leaked_shm
    return run.log


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def checkpoint_model(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint folder (torch's DCP reader, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parents[2] / f"{ckpt.parents[1].name}-{ckpt.name}.pt"  # outside the run
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)
            and not k.startswith("optimizer")}
