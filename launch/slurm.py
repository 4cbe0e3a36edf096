"""A Slurm batch job for a run: ``python launch/slurm.py [job flags] -- [trainer flags]``.

The trainer's flags (a recipe and what the command line adds) are checked at the job's
world size before anything is written; the job's script (``megatron_logra.slurm``: its
header comments say how it runs) goes to RUN_DIR/job.sbatch and is submitted with
``sbatch``, or printed with ``--print`` (``megatron_logra/slurm/cli.py``):

    # 2 trainer nodes x 8 GPUs and 1 engine node: print the script, submit nothing
    python launch/slurm.py --trainer-nodes 2 --engine-nodes 1 --gpus-per-node 8 \\
        --run-dir /shared/runs/logra-27b --print -- --config recipes/paper/logra-27b.yaml \\
        --rollout-tensor-parallel-size 8
    # the same, submitted (--wait: sbatch --wait, its exit status the job's)
    python launch/slurm.py --trainer-nodes 2 --engine-nodes 1 --gpus-per-node 8 \\
        --run-dir /shared/runs/logra-27b -- --config recipes/paper/logra-27b.yaml \\
        --rollout-tensor-parallel-size 8

Exit status 2 for a job refused (the message names the flag and the fix).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":
    from megatron_logra.slurm.cli import main

    sys.exit(main(entry=Path(__file__).resolve().parent / "pretrain_rl.py"))
