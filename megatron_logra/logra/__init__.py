"""LoGRA: low-rank random gradient sketches, RowAdam, and their megatron-core plumbing.

Pure math (``projection``, ``rowadam``) is plain torch, importable and testable
without megatron-core or torch.distributed.
"""
