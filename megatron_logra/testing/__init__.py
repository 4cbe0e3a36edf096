"""Helpers shared by the tests, the workers they launch with torchrun, and the benchmarks
(as ``torch.testing`` is torch's); importable from anywhere, the package being installed.

- ``batches``: ``random_microbatches``, the random token batches the train-step tests and
  benchmarks feed megatron.
- ``log_readers``: TensorBoard and W&B logs read back with the libraries' own formats.
- ``fault_launch``: a torchrun job with a planned fault (``runtime.faults``), the processes
  and /dev/shm entries it left behind; the RL job the fault test and benchmark both run.
- ``same_run``: that RL job kept, and two kept runs compared bit for bit (a change that
  must not change results: ``python -m megatron_logra.testing.same_run``).
- ``gather``: a sharded model's full weights on every rank (layout-invariance tests).
- ``tiny_checkpoint``: a tiny HF folder with random-init weights.
"""
