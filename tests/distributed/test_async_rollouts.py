"""Asynchronous rollouts into two engine replicas, in one torchrun launch with real vLLM
(``async_worker.py``): trainer TP2 with LoGRA in bf16 (sketch-delta pushes, bit-exact),
predicted-KL control, --async-rollouts --max-staleness 1 --rollout-replicas 2.

What it shows: both engines hold the trainer's weights after every push (vLLM's
checksums against the trainer's, and against each other); samples carry the version
that generated them and train one step off; a killed engine is restarted and resynced
alone while the other goes on, and the batch it was generating is generated again (no
sample lost); a batch beyond --max-staleness-kl or --max-staleness never reaches the
loss (nothing trains, the weights and the engines stay), and is counted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "async_worker.py"
PROMPTS, RESPONSES = 4, 2
FLAGS = ["--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", str(PROMPTS),
         "--responses-per-prompt", str(RESPONSES), "--micro-batch-size", "4",
         "--seq-length", "96", "--max-new-tokens", "12", "--lr", "3e-3", "--dataset-size", "60",
         "--eval-prompts", "4", "--eval-samples", "1", "--train-iters", "8",
         "--tensor-model-parallel-size", "2", "--optimizer", "logra", "--logra-rank", "16",
         "--logra-update-ratio", "2e-2", "--weight-sync", "sketch-delta", "--bf16",
         "--logra-master-weights", "none", "--rollout-dtype", "bfloat16",
         "--kl-control", "predicted", "--kl-budget", "5e-4", "--kl-budget-final", "5e-4",
         "--kl-probe-responses", "2",
         "--async-rollouts", "--max-staleness", "1", "--rollout-replicas", "2"]


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("async")
    out = tmp / "result.json"
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(WORKER), str(out), *FLAGS, "--output-dir", str(tmp / "run")]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


def test_both_replicas_hold_the_trainers_weights_after_every_push(launched):
    checks = [launched["start"]] + [s["engines"] for s in launched["steps"]]
    for check in checks:
        assert check["mismatches"] == [0, 0], check
        assert check["checksums_equal"], check
        assert check["versions"] == [check["trainer"]] * 2, check
    assert checks[-1]["trainer"] == 6  # eight updates, two of them dropped as too stale


def test_samples_train_one_step_off_with_their_version(launched):
    steps = launched["steps"]
    batch = PROMPTS * RESPONSES
    assert [len(s["versions"]) for s in steps] == [batch] * 8  # no sample lost
    generated = [s["versions"][0] for s in steps]
    assert all(len(set(s["versions"])) == 1 for s in steps)
    # batch 0 at start; each later one beside the update before it, at that update's
    # weights; batch 3 again at update 3's (regenerated), batch 7 forced two versions early
    assert generated == [0, 0, 1, 3, 3, 4, 4, 4]
    lags = [s["record"]["staleness_max"] for s in steps]
    assert lags == [0, 1, 1, 0, 1, 0, 1, 2]
    for s in steps:
        assert s["record"]["staleness_max"] == s["version_before"] - s["versions"][0]


def test_a_killed_replica_is_restarted_alone_and_its_batch_generated_again(launched):
    steps = launched["steps"]
    assert launched["restarts"] == 1
    assert [s["record"].get("rollouts_regenerated", 0) for s in steps] == [0, 0, 0, 1, 0, 0, 0, 0]
    assert steps[2]["record"]["engine_restarts"] == 1  # update 3's push restarted engine 0
    # the restarted engine took a full push, the other one the sketch delta
    assert steps[3]["record"]["update_successful"] and steps[3]["record"]["tokens"] > 0


def test_batches_beyond_the_bounds_never_reach_the_loss(launched):
    steps = launched["steps"]
    kl_bound, version_bound = steps[4], steps[7]
    assert kl_bound["record"]["stale_dropped_kl"] == PROMPTS * RESPONSES
    assert kl_bound["record"]["staleness_kl_max"] > 1e-12
    assert version_bound["record"]["stale_dropped_versions"] == PROMPTS * RESPONSES
    for dropped in (kl_bound, version_bound):
        assert dropped["weights"] == [0.0] * (PROMPTS * RESPONSES)
        assert dropped["record"]["stale_skipped_update"]
        assert "tokens" not in dropped["record"]  # nothing trained
        assert dropped["version_after"] == dropped["version_before"]
    trained = [s for k, s in enumerate(steps) if k not in (4, 7)]
    for s in trained:
        assert s["version_after"] == s["version_before"] + 1
        assert s["record"]["tokens"] > 0 and s["record"]["stale_dropped_kl"] == 0


def test_the_time_split_adds_up_and_the_token_counts_are_the_batchs(launched):
    """One step off, an update's wall time (measured around the step by the worker) is its
    waiting (for the batch generated beside the last training, and for the engines before
    the push), training and push; only the batch generated again after the kill (update
    4) has generation and scoring seconds of its own. Token counts are the batch's own;
    a batch dropped as too stale trained none."""
    split = [f"time_{part}_s" for part in ("generation", "scoring", "training", "push",
                                           "waiting")]
    for k, step in enumerate(launched["steps"]):
        record = step["record"]
        parts = [record[key] for key in split]
        assert all(p >= 0 for p in parts), record
        assert 0 <= step["wall_s"] - sum(parts) < 0.05, (step["wall_s"], parts)
        assert record["time_waiting_s"] > 0, record
        assert (record["time_generation_s"] > 0) == (k == 3), (k, record)
        assert (record["time_scoring_s"] > 0) == (k == 3), (k, record)
        assert record["generated_tokens"] == step["batch_response_tokens"] > 0
        if record.get("stale_skipped_update"):
            assert record["trained_tokens"] == 0 and record["time_push_s"] == 0
        else:
            assert record["trained_tokens"] == step["batch_tokens"]
            assert min(record["time_training_s"], record["time_push_s"]) > 0, record
