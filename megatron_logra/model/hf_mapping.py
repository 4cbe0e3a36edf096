"""HF <-> megatron-core GPTModel parameter mapping for Llama / Qwen2 / Qwen3 (full, TP=1 tensors).

One pure function each way, per parameter, in canonical (layout-independent,
local-spec) megatron names:

* ``megatron_from_hf(arch, name, read)``: the full megatron tensor ``name``, built
  from the HF tensors that ``read(hf_name)`` returns (pull style, so a converter
  can stream: it reads only what one megatron tensor needs).
* ``hf_from_megatron(arch, name, tensor)``: the HF (name, tensor) pairs of one full
  megatron tensor.

The fused qkv is interleaved per query group: for each of the ng groups,
np/ng query heads, then its key head, then its value head (hn rows each). fc1 is
[gate; up]. Vocab rows are zero-padded to ``arch.padded_vocab_size``.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from megatron_logra.model.arch import ModelArch

Reader = Callable[[str], torch.Tensor]

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# megatron suffix -> HF suffix, for the one-to-one tensors of a layer
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


def megatron_param_names(arch: ModelArch) -> list[str]:
    """Every canonical megatron parameter of the full model (TP=1, PP=1)."""
    names = ["embedding.word_embeddings.weight"]
    for i in range(arch.num_layers):
        p = f"decoder.layers.{i}."
        names += [p + "input_layernorm.weight", p + "self_attention.linear_qkv.weight"]
        if arch.qkv_bias:
            names.append(p + "self_attention.linear_qkv.bias")
        if arch.qk_norm:
            names += [p + "self_attention.q_layernorm.weight", p + "self_attention.k_layernorm.weight"]
        names += [p + "self_attention.linear_proj.weight", p + "pre_mlp_layernorm.weight",
                  p + "mlp.linear_fc1.weight", p + "mlp.linear_fc2.weight"]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_param_names(arch: ModelArch) -> list[str]:
    """Every HF tensor name the model needs (the completeness check of a checkpoint)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        names += [p + s for s in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                  "self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                  "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                                  "mlp.gate_proj.weight", "mlp.up_proj.weight",
                                  "mlp.down_proj.weight")]
        if arch.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if arch.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if not arch.tie_word_embeddings:
        names.append("lm_head.weight")
    return names


def interleave_qkv(arch: ModelArch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """[np*hn, ...], [ng*hn, ...], [ng*hn, ...] -> megatron fused [ng*(np/ng+2)*hn, ...]."""
    ng, hn = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_attention_heads // ng
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(ng, per_group * hn, *tail), k.reshape(ng, hn, *tail),
                       v.reshape(ng, hn, *tail)], dim=1)
    return fused.reshape(arch.qkv_rows, *tail)


def split_qkv(arch: ModelArch, fused: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``interleave_qkv``."""
    ng, hn = arch.num_kv_heads, arch.head_dim
    per_group = arch.num_attention_heads // ng
    tail = fused.shape[1:]
    grouped = fused.reshape(ng, (per_group + 2) * hn, *tail)
    q, k, v = grouped.split([per_group * hn, hn, hn], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def _pad_vocab(arch: ModelArch, table: torch.Tensor) -> torch.Tensor:
    if table.shape[0] != arch.vocab_size:
        raise ValueError(f"vocab table has {table.shape[0]} rows, config.json says vocab_size="
                         f"{arch.vocab_size}")
    pad = table.new_zeros(arch.padded_vocab_size - arch.vocab_size, table.shape[1])
    return torch.cat([table, pad])


def _layer_parts(name: str) -> tuple[str, str]:
    """``decoder.layers.{i}.{suffix}`` -> (``model.layers.{i}.``, suffix)."""
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")
    return f"model.layers.{match.group(1)}.", match.group(2)


def megatron_from_hf(arch: ModelArch, name: str, read: Reader) -> torch.Tensor:
    if name == "embedding.word_embeddings.weight":
        return _pad_vocab(arch, read("model.embed_tokens.weight"))
    if name == "output_layer.weight":
        src = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return _pad_vocab(arch, read(src))
    if name == "decoder.final_layernorm.weight":
        return read("model.norm.weight")
    hf, suffix = _layer_parts(name)
    if suffix in _DIRECT:
        return read(hf + _DIRECT[suffix])
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return interleave_qkv(arch, *(read(hf + f"self_attn.{x}_proj.{kind}") for x in "qkv"))
    if suffix == "mlp.linear_fc1.weight":
        return torch.cat([read(hf + "mlp.gate_proj.weight"), read(hf + "mlp.up_proj.weight")])
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def hf_from_megatron(arch: ModelArch, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", tensor[: arch.vocab_size])]
    if name == "output_layer.weight":
        return [] if arch.tie_word_embeddings else [("lm_head.weight", tensor[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", tensor)]
    hf, suffix = _layer_parts(name)
    if suffix in _DIRECT:
        return [(hf + _DIRECT[suffix], tensor)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        return [(hf + f"self_attn.{x}_proj.{kind}", t)
                for x, t in zip("qkv", split_qkv(arch, tensor))]
    if suffix == "mlp.linear_fc1.weight":
        gate, up = tensor.chunk(2)
        return [(hf + "mlp.gate_proj.weight", gate), (hf + "mlp.up_proj.weight", up)]
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")
