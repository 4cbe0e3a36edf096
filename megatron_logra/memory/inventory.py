"""Every parameter megatron builds for a shape, and the blocks one rank holds of them.

The parameters come from ``model.provider.build_meta_model`` (megatron's own modules on the
meta device: names, shapes and TP split dims, no memory); a rank's blocks divide them over
TP by their split dim and over PP by layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

ROLES = ("qkv", "proj", "fc1", "fc2")  # the layer linears LoGRA sketches and LoRA adapts


@dataclass(frozen=True)
class Param:
    """One parameter of the TP=1, PP=1 model megatron builds."""

    name: str
    shape: tuple[int, ...]
    split_dim: int | None  # megatron's TP partition dim (None: replicated)
    layer: int | None  # decoder layer (None: embedding, output layer, final norm)
    role: str  # qkv | proj | fc1 | fc2 | embedding | output | norm | other (biases)


@lru_cache(maxsize=None)
def model_of(shape: str):
    """(ModelArch, (Param, ...)) of a named shape (``memory.shapes``), from megatron's model
    built on the meta device at TP1/PP1 (this process's megatron state is set up for it:
    CPU, one rank)."""
    import os
    import warnings

    warnings.filterwarnings("ignore")
    os.environ.setdefault("MEGATRON_LOGRA_DEVICE", "cpu")
    from megatron_logra.memory.shapes import shape_arch
    from megatron_logra.model.provider import ModelBuildConfig, build_meta_model
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    init_runtime()
    initialize(ParallelConfig(), 1, seed=0)
    arch = shape_arch(shape)
    model = build_meta_model(arch, ModelBuildConfig(bf16=True, use_transformer_engine=False))
    params = []
    for name, p in model.named_parameters():
        split = getattr(p, "partition_dim", None) if getattr(p, "tensor_model_parallel",
                                                              False) else None
        layer = int(name.split(".")[2]) if name.startswith("decoder.layers.") else None
        role = next((r for r in ROLES if f"linear_{r}.weight" in name), "other")
        if name.endswith("layernorm.weight"):  # megatron keeps norm weights in fp32
            role = "norm"
        if name == "embedding.word_embeddings.weight":
            role = "embedding"
        elif name == "output_layer.weight":
            role = "output"
        params.append(Param(name, tuple(p.shape), split, layer, role))
    return arch, tuple(params)


@dataclass(frozen=True)
class Local:
    """One parameter's block on a rank: [rows, cols] (1-D: cols = 1)."""

    role: str
    rows: int
    cols: int
    parallel: str | None  # "column" (rows split), "row" (cols split), None (replicated)
    gated: bool  # a SwiGLU fc1 ([gate; up]: two row segments)

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def rank_params(shape: str, tp: int, pp: int, stage: int) -> list[Local]:
    """The parameter blocks pipeline stage ``stage`` holds on one TP rank."""
    arch, params = model_of(shape)
    per_stage = arch.num_layers // pp
    first, last = stage == 0, stage == pp - 1
    out = []
    for p in params:
        if p.layer is not None and not stage * per_stage <= p.layer < (stage + 1) * per_stage:
            continue
        if p.role == "embedding" and not first:
            continue
        if p.layer is None and p.role != "embedding" and not last:  # final norm, output
            continue
        # with fewer kv heads than TP ranks megatron-core 0.16 splits qkv like any other
        # column-parallel weight and all-gathers its output (``Attention.
        # get_query_key_value_tensors``): no kv head is replicated in the weight
        rows, cols = (p.shape[0], p.shape[1]) if len(p.shape) == 2 else (p.shape[0], 1)
        parallel = {0: "column", 1: "row"}.get(p.split_dim)
        if parallel == "column":
            rows //= tp
        elif parallel == "row":
            cols //= tp
        out.append(Local(p.role, rows, cols, parallel, p.role == "fc1"))
    if last and not first and arch.tie_word_embeddings:  # the last stage's copy of the
        emb = next(p for p in params if p.role == "embedding")  # tied embedding
        out.append(Local("output", emb.shape[0] // tp, emb.shape[1], "column", False))
    return out
