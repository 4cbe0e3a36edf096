"""The analytic per-rank memory model of dense Adam, LoGRA and LoRA, and its projections
(``benchmarks/memory_plan.py`` prints them; ``benchmarks/memory.py`` measures what it
predicts). From the bottom up:

- ``shapes``: the named model shapes (HF config.json fields) the model projects and the
  benchmarks measure; the Qwen3-style 27B is ``assets/qwen3-27b/config.json``.
- ``inventory``: every parameter megatron builds for a shape (on the meta device: names,
  shapes, TP split dims), and the blocks one TP rank of one pipeline stage holds.
- ``rank_bytes``: one rank's bytes: model state per method, activations op by op, the
  optimizer step's transient; ``plan`` of every stage of a layout.
- ``projection``: ``validate`` against measurement, the layouts the CLI accepts
  (``cli_accepts``), ``project`` onto 8 GPUs, the rollout engine's share and the
  ``placements`` that fit; the bytes of one weight sync (``sync_bytes``).
"""
