"""The dry run (``launch/pretrain_rl.py --dry-run``): the real code of one training update
traced at full size on a CPU, for every rank of a job of N GPUs, without a GPU.

- ``fake_cuda``: the shims that give a CPU-only torch fake CUDA tensors that train;
- ``world``: one process as rank r of N on torch's fake process-group backend;
- ``checks``: collectives against their real backends, host reads answered;
- ``memory``: per-rank memory by category (torch's ``MemTracker``);
- ``batch``: the worst-case batch; ``trace``: one rank's update and first weight push;
- ``run``: the ranks to trace, their report (``dry_run.json``) and table.
"""
