"""Slurm batch jobs for a run (``launch/slurm.py``): trainer nodes through ``srun`` +
``torchrun``, engine nodes running vLLM's server, the trainer pointed at their URLs.

``job``: the job's settings (``SlurmJobConfig``, its flags) and the plan checked against
the trainer's own config; ``script``: the sbatch script of a plan; ``wait_engines``: what
the script runs to wait for the engines before the trainer starts.
"""
