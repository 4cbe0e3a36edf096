"""Faults survived (torchrun launches of the SFT stage, DP2 on gloo; ``runtime.faults``
injects them): a rank that dies after its optimizer step, or in the middle of writing a
checkpoint, is restarted by ``torchrun --max-restarts 1`` and the job resumes on its own
from its newest complete checkpoint, ending with the uninterrupted run's metrics and
weights bit for bit; a save into a full disk (ENOSPC on one rank) is dropped cleanly with
the previous checkpoint still selected and training going on; a checkpoint with a
truncated shard is passed over by auto-resume (which says which file and falls back to
the previous one) and refused by an explicit --load naming the file; --save-keep keeps
the newest checkpoints only. No job leaves a process or a /dev/shm entry behind
(``testing.fault_launch``): a rank that died mid-save used to leave megatron-core's
checkpoint-writer queue server running. The same job launched as two torchrun nodes
(one process each, the c10d rendezvous) ends as the single-node one, bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron_logra.testing.fault_launch import (Launch, checkpoint_model, launch, launch_nodes,
                                                 ok, records)

pytestmark = pytest.mark.distributed

SFT = ["--stage", "sft", "--task", "basic_arithmetic", "--train-iters", "6",
       "--global-batch-size", "8", "--micro-batch-size", "2", "--seq-length", "64",
       "--dataset-size", "200", "--lr", "3e-3", "--save-interval", "2", "--seed", "3"]


def _launch(tmp: Path, name: str, *extra: str, fault: str | None = None,
            nproc: int = 2) -> Launch:
    return launch(tmp, name, [*SFT, "--output-dir", str(tmp / name), "--save",
                              str(tmp / name / "ckpt"), *extra], fault=fault, nproc=nproc,
                  timeout=300)


def _metrics(run: Path) -> list[tuple]:
    return [(r["step"], r["loss"], r["grad_norm"], r["lr"]) for r in records(run)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("faults")
    out = {"tmp": tmp, "log": {}}
    out["log"]["reference"] = ok(_launch(tmp, "reference", "--save-keep", "2"))
    out["log"]["optimizer"] = ok(_launch(tmp, "optimizer", fault="optimizer@3:1"))
    out["log"]["save"] = ok(_launch(tmp, "save", fault="save@4"))
    out["log"]["enospc"] = ok(_launch(tmp, "enospc", fault="save-enospc@4"))
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
    mine = checkpoint_model(run / "ckpt" / "iter_0000006")
    theirs = checkpoint_model(ref / "ckpt" / "iter_0000006")
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
    assert f"{shard} has" in proc.log and "truncated" in proc.log
    # auto-resume passes it over, says why, and redoes updates 5 and 6 from iter_4
    log = ok(_launch(tmp, "damaged", "--auto-resume"))
    assert "passing over a damaged checkpoint" in log and shard.name in log
    assert "iter_0000004 at step 4" in log
    assert _metrics(damaged) == _metrics(tmp / "reference")


def test_two_nodes_meeting_by_rendezvous_train_as_one(runs):
    """The multi-node launch (docs/usage.md, Multi-node): two torchrun agents of one
    process each, as two nodes meeting through the c10d rendezvous, run the reference job
    (DP2) to the same metrics and final weights bit for bit."""
    tmp, name = runs["tmp"], "two_nodes"
    ok(launch_nodes(tmp, name, [*SFT, "--output-dir", str(tmp / name), "--save",
                                str(tmp / name / "ckpt")], nodes=2, nproc=1, timeout=300))
    assert _metrics(tmp / name) == _metrics(tmp / "reference")
    mine = checkpoint_model(tmp / name / "ckpt" / "iter_0000006")
    theirs = checkpoint_model(tmp / "reference" / "ckpt" / "iter_0000006")
    assert mine.keys() == theirs.keys() and mine
    for key in mine:
        assert torch.equal(mine[key], theirs[key]), key
