"""LoGRA: low-rank random gradient sketches, RowAdam, and their megatron-core plumbing.

Pure math (``projection``, ``row_adam``, ``rounding``) is plain torch, importable and testable
without megatron-core or torch.distributed.
"""
