"""Build a megatron-core GPTModel for a ``ModelArch`` on the current parallel layout.

Local layer spec on CPU (and on CUDA without Transformer Engine); the Transformer
Engine spec on CUDA when ``transformer_engine`` imports. Random init is
layout-independent: every parameter's full (TP=1) value is drawn from a generator
seeded by (seed, canonical name), then sliced to this rank's shard, so the same
seed gives the same full weights at any TP/PP.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import ModuleSpec, TransformerConfig

from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import megatron_param_names
from megatron_logra.model.sharding import canonical_name, shard_of_full, tp_split
from megatron_logra.runtime import versions
from megatron_logra.runtime.device import current_device


class ModelCustomization(Protocol):
    """What a feature may change in the network; the builder applies it and knows nothing
    else of the feature. It builds on megatron-core's local (non-TE) layer spec."""

    def layer_spec(self, local_spec: ModuleSpec) -> ModuleSpec:
        """The transformer layer spec to build, from megatron-core's local one."""

    def after_build(self, model: GPTModel) -> None:
        """Adjust the built stage (embedding, output layer) in place."""

    def init_params(self, model: GPTModel, arch: ModelArch, seed: int) -> None:
        """Initialise the parameters the feature added (the base model's are set by
        ``init_weights`` or loaded), layout-independently from ``seed``."""


@dataclass(frozen=True)
class ModelBuildConfig:
    """How to instantiate the network (not what it is: that is ModelArch)."""

    bf16: bool = False  # bf16 params (else fp32)
    recompute_activations: bool = False  # full activation recompute, one layer per chunk
    use_transformer_engine: bool | None = None  # None: TE spec when on CUDA and TE imports
    customization: ModelCustomization | None = None
    """A feature's change to the layers (LoGRA: ``logra.model_spec.SketchedLinears``)."""


def transformer_engine_available() -> bool:
    """Whether megatron-core builds real Transformer Engine layers here: its TE extension
    (``megatron/core/extensions/transformer_engine.py``) needs ``transformer_engine`` and
    ``transformer_engine.pytorch`` and otherwise builds MagicMock stand-ins, so its own
    ``HAVE_TE`` is asked, not whether the bare ``transformer_engine`` package imports."""
    if not torch.cuda.is_available():
        return False  # never import TE on CPU
    try:
        from megatron.core.extensions import transformer_engine as megatron_te
    except Exception:
        return False
    return bool(megatron_te.HAVE_TE)


def transformer_config(arch: ModelArch, build: ModelBuildConfig) -> TransformerConfig:
    dtype = torch.bfloat16 if build.bf16 else torch.float32
    recompute = ({"recompute_granularity": "full", "recompute_method": "uniform",
                  "recompute_num_layers": 1} if build.recompute_activations else {})
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=arch.init_std,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=build.bf16,
        use_cpu_initialization=True,
        perform_initialization=False,  # init_weights() below does it, layout-independently
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        batch_p2p_sync=False,
        attention_softmax_in_fp32=True,
        calculate_per_token_loss=True,
        deterministic_mode=False,
        **recompute,
    )


def replace_linears(spec: ModuleSpec, targets: tuple[str, ...], column: type,
                    row: type) -> ModuleSpec:
    """The local layer ``spec`` with the ``targets`` linears built as ``column`` (qkv, fc1)
    or ``row`` (proj, fc2) classes instead of megatron's (in place; returned)."""
    attn, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
    for target, owner, attr, cls in (("qkv", attn, "linear_qkv", column),
                                     ("proj", attn, "linear_proj", row),
                                     ("fc1", mlp, "linear_fc1", column),
                                     ("fc2", mlp, "linear_fc2", row)):
        if target in targets:
            setattr(owner, attr, cls)
    return spec


def layer_spec(arch: ModelArch, build: ModelBuildConfig):
    if build.customization is not None:
        if build.use_transformer_engine:
            raise ValueError("a customised model (LoGRA's sketched linears) builds on "
                             "megatron-core's local Column/RowParallelLinear: build with "
                             "use_transformer_engine=False (the trainer does this for "
                             "--optimizer logra)")
        return build.customization.layer_spec(
            get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm"))
    use_te = build.use_transformer_engine
    if use_te is None:
        use_te = transformer_engine_available()
    elif use_te and not transformer_engine_available():
        raise ValueError("--transformer-impl transformer_engine: Transformer Engine does not "
                         "import here (it needs CUDA and the GPU extra); use "
                         "--transformer-impl local or auto")
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm)
    return get_gpt_layer_local_spec(qk_layernorm=arch.qk_norm, normalization="RMSNorm")


def _construct(arch: ModelArch, build: ModelBuildConfig) -> GPTModel:
    model = GPTModel(
        config=transformer_config(arch, build),
        transformer_layer_spec=layer_spec(arch, build),
        vocab_size=arch.padded_vocab_size,
        max_sequence_length=arch.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=arch.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
    )
    _mark_tensor_parallel_params(model)
    if build.customization is not None:
        build.customization.after_build(model)
    return model


def build_gpt_model(arch: ModelArch, build: ModelBuildConfig, seed: int) -> GPTModel:
    """This rank's stage of the model, on the runtime device, random-initialised from ``seed``.

    Built on the device itself (megatron's ``use_cpu_initialization`` allocates without
    a device, so the default device decides): a GPU rank never holds its stage in host
    memory first. What megatron places elsewhere explicitly is moved after."""
    device = current_device()
    with torch.device(device):
        model = _construct(arch, build)
    if any(t.device != device for t in (*model.parameters(), *model.buffers())):
        model.to(device)
    init_weights(model, arch, seed)
    if build.customization is not None:
        build.customization.init_params(model, arch, seed)
    return model


def build_meta_model(arch: ModelArch, build: ModelBuildConfig) -> GPTModel:
    """This rank's stage with every parameter on the meta device (no memory): for layouts,
    names and shapes, e.g. megatron's checkpoint keys without building the weights."""
    with torch.device("meta"):
        return _construct(arch, build)


def _mark_tensor_parallel_params(model: GPTModel) -> None:
    """Set the TP attributes megatron-core 0.16.1 sets only inside
    ``_initialize_affine_weight_*`` (skipped with perform_initialization=False, which we
    use because init_weights() initialises layout-independently). Without them DDP, the
    grad norm and the optimizer would treat every shard as a TP duplicate.

    megatron-core internal touched: the ``tensor_model_parallel``, ``partition_dim`` and
    ``partition_stride`` attributes megatron hangs on parameters (via
    ``set_tensor_model_parallel_attributes``, megatron's own setter); the values are the
    ones megatron's initialiser would set, so nothing downstream changes."""
    versions.require("megatron-core", "megatron_logra.model.provider")
    from megatron.core.tensor_parallel import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    gated = model.config.gated_linear_unit
    for name, module in model.named_modules():
        if isinstance(module, VocabParallelEmbedding):
            split = (0, 1)
        elif isinstance(module, ColumnParallelLinear):
            # megatron's MLP builds fc1 with stride 2 for GLUs ([gate_r; up_r] per rank)
            split = (0, 2 if gated and name.endswith("linear_fc1") else 1)
        elif isinstance(module, RowParallelLinear):
            split = (1, 1)
        else:
            continue
        weight = getattr(module, "weight", None)
        if weight is not None and not getattr(weight, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(weight, True, *split)


def layer_offset(model: GPTModel) -> int:
    """Global index of this stage's first layer."""
    layers = getattr(model.decoder, "layers", None) if hasattr(model, "decoder") else None
    if not layers:
        return 0
    return layers[0].layer_number - 1


def canonical_param_names(model: torch.nn.Module, arch: ModelArch) -> dict[str, str]:
    """{local parameter name: layout-independent name} for this rank's stage.

    A tied output layer on the last pipeline stage is the embedding's copy and
    gets the embedding's name.
    """
    inner = unwrap(model)
    offset = layer_offset(inner)
    names = {}
    for name, _ in inner.named_parameters():
        canon = canonical_name(name, offset)
        if arch.tie_word_embeddings and canon == "output_layer.weight":
            canon = "embedding.word_embeddings.weight"
        names[name] = canon
    return names


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module") and not isinstance(model, GPTModel):
        model = model.module
    return model


ServedValue = Callable[[], torch.Tensor]


def served_parameters(model: torch.nn.Module) -> dict[str, tuple[torch.nn.Parameter, ServedValue]]:
    """{local parameter name: (the parameter, a function giving the value the forward uses
    for it)}.

    The value is the parameter itself, except for a layer whose forward weight is not its
    ``.weight`` alone: such a layer says so with a ``served_weight()`` method (LoRA's
    W + (alpha / r) B A, this rank's shard of it). What a rollout engine and an export
    must hold is the served value. The values are computed when asked for, one at a time:
    merging every LoRA layer at once would hold a second copy of the model's weights."""
    out = {}
    for module_name, module in unwrap(model).named_modules():
        served = getattr(module, "served_weight", None)
        for name, param in module.named_parameters(recurse=False):
            key = f"{module_name}.{name}" if module_name else name
            out[key] = (param, served if served is not None and name == "weight"
                        else param.detach)
    return out


def global_shape(param: torch.Tensor) -> tuple[int, ...]:
    split = tp_split(param)
    shape = list(param.shape)
    if split is not None:
        shape[split[0]] *= parallel_state.get_tensor_model_parallel_world_size()
    return tuple(shape)


def param_generator(seed: int, name: str) -> torch.Generator:
    """The CPU generator a parameter's full initial value is drawn from: seeded by (seed,
    canonical name), so the value is the same at any layout."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def initial_full_value(name: str, shape: tuple[int, ...], arch: ModelArch, seed: int) -> torch.Tensor:
    """The TP=1 initial value of parameter ``name`` (fp32, CPU).

    Norm weights 1, biases 0, linear/embedding weights N(0, std^2) with megatron's
    scaled init (std / sqrt(2L)) for the residual-output projections; padded vocab
    rows are zero, as after an HF conversion.
    """
    if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = arch.init_std
    if name.endswith("linear_proj.weight") or name.endswith("linear_fc2.weight"):
        std = arch.init_std / math.sqrt(2.0 * arch.num_layers)
    gen = param_generator(seed, name)
    value = torch.randn(shape, generator=gen) * std
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        value[arch.vocab_size:] = 0.0
    return value


FullValue = Callable[[str, tuple[int, ...]], torch.Tensor]
"""(canonical name, full TP=1 shape) -> the full tensor."""

ShardValue = Callable[[str, tuple[int, ...], "tuple[int, int] | None", int, int], torch.Tensor]
"""(canonical name, full shape, (partition_dim, stride) or None, tp_rank, tp_size) -> this
rank's shard (what ``shard_of_full`` would cut from the full tensor)."""


@torch.no_grad()
def assign_shard_values(model: torch.nn.Module, arch: ModelArch, shard_value: ShardValue) -> None:
    """Set every local parameter of the base model (``hf_mapping.megatron_param_names``) to
    ``shard_value(...)`` (checked against the local shape). Parameters a customization
    added (LoRA's adapters) are the customization's to set (``init_params``)."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    names = canonical_param_names(model, arch)
    base = set(megatron_param_names(arch))
    for local_name, param in unwrap(model).named_parameters():
        if names[local_name] not in base:
            continue
        split = tp_split(param)
        value = shard_value(names[local_name], global_shape(param), split, tp_rank, tp_size)
        if value.shape != param.shape:
            raise ValueError(f"{names[local_name]}: got shape {tuple(value.shape)}, this rank's "
                             f"shard is {tuple(param.shape)}")
        param.copy_(value.to(param.dtype))


def assign_full_values(model: torch.nn.Module, arch: ModelArch, full_value: FullValue) -> None:
    """Set every local parameter to its TP shard of ``full_value(name, full_shape)``."""

    def shard_value(name, shape, split, rank, size):
        full = full_value(name, shape)
        if tuple(full.shape) != shape:
            raise ValueError(f"{name}: got shape {tuple(full.shape)}, the model expects {shape}")
        return full if split is None else shard_of_full(full, split[0], split[1], rank, size)

    assign_shard_values(model, arch, shard_value)


def init_weights(model: torch.nn.Module, arch: ModelArch, seed: int) -> None:
    assign_full_values(model, arch, lambda name, shape: initial_full_value(name, shape, arch, seed))
