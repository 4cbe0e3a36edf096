"""``launch/slurm.py``'s command line: the job's flags, ``--`` and the trainer's flags ->
the plan (``slurm.job``) -> the script (``slurm.script``), printed or written to
RUN_DIR/job.sbatch and submitted with ``sbatch``. Exit status 2 for a job refused."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from megatron_logra.flags import add_flags
    from megatron_logra.slurm.job import SlurmJobConfig

    p = argparse.ArgumentParser(
        prog="python launch/slurm.py", usage="%(prog)s [job flags] -- [trainer flags]",
        description="Write a Slurm batch job (trainer nodes through srun + torchrun, engine "
                    "nodes running vLLM's server) and submit it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_flags(p, SlurmJobConfig, "the job")
    p.add_argument("--print", action="store_true", dest="print_only",
                   help="Print the script and submit nothing")
    p.add_argument("--wait", action="store_true",
                   help="Submit with sbatch --wait: return when the job ends, with its status")
    return p


def main(argv: list[str] | None = None, entry: str | Path = "launch/pretrain_rl.py") -> int:
    """The launcher; ``entry``: the trainer's script (``launch/pretrain_rl.py``)."""
    from megatron_logra.flags import FlagError, from_flags
    from megatron_logra.slurm.job import SlurmJobConfig, SlurmJobError, plan_job
    from megatron_logra.slurm.script import render

    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:cut])  # --help ends here
    if cut == len(argv):
        print("error: give the trainer's flags after --, e.g. python launch/slurm.py "
              "--run-dir RUN -- --config RECIPE.yaml", file=sys.stderr)
        return 2
    try:
        plan = plan_job(from_flags(SlurmJobConfig, args), argv[cut + 1:], entry)
    except (SlurmJobError, FlagError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    script = render(plan)
    if args.print_only:
        print(script, end="")
        return 0
    plan.run_dir.mkdir(parents=True, exist_ok=True)
    path = plan.run_dir / "job.sbatch"
    path.write_text(script)
    print(f"wrote {path}", flush=True)
    cmd = ["sbatch", *(["--wait"] if args.wait else []), str(path)]
    try:
        return subprocess.run(cmd).returncode
    except FileNotFoundError:
        print("error: sbatch not found: submit the script from a Slurm login node (or run "
              "scripts/slurm-single-node.sh for a one-host Slurm to try it)", file=sys.stderr)
        return 2
