"""The dry run (``launch/pretrain_rl.py --dry-run``, ``megatron_logra.dry_run``): the real
code of one RL update traced on fake CUDA tensors and the fake process-group backend for
the ranks of a world of 8, on the tiny shape (``memory.shapes``), in one process of its own
(``dry_run_worker.py``).

Checked against references: each traced rank's model state (enumerated from its live
objects after the update) equals the analytic plan's (``memory.rank_bytes.plan``) for its
pipeline stage within 1%, at TP2 x PP2 x DP2 with LoGRA and at TP4 x PP2 with dense Adam;
its peak lies above its model state; every send meets a receive of the same shape and
dtype on its peer; the weight push of the sending ranks carries their parameters. Faults
put into the update are caught with their call site: a CPU tensor all-reduced in a group
only NCCL serves, and a CPU tensor added to a CUDA one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_logra.memory.rank_bytes import plan
from megatron_logra.memory.shapes import shape_dir

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("dry_run_worker.py")
SHAPE = "tiny"
PLANS = {"tp2_pp2_dp2_logra": dict(tp=2, pp=2, dp=2, method="logra", rank=16),
         "tp4_pp2_dense_adam": dict(tp=4, pp=2, dp=1, method="dense_adam")}


@pytest.fixture(scope="module")
def worker():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(WORKER), shape_dir(SHAPE)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", list(PLANS))
def test_model_state_is_the_analytic_plans_within_1pc(worker, layout):
    report, spec = worker["layouts"][layout], PLANS[layout]
    assert report["errors"] == 0, [r["errors"] for r in report["ranks"]]
    stages = plan(SHAPE, spec["tp"], spec["pp"], spec["dp"], method=spec["method"],
                  rank=spec.get("rank", 256))["stages"]
    assert {r["coordinates"]["pp"] for r in report["ranks"]} == {0, 1}
    for r in report["ranks"]:
        traced = r["model_state_bytes"]["total"]
        planned = stages[r["coordinates"]["pp"]]["model_state"]
        assert abs(traced - planned) <= 0.01 * planned, (r["rank"], traced, planned)
        assert r["peak_bytes"] > traced


def test_ranks_alike_are_traced_once_and_stand_for_the_whole_world(worker):
    tp2 = worker["layouts"]["tp2_pp2_dp2_logra"]["ranks"]
    assert {r["rank"]: r["stands_for"] for r in tp2} == {0: [0, 1], 3: [2, 3], 4: [4, 5],
                                                           7: [6, 7]}
    tp4 = worker["layouts"]["tp4_pp2_dense_adam"]["ranks"]
    assert {r["rank"]: r["stands_for"] for r in tp4} == {0: [0, 1, 2, 3], 4: [4, 5, 6, 7]}


def test_update_collectives_and_point_to_point_match(worker):
    for name, report in worker["layouts"].items():
        assert report["p2p"]["pairs_checked"] >= 2 and not report["p2p"]["mismatches"], name
        for r in report["ranks"]:
            update = r["collectives"]["update"]
            assert update["nccl"]["calls"] > 0, (name, r["rank"])
            # every host read of a device value went through runtime.host_read or is
            # megatron-core's own (a read from the package any other way fails the rank)
            assert all(h["via"] == "host_value" or "megatron/core" in h["site"]
                       for h in r["host_reads"]), (name, r["host_reads"])


def test_the_first_weight_push_carries_the_senders_parameters(worker):
    for r in worker["layouts"]["tp4_pp2_dense_adam"]["ranks"]:
        push = r["weight_push"]
        assert push["bytes"] > 0 and push["parameters_sent"] > 0, r["rank"]
        # bf16 messages of this rank's shards (engine TP1: one worker gets everything)
        assert push["bytes"] >= r["model_state_bytes"]["params"] * 0.99, r["rank"]


@pytest.mark.parametrize("fault,kind,words", [
    ("cpu_tensor_to_nccl", "CollectiveMismatch", ("cpu tensors", "nccl")),
    ("cpu_tensor_into_cuda", "FakeTensorDeviceMismatchError", ("cuda:0", "cpu")),
])
def test_device_faults_in_the_update_are_caught_with_their_call_site(worker, fault, kind,
                                                                     words):
    got = worker["faults"][fault]
    (rank,) = got["report"]["ranks"]
    (error,) = rank["errors"]
    assert error["kind"] == kind and error["phase"] == "update"
    assert error["site"].startswith(f"tests/unit/dry_run_worker.py:{got['line']} "), error
    assert all(w in error["message"] for w in words), error["message"]
