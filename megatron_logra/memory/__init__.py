"""The analytic models: the per-rank memory model of dense Adam, LoGRA and LoRA and its
forecasts (``benchmarks/memory_plan.py`` prints them; ``benchmarks/memory.py`` measures
what it predicts), and the RL throughput model of a GPU node. From the bottom up:

- ``shapes``: the named model shapes (HF config.json fields; ``shape_arch``: their
  ``ModelArch``) the models forecast and the benchmarks measure, the paper's among them
  (``PAPER_SHAPES``); the Qwen3-style 27B is ``assets/qwen3-27b/config.json``.
- ``inventory``: every parameter megatron builds for a shape (on the meta device: names,
  shapes, TP split dims), and the blocks one TP rank of one pipeline stage holds.
- ``rank_bytes``: one rank's bytes: model state per method, activations op by op, the
  optimizer step's transient; ``plan`` of every stage of a layout.
- ``forecast``: ``validate`` against measurement, the layouts the CLI accepts
  (``cli_accepts``), ``project`` onto 8 GPUs, the rollout engine's share and the
  ``placements`` that fit; the bytes of one weight sync (``sync_bytes``).
- ``throughput_model``: updates per hour of RL on one GPU node (pure arithmetic;
  ``benchmarks/throughput_model.py``, docs/throughput-model.md).
"""
