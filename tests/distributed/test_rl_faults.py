"""Faults survived by an RL run (torchrun, DP2 on gloo, vLLM's own server; LoGRA with
sketch-delta sync and predicted-KL control, bf16 as in the paper's recipe).

One job meets four faults (``runtime.faults``) and must end exactly where an
uninterrupted job ends:
1. the server dies in the middle of update 1's rollouts (after its first sample);
2. the next server dies in the middle of update 2's sketch-delta push (its workers
   applied it, the update was not finished);
3. the next one dies in the middle of update 3's full push (an anchor push: its first
   round received, the update not finished);
4. trainer rank 1 dies in update 4's optimizer step; torchrun restarts the job, which
   resumes from the update-2 checkpoint on its own and redoes updates 3 and 4.
Every metric of every update (rewards, losses, the KL controller's alpha, the logprob
mismatch) and the final weights equal the uninterrupted job's bit for bit; the engine
restarts are counted in metrics.jsonl; at the end the server's weights equal the
trainer's (vLLM's checksums); no process and no /dev/shm entry is left behind.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.testing.fault_launch import (RL_FLAGS, checkpoint_model, compared,
                                                 launch, ok, records)

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

FAULTS = "engine-generate@1,engine-delta-push@2,engine-full-push@3,optimizer@4:1"


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("rl_faults")
    out = {"tmp": tmp}
    for name, fault in (("reference", None), ("faulted", FAULTS)):
        run = tmp / name
        out[name] = ok(launch(tmp, name, [*RL_FLAGS, "--output-dir", str(run), "--save",
                                          str(run / "ckpt")], fault=fault))
    return out


def test_every_fault_happened_and_was_recovered_from(jobs):
    # the trainer's log, and the server's (its workers die inside a push)
    log = jobs["faulted"] + (jobs["tmp"] / "faulted" / "engine.log").read_text()
    for start, point, update in ((1, "engine-generate", 1), (2, "engine-delta-push", 2),
                                 (3, "engine-full-push", 3)):
        assert f"[fault] the rollout engine (start {start}) dies at {point} of update " \
               f"{update}" in log
    assert "[fault] rank 1 dies at optimizer of update 4" in log
    assert "rollout failed (vLLM server" in log
    assert log.count("weight push failed (") >= 2  # the delta push and the full push
    assert "iter_0000002 at step 2" in log  # resumed on its own from the newest checkpoint


def test_the_faulted_job_ends_as_the_uninterrupted_one_bit_for_bit(jobs):
    tmp = jobs["tmp"]
    faulted, reference = records(tmp / "faulted"), records(tmp / "reference")
    assert [r["step"] for r in faulted] == [r["step"] for r in reference] == [0, 1, 2, 3, 4]
    for mine, theirs in zip(faulted, reference):
        assert compared(mine) == compared(theirs), mine["step"]
    trained = reference[1:]
    assert all(r["update_successful"] and r["alpha"] > 0 for r in trained)
    assert trained[-1]["kl_budget"] < trained[0]["kl_budget"]  # the schedule moved on
    mine = checkpoint_model(tmp / "faulted" / "ckpt" / "iter_0000004")
    theirs = checkpoint_model(tmp / "reference" / "ckpt" / "iter_0000004")
    assert mine.keys() == theirs.keys() and mine
    moved = checkpoint_model(tmp / "reference" / "ckpt" / "iter_0000002")
    assert any(not torch.equal(moved[n], theirs[n]) for n in theirs)  # updates 3-4 moved it
    for name in mine:
        assert torch.equal(mine[name], theirs[name]), name


def test_engine_restarts_are_counted_and_the_engine_ends_in_sync(jobs):
    faulted = records(jobs["tmp"] / "faulted")[1:]
    # updates 1 and 2 of the first attempt (1 and 2 restarts so far); updates 3 and 4
    # were redone by the restarted job, whose engine never died
    assert [r["engine_restarts"] for r in faulted] == [1, 2, 0, 0]
    assert faulted[-1]["engine_weight_mismatches"] == 0
    assert all(r["checksum_mismatches"] == 0 for r in faulted)
