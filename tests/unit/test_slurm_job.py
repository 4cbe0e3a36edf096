"""The Slurm launcher's script (``launch/slurm.py``, ``megatron_logra.slurm``), no Slurm needed.

The generated script is run by bash with stand-ins for ``scontrol`` (node names and
addresses of a made-up allocation), ``srun`` and the nodes' Python, which record every
call: the trainer's ``srun`` runs on the first nodes (``--relative=0``), one torchrun
agent per node with ``--nnodes`` = trainer nodes, the c10d rendezvous at the first
trainer node's address, ``--max-restarts``, the run's ``--output-dir`` / ``--save`` /
``--auto-resume`` and ``--rollout-engine-url`` at the engine node's address; the engine's
``srun`` runs on the last node (``--relative`` = trainer nodes) with vLLM's server as the
trainer rank 0 would start it (``engine_task``'s flags give ``server_process`` the same
settings; on every interface);
the job waits for that URL before the trainer, returns the trainer's exit status and
stops the engine. ``--print`` writes the script to stdout and submits nothing (a
stand-in ``sbatch`` would record a call); without it the script is written to
RUN_DIR/job.sbatch and submitted. Bad jobs are refused with exit status 2 and a message
naming the flag and the fix: no run folder, zero trainer nodes, TP x PP not dividing the
trainer processes, a TP group across nodes, more processes than GPUs, a server larger
than a node, engine nodes for SFT, several engine nodes (the trainer takes one URL), and
flags the job owns given to the trainer. The engine task's watch ends a server that
stopped answering ``/health`` (or exited) and waits for one still starting; the job's
wait for the engines names a URL that does not answer, with its reason, at its bound, and
at once when the engines' task ended.
"""

from __future__ import annotations

import http.server
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron_logra.rollout.server_process import server_argv
from megatron_logra.rollout.config import EngineConfig
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.slurm import cli, engine_task
from megatron_logra.slurm.job import SlurmJobConfig, SlurmJobError, plan_job
from megatron_logra.slurm.script import render

REPO = Path(__file__).resolve().parents[2]
ENTRY = REPO / "launch" / "pretrain_rl.py"
RL = ["--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", "4",
      "--responses-per-prompt", "2", "--micro-batch-size", "1", "--seq-length", "96",
      "--max-new-tokens", "16", "--dataset-size", "60", "--eval-prompts", "4",
      "--train-iters", "4", "--save-interval", "2", "--rollout-dtype", "bfloat16"]
SFT = ["--stage", "sft", "--task", "basic_arithmetic", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--seq-length", "64", "--dataset-size", "40",
       "--train-iters", "2"]


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def run_script(tmp: Path, script: str, nodes: list[str], trainer_status: int = 0):
    """Run ``script`` as the batch step of an allocation of ``nodes`` (node X's address is
    X.addr); returns (exit status, [argv of each srun call], [argv of each python call])."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    calls = tmp / "calls.jsonl"
    record = (f'{sys.executable} -c "import json, sys; '
              f"open('{calls}', 'a').write(json.dumps([sys.argv[1]] + sys.argv[2:]) + '\\n')\" ")
    _stub(bin_dir / "scontrol", """
case "$1 $2" in
  "show hostnames") tr ',' '\\n' <<< "$3" ;;
  "show node") echo "NodeName=$3 Arch=x86_64 NodeAddr=$3.addr NodeHostName=$3" ;;
esac
""")
    _stub(bin_dir / "srun", f"""{record} srun "$@"
for a in "$@"; do
  [[ $a == megatron_logra.slurm.engine_task ]] && exec sleep 60
  [[ $a == torch.distributed.run ]] && exit {trainer_status}
done
""")
    _stub(bin_dir / "python-on-nodes", f'{record} python "$@"\n')
    _stub(bin_dir / "squeue", "")  # no engine step to signal: the stand-in srun is killed
    path = tmp / "job.sbatch"
    path.write_text(script.replace(f"PYTHON={sys.executable}",
                                   f"PYTHON={bin_dir / 'python-on-nodes'}"))
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST=",".join(nodes))
    proc = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True,
                          timeout=60)
    rows = [json.loads(line) for line in calls.read_text().splitlines()]
    return (proc.returncode, [r[1:] for r in rows if r[0] == "srun"],
            [r[1:] for r in rows if r[0] == "python"], proc.stdout + proc.stderr)


def _after(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_one_trainer_node_and_one_engine_node(tmp_path):
    job = SlurmJobConfig(run_dir=str(tmp_path / "run"), trainer_nodes=1, engine_nodes=1,
                         cpus_per_node=2, max_restarts=2, engine_port=8100,
                         job_env="GLOO_SOCKET_IFNAME=eth0")
    plan = plan_job(job, RL, ENTRY)
    script = render(plan)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
                 "#SBATCH --cpus-per-task=2", f"#SBATCH --output={tmp_path}/run/slurm-%j.out",
                 f"#SBATCH --chdir={Path.cwd()}", "#SBATCH --requeue",
                 "export GLOO_SOCKET_IFNAME=eth0"):
        assert line in script.splitlines(), line
    assert "--gpus-per-node" not in script

    status, sruns, pythons, log = run_script(tmp_path, script, ["n0", "n1"])
    assert status == 0, log
    # the engine step starts in the background: the two record in either order
    (engine,) = [s for s in sruns if "--job-name=engines" in s]
    (trainer,) = [s for s in sruns if s is not engine]
    assert engine[:6] == ["--job-name=engines", "--nodes=1", "--ntasks=1",
                          "--ntasks-per-node=1", "--relative=1",
                          f"--output={tmp_path}/run/engine-%N.log"]
    # the engine task: vLLM's server exactly as trainer rank 0 would start it for these
    # flags (server_process), listening on every interface at --engine-port
    task = engine[engine.index("megatron_logra.slurm.engine_task") + 1:]
    args = engine_task.build_parser().parse_args(task)
    assert (args.port, args.max_restarts, args.cuda) == (8100, 2, False)
    assert engine_task.server_spec(args) == ServerSpec(
        str((REPO / "megatron_logra/assets/tiny-llama").resolve()), max_model_len=96,
        engine=EngineConfig(dtype="bfloat16", kv_cache_gib=1.0, tensor_parallel_size=1,
                            seed=0))
    server = server_argv(engine_task.server_spec(args), 8100, cuda=False, host="0.0.0.0")
    assert _after(server, "--load-format") == "dummy"  # a folder without weights serves
    assert _after(server, "--host") == "0.0.0.0"

    wait, = [p for p in pythons if "megatron_logra.slurm.wait_engines" in p]
    assert wait[-1] == "http://n1.addr:8100"
    assert trainer[:5] == ["--nodes=1", "--ntasks=1", "--ntasks-per-node=1", "--relative=0",
                           "--kill-on-bad-exit=1"]
    torchrun = trainer[trainer.index("torch.distributed.run") + 1:]
    assert torchrun[:6] == ["--nnodes=1", "--nproc-per-node=1", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=n0.addr:29400", "--rdzv-id=42",
                            "--max-restarts=2"]
    assert torchrun[6] == str(ENTRY)
    args = torchrun[7:]
    assert args[:len(RL)] == RL
    assert _after(args, "--output-dir") == str(tmp_path / "run")
    assert _after(args, "--save") == str(tmp_path / "run" / "checkpoints")
    assert "--auto-resume" in args
    assert _after(args, "--rollout-engine-url") == "http://n1.addr:8100"


def test_n_trainer_nodes_meet_at_the_first_one_and_the_status_is_the_trainers(tmp_path):
    job = SlurmJobConfig(run_dir=str(tmp_path / "run"), trainer_nodes=4, engine_nodes=1,
                         gpus_per_node=2, partition="gpu", time="2:00:00",
                         sbatch_options="--exclusive --qos=high")
    plan = plan_job(job, RL + ["--tensor-model-parallel-size", "2"], ENTRY)
    script = render(plan)
    for line in ("#SBATCH --nodes=5", "#SBATCH --gpus-per-node=2", "#SBATCH --partition=gpu",
                 "#SBATCH --time=2:00:00", "#SBATCH --exclusive", "#SBATCH --qos=high"):
        assert line in script.splitlines(), line
    nodes = [f"gpu{i}" for i in range(5)]
    status, (engine, trainer), _, log = run_script(tmp_path, script, nodes, trainer_status=7)
    assert status == 7, log  # the trainer's
    assert engine[:5] == ["--job-name=engines", "--nodes=1", "--ntasks=1",
                          "--ntasks-per-node=1", "--relative=4"]
    task = engine_task.build_parser().parse_args(
        engine[engine.index("megatron_logra.slurm.engine_task") + 1:])
    assert task.cuda and task.port == 8000 and task.max_restarts == 3
    assert trainer[:4] == ["--nodes=4", "--ntasks=4", "--ntasks-per-node=1", "--relative=0"]
    torchrun = trainer[trainer.index("torch.distributed.run") + 1:]
    assert torchrun[:4] == ["--nnodes=4", "--nproc-per-node=2", "--rdzv-backend=c10d",
                            "--rdzv-endpoint=gpu0.addr:29400"]
    assert not any(a.startswith("--node-rank") for a in torchrun)  # the rendezvous's ranks
    assert _after(torchrun, "--rollout-engine-url") == "http://gpu4.addr:8000"
    assert "[slurm] trainer exited with status 7" in log


def test_two_engine_nodes_are_the_trainers_two_engines(tmp_path):
    """Each engine node is one engine: the trainer gets their URLs, comma-separated
    (--rollout-engine-url takes several), and the job waits for both."""
    job = SlurmJobConfig(run_dir=str(tmp_path / "run"), trainer_nodes=1, engine_nodes=2,
                         cpus_per_node=2)
    script = render(plan_job(job, RL, ENTRY))
    assert "#SBATCH --nodes=3" in script.splitlines()
    status, sruns, pythons, log = run_script(tmp_path, script, ["n0", "n1", "n2"])
    assert status == 0, log
    (engine,) = [s for s in sruns if "--job-name=engines" in s]
    (trainer,) = [s for s in sruns if s is not engine]
    assert engine[1:5] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--relative=1"]
    wait, = [p for p in pythons if "megatron_logra.slurm.wait_engines" in p]
    assert wait[-2:] == ["http://n1.addr:8000", "http://n2.addr:8000"]
    torchrun = trainer[trainer.index("torch.distributed.run") + 1:]
    assert _after(torchrun, "--rollout-engine-url") == "http://n1.addr:8000,http://n2.addr:8000"


def test_without_engine_nodes_the_trainer_starts_its_own(tmp_path):
    job = SlurmJobConfig(run_dir=str(tmp_path / "run"), trainer_nodes=2, engine_nodes=0)
    script = render(plan_job(job, RL, ENTRY))
    status, sruns, pythons, log = run_script(tmp_path, script, ["a", "b"])
    assert status == 0, log
    trainer, = sruns
    assert "--rollout-engine-url" not in trainer and not pythons
    assert "#SBATCH --nodes=2" in script.splitlines()


def test_print_writes_the_script_and_submits_nothing(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir / "sbatch",
          f'echo "$@" >> {tmp_path}/sbatch-calls\necho "Submitted batch job 9"\n')
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    run = tmp_path / "run"
    flags = ["--run-dir", str(run), "--engine-nodes", "1"]
    assert cli.main([*flags, "--print", "--", *RL], ENTRY) == 0
    printed = capsys.readouterr().out
    assert printed == render(plan_job(SlurmJobConfig(run_dir=str(run)), RL, ENTRY))
    assert not (tmp_path / "sbatch-calls").exists() and not run.exists()

    assert cli.main([*flags, "--wait", "--", *RL], ENTRY) == 0
    assert (run / "job.sbatch").read_text() == printed
    assert (tmp_path / "sbatch-calls").read_text().split() == ["--wait", str(run / "job.sbatch")]


REFUSED = [
    ([], RL, "--run-dir is required"),
    (["--trainer-nodes", "0"], RL, "--trainer-nodes must be >= 1, got 0"),
    (["--nproc-per-node", "3"], RL + ["--tensor-model-parallel-size", "2"],
     "world size 3 is not divisible by TP x PP = 2 x 1"),
    (["--trainer-nodes", "2", "--nproc-per-node", "2", "--engine-nodes", "0"],
     RL + ["--pipeline-model-parallel-size", "3"], "not divisible by TP x PP = 1 x 3"),
    (["--trainer-nodes", "2"], RL + ["--tensor-model-parallel-size", "2"],
     "a TP group would span nodes"),
    (["--gpus-per-node", "2", "--nproc-per-node", "4"], RL, "--nproc-per-node 4 exceeds "
                                                            "--gpus-per-node 2"),
    (["--gpus-per-node", "2"], RL + ["--rollout-tensor-parallel-size", "4"],
     "--rollout-tensor-parallel-size 4 exceeds the 2 GPUs of an engine node"),
    (["--cpus-per-node", "1"], RL + ["--rollout-tensor-parallel-size", "2"],
     "exceeds the 1 CPUs of an engine node"),
    (["--engine-nodes", "1"], SFT, "an SFT job has no rollout engine; use --engine-nodes 0"),
    ([], RL + ["--output-dir", "x"], "drop --output-dir from the trainer's flags"),
    ([], RL + ["--rollout-engine-url", "http://h:1"], "drop it (or use --engine-nodes 0"),
    ([], RL + ["--rollout-replicas", "2"], "each node is one engine"),
    (["--job-env", "A B=1"], RL, "--job-env: 'A' is not KEY=VALUE"),
    (["--sbatch-options", "exclusive"], RL, "'exclusive' is not an sbatch option"),
    (["--engine-port", "29400"], RL, "--rdzv-port and --engine-port must differ"),
    (["--run-dir", "my run"], RL, "holds a space, which #SBATCH lines"),
    ([], RL + ["--seq-lenght", "9"], "unrecognized arguments: --seq-lenght 9"),
]


@pytest.mark.parametrize("job_flags, trainer_flags, message", REFUSED,
                         ids=[r[2][:40] for r in REFUSED])
def test_a_bad_job_is_refused_naming_the_fix(tmp_path, capsys, job_flags, trainer_flags,
                                             message):
    flags = ([] if "--run-dir is required" in message else ["--run-dir", str(tmp_path / "r")])
    try:
        status = cli.main([*flags, *job_flags, "--print", "--", *trainer_flags], ENTRY)
    except SystemExit as exc:  # argparse refusing a job flag
        status = exc.code
    assert status == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_the_trainer_flags_come_after_a_separator(capsys):
    assert cli.main(["--run-dir", "x"], ENTRY) == 2
    assert "give the trainer's flags after --" in capsys.readouterr().err


def test_restarts_without_checkpoints_are_pointed_out():
    at = RL.index("--save-interval")
    no_saves = RL[:at] + RL[at + 2:]
    plan = plan_job(SlurmJobConfig(run_dir="r"), no_saves, ENTRY)
    assert any("set --save-interval" in note for note in plan.notes)
    assert not plan_job(SlurmJobConfig(run_dir="r"), RL, ENTRY).notes
    with pytest.raises(SlurmJobError, match="--run-dir is required"):
        SlurmJobConfig()


class _Health(http.server.BaseHTTPRequestHandler):
    status = 503

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(type(self).status)
        self.end_headers()

    def log_message(self, *args):
        pass


class _Proc:
    code = None

    def poll(self):
        return self.code


def test_the_engine_task_restarts_a_server_that_stops_answering_or_exits():
    """``engine_task.watch``: a server still starting is waited for; one that answered
    /health and then answers 503 (vLLM's API server after its engine core died) for
    longer than the bound has failed; a process that exits has failed at once."""
    _Health.status = 503
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    proc, healthy = _Proc(), []

    def flip():  # starting (503) for 0.6 s, healthy for 0.6 s, then 503 for good
        time.sleep(0.6)
        _Health.status = 200
        time.sleep(0.6)
        _Health.status = 503
    threading.Thread(target=flip, daemon=True).start()
    t0 = time.monotonic()
    failed = engine_task.watch(proc, url, 0.5, on_healthy=lambda: healthy.append(1),
                               poll_s=0.05)
    assert failed == "/health failed for 0.5 s (HTTP 503)"
    assert healthy == [1] and 1.6 < time.monotonic() - t0 < 5
    proc.code = 3
    assert engine_task.watch(proc, url, 0.5, poll_s=0.05) == "exited with code 3"
    server.shutdown()


def test_the_job_waits_for_the_engines_and_says_which_one_does_not_answer():
    """``wait_engines.wait``: healthy URLs end the wait; a URL with nothing listening is
    named with its reason when the bound passes, and at once when the engines' task ends."""
    from megatron_logra.runtime.device import free_port
    from megatron_logra.slurm.wait_engines import wait

    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Health.status = 200
    up, down = f"http://127.0.0.1:{server.server_port}", f"http://127.0.0.1:{free_port()}"
    assert wait([up], 5, poll_s=0.05) == ""
    t0 = time.monotonic()
    failed = wait([up, down], 0.5, logs="RUN/engine-*.log", poll_s=0.05)
    assert failed.startswith(f"no healthy vLLM server after 0.5 s: {down} (")
    assert "refused" in failed and failed.endswith("--engine-start-timeout")
    assert "RUN/engine-*.log" in failed and up not in failed
    ended = subprocess.Popen(["true"])
    ended.wait()
    t0 = time.monotonic()
    failed = wait([down], 60, task_pid=ended.pid, poll_s=0.05)
    assert failed.startswith("the engines' task ended before every server answered")
    assert time.monotonic() - t0 < 5
    server.shutdown()
