"""LoRA (``--peft lora``): low-rank adapters on the frozen base, trained by megatron's Adam.

- ``config``: ``LoraConfig`` (no torch, no megatron).
- ``layers``: the adapter math on megatron-core's Column/RowParallelLinear, with its
  tensor-parallel layout; ``lora_layer_spec`` swaps them into the local layer spec.
- ``model_spec``: ``LoraAdapters``, the change handed to the model builder.
"""
