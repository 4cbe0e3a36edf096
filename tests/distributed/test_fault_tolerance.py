"""Faults survived (torchrun launches of the SFT stage, DP2 on gloo; ``runtime.faults``
injects them): a rank that dies after its optimizer step, or in the middle of writing a
checkpoint, is restarted by ``torchrun --max-restarts 1`` and the job resumes on its own
from its newest complete checkpoint, ending with the uninterrupted run's metrics and
weights bit for bit; a save into a full disk (ENOSPC on one rank) is dropped cleanly with
the previous checkpoint still selected and training going on; a checkpoint with a
truncated shard is passed over by auto-resume (which says which file and falls back to
the previous one) and refused by an explicit --load naming the file; --save-keep keeps
the newest checkpoints only."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed

REPO = Path(__file__).resolve().parents[2]
SFT = ["--stage", "sft", "--task", "basic_arithmetic", "--train-iters", "6",
       "--global-batch-size", "8", "--micro-batch-size", "2", "--seq-length", "64",
       "--dataset-size", "200", "--lr", "3e-3", "--save-interval", "2", "--seed", "3"]


def _launch(tmp: Path, name: str, *extra: str, fault: str | None = None,
            nproc: int = 2) -> subprocess.CompletedProcess:
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("MEGATRON_LOGRA_FAULT", None)
    if fault:
        env["MEGATRON_LOGRA_FAULT"] = fault
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--max-restarts", "1", str(REPO / "launch" / "pretrain_rl.py"), *SFT,
           "--output-dir", str(tmp / name), "--save", str(tmp / name / "ckpt"), *extra]
    with open(tmp / f"{name}.log", "w") as log:  # kept for a failure's diagnosis
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                              text=True, timeout=300)
    proc.stdout, proc.stderr = (tmp / f"{name}.log").read_text(), ""
    return proc


def _ok(proc: subprocess.CompletedProcess) -> str:
    log = proc.stdout + proc.stderr
    errors = [line for line in log.splitlines() if "Error" in line and "Warning" not in line]
    assert proc.returncode == 0, "\n".join(errors[-20:]) + log[-3000:]
    return log


def _metrics(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"])
            for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _model(ckpt: Path) -> dict[str, torch.Tensor]:
    """The model tensors of a checkpoint folder (torch's DCP reader, one process)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt.parents[2] / f"{ckpt.parents[1].name}-{ckpt.name}.pt"  # outside the run
    dcp_to_torch_save(str(ckpt), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)
            and not k.startswith("optimizer")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("faults")
    out = {"tmp": tmp, "log": {}}
    out["log"]["reference"] = _ok(_launch(tmp, "reference", "--save-keep", "2"))
    out["log"]["optimizer"] = _ok(_launch(tmp, "optimizer", fault="optimizer@3:1"))
    out["log"]["save"] = _ok(_launch(tmp, "save", fault="save@4"))
    out["log"]["enospc"] = _ok(_launch(tmp, "enospc", fault="save-enospc@4"))
    return out


def test_reference_keeps_the_newest_checkpoints(runs):
    ckpt = runs["tmp"] / "reference" / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["iter_0000004", "iter_0000006", "latest"]
    manifest = json.loads((ckpt / "iter_0000006" / "manifest.json").read_text())["files"]
    assert "megatron_logra.json" in manifest and any(f.endswith(".distcp") for f in manifest)


@pytest.mark.parametrize("fault, resumed_at", [("optimizer", 2), ("save", 2)])
def test_a_dead_rank_restarts_and_resumes_exactly(runs, fault, resumed_at):
    log = runs["log"][fault]
    assert f"[fault] rank {1 if fault == 'optimizer' else 0} dies at {fault}" in log
    assert "resumed from" in log and f"iter_{resumed_at:07d} at step {resumed_at}" in log
    run, ref = runs["tmp"] / fault, runs["tmp"] / "reference"
    assert _metrics(run) == _metrics(ref)  # bit for bit, every update once
    mine, theirs = _model(run / "ckpt" / "iter_0000006"), _model(ref / "ckpt" / "iter_0000006")
    assert mine.keys() == theirs.keys() and mine
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def test_a_full_disk_drops_that_save_only(runs):
    log, run = runs["log"]["enospc"], runs["tmp"] / "enospc"
    assert "checkpoint" in log and "iter_0000004 not saved" in log
    assert "No space left on device" in log and "training continues" in log
    names = sorted(p.name for p in (run / "ckpt").iterdir())
    assert names == ["iter_0000002", "iter_0000006", "latest"]  # no iter_4, no .partial
    assert _metrics(run) == _metrics(runs["tmp"] / "reference")


def test_a_damaged_checkpoint_is_passed_over_or_refused(runs):
    tmp = runs["tmp"]
    damaged = tmp / "damaged"
    shutil.copytree(tmp / "reference", damaged)
    shard = sorted((damaged / "ckpt" / "iter_0000006").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    # an explicit --load names the file and stops before any work
    proc = _launch(tmp, "explicit", "--load", str(damaged / "ckpt"), "--train-iters", "8",
                   nproc=1)
    assert proc.returncode != 0
    assert f"{shard} has" in proc.stderr + proc.stdout and "truncated" in proc.stderr + proc.stdout
    # auto-resume passes it over, says why, and redoes updates 5 and 6 from iter_4
    log = _ok(_launch(tmp, "damaged", "--auto-resume"))
    assert "passing over a damaged checkpoint" in log and shard.name in log
    assert "iter_0000004 at step 4" in log
    assert _metrics(damaged) == _metrics(tmp / "reference")
