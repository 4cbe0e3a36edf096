"""The sbatch script of a ``JobPlan``: one allocation, trainer nodes first, engine nodes last.

``render(plan)`` returns the script's text; its header comments say how it runs (the
same words as docs/usage.md, "Slurm"). Every value the plan holds is shell-quoted; what
is known only on the nodes (their addresses, hence the rendezvous endpoint and the
engines' URLs) is computed there from ``scontrol``.
"""

from __future__ import annotations

import shlex

from megatron_logra.slurm.job import JobPlan

def _q(value) -> str:
    return shlex.quote(str(value))


def _continued(words: list[str], indent: str = "    ") -> str:
    """``words`` as one shell command, a flag and its value per line."""
    lines, current = [], []
    for word in words:
        if word.startswith("--") and current:
            lines.append(" ".join(current))
            current = []
        current.append(word)
    lines.append(" ".join(current))
    return (" \\\n" + indent).join(lines)


def _header(plan: JobPlan) -> list[str]:
    job = plan.job
    t, e, n = job.trainer_nodes, job.engine_nodes, job.procs_per_node
    device = f"{job.gpus_per_node} GPUs" if job.gpus_per_node else "CPUs"
    lines = [
        "#!/bin/bash",
        f"# megatron_logra {plan.stage.upper()} job, written by launch/slurm.py: {t} trainer "
        f"node(s) x {n} process(es) and {e} engine node(s), {device} per node.",
        "#",
        f"# One allocation of {plan.nodes} node(s): the first {t} of $SLURM_JOB_NODELIST train"
        + (f", the last {e} serve the rollouts." if e else "."),
        "# `srun --nodes/--relative` runs one task per node on its share; a node never runs both.",
    ]
    if e:
        lines += [
            "# - Engine nodes: megatron_logra.slurm.engine_task runs vLLM's OpenAI server with",
            "#   this package's weight-transfer backend (mlogra, registered by its",
            "#   vllm.general_plugins entry point), the server trainer rank 0 would start, on",
            "#   dummy weights (the trainer's first push brings its own), on every interface at",
            "#   ENGINE_PORT (its command line heads its log). A server that exits, or stops",
            "#   answering /health, is killed and started again, up to MAX_RESTARTS times; the",
            "#   trainer waits for it and pushes full weights into it.",
            "# - This script (on the first trainer node) waits until every engine answers",
            "#   /health (ENGINE_START_TIMEOUT s at most; it stops at once if an engine task",
            "#   ends), then starts the trainer with --rollout-engine-url at their addresses.",
        ]
    lines += [
        "# - Trainer nodes: torchrun, one agent per node, meeting through the c10d rendezvous",
        "#   at the first trainer node (node ranks are the rendezvous's). After a process",
        "#   fails, --max-restarts starts them all again and they resume from the newest",
        "#   checkpoint in --save; --auto-resume does the same for a requeued or resubmitted job.",
        f"# - Outputs in {plan.run_dir}: metrics.jsonl and config.json (the trainer's",
        "#   --output-dir), checkpoints/ (unless the trainer's flags name --save),",
        "#   slurm-JOBID.out (this script and the trainer)"
        + (", engine-HOST.log (each server)." if e else "."),
        "# - The job's exit status is the trainer's" + (
            "; the engine tasks are then sent SIGTERM (each stops its server)." if e else "."),
    ]
    return lines


def _sbatch_lines(plan: JobPlan) -> list[str]:
    job = plan.job
    options = [f"--job-name={job.job_name}", f"--nodes={plan.nodes}", "--ntasks-per-node=1"]
    if job.cpus_per_node:
        options.append(f"--cpus-per-task={job.cpus_per_node}")
    if job.gpus_per_node:
        options.append(f"--gpus-per-node={job.gpus_per_node}")
    for name in ("partition", "account", "time"):
        if getattr(job, name):
            options.append(f"--{name}={getattr(job, name)}")
    options += [f"--output={plan.run_dir}/slurm-%j.out", "--open-mode=append",
                f"--chdir={plan.workdir}", "--requeue"]
    options += job.extra_options()
    return [f"#SBATCH {option}" for option in options]


_NODES = """\
mkdir -p "$RUN_DIR"
node_addr() {  # the address Slurm reaches a node at
    scontrol show node "$1" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p'
}
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD=$(node_addr "${NODES[0]}")"""

_ENGINES = """\
ENGINE_URLS=""
for node in "${NODES[@]:TRAINER_NODES:ENGINE_NODES}"; do
    ENGINE_URLS+="${ENGINE_URLS:+,}http://$(node_addr "$node"):$ENGINE_PORT"
done
echo "[slurm] job $SLURM_JOB_ID: trainer on ${NODES[*]:0:TRAINER_NODES} (rendezvous \\
$HEAD:$RDZV_PORT), engines $ENGINE_URLS\""""

_STOP_ENGINES = """\
stop_engines() {  # SIGTERM to the engine tasks (each stops its server), then their srun
    local step
    step=$(squeue -h -s -j "$SLURM_JOB_ID" -o "%i %j" 2>/dev/null \\
        | awk '$2 == "engines" {print $1}')
    if [[ -n $step ]]; then
        scancel --signal=TERM "$step" 2>/dev/null
        for _ in $(seq 60); do kill -0 "$ENGINES" 2>/dev/null || break; sleep 1; done
    fi
    kill -TERM "$ENGINES" 2>/dev/null
    wait "$ENGINES" 2>/dev/null
}
trap stop_engines EXIT"""


def render(plan: JobPlan) -> str:
    """The sbatch script for ``plan``."""
    job = plan.job
    t, e = job.trainer_nodes, job.engine_nodes
    out = _header(plan) + _sbatch_lines(plan) + ["", "set -uo pipefail"]
    out += [f"PYTHON={_q(job.python)}", f"RUN_DIR={_q(plan.run_dir)}",
            f"TRAINER_NODES={t} ENGINE_NODES={e} NPROC_PER_NODE={job.procs_per_node}",
            f"MAX_RESTARTS={job.max_restarts} RDZV_PORT={job.rdzv_port} "
            f"ENGINE_PORT={job.engine_port} ENGINE_START_TIMEOUT={job.engine_start_timeout:g}"]
    out += [f"export {key}={_q(value)}" for key, value in job.env_pairs()]
    out += ["", _NODES]
    if e:
        engine = _continued([_q(a) for a in plan.engine_args])
        out += ["", "# --- engines ---", _ENGINES,
                f'srun --job-name=engines --nodes={e} --ntasks={e} --ntasks-per-node=1 \\',
                f'    --relative={t} --output="$RUN_DIR/engine-%N.log" --open-mode=append \\',
                '    "$PYTHON" -m megatron_logra.slurm.engine_task \\',
                f"    {engine} &",
                "ENGINES=$!", _STOP_ENGINES,
                '"$PYTHON" -m megatron_logra.slurm.wait_engines \\',
                '    --timeout "$ENGINE_START_TIMEOUT" --task-pid "$ENGINES" \\',
                '    --logs "$RUN_DIR/engine-*.log" \\',
                '    ${ENGINE_URLS//,/ } || exit 1']
    trainer = [_q(a) for a in plan.trainer_args]
    if e:
        trainer += ["--rollout-engine-url", '"$ENGINE_URLS"']
    out += ["", "# --- trainer ---",
            f"srun --nodes={t} --ntasks={t} --ntasks-per-node=1 --relative=0 \\",
            "    --kill-on-bad-exit=1 \\",
            '    "$PYTHON" -m torch.distributed.run --nnodes="$TRAINER_NODES" \\',
            '    --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend=c10d \\',
            '    --rdzv-endpoint="$HEAD:$RDZV_PORT" --rdzv-id="$SLURM_JOB_ID" \\',
            '    --max-restarts="$MAX_RESTARTS" \\',
            f"    {_q(plan.entry)} \\",
            "    " + _continued(trainer),
            "status=$?",
            'echo "[slurm] trainer exited with status $status"',
            "exit $status", ""]
    return "\n".join(out)
