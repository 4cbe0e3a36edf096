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
from dataclasses import dataclass
from typing import Callable, Protocol

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


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)`` of HF tensor ``hf_name`` (None: ``stop - start`` zero rows)."""

    hf_name: str | None
    start: int
    stop: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


class TensorSource(Protocol):
    """Reads (a row and/or column range of) one HF tensor."""

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor: ...


class DictSource:
    """A ``TensorSource`` over an in-memory HF state dict."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def read(self, name, rows=None, cols=None):
        t = self.state[name]
        if rows is not None:
            t = t[rows[0]:rows[1]]
        if cols is not None:
            t = t[:, cols[0]:cols[1]]
        return t


def _layer_parts(name: str) -> tuple[str, str]:
    """``decoder.layers.{i}.{suffix}`` -> (``model.layers.{i}.``, suffix)."""
    match = _LAYER.match(name)
    if not match:
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")
    return f"model.layers.{match.group(1)}.", match.group(2)


def megatron_param_shape(arch: ModelArch, name: str) -> tuple[int, ...]:
    """The full (TP=1) shape of canonical megatron parameter ``name``."""
    h, hn = arch.hidden_size, arch.head_dim
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return (arch.padded_vocab_size, h)
    if name == "decoder.final_layernorm.weight":
        return (h,)
    _, suffix = _layer_parts(name)
    shapes = {
        "input_layernorm.weight": (h,),
        "pre_mlp_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (arch.qkv_rows, h),
        "self_attention.linear_qkv.bias": (arch.qkv_rows,),
        "self_attention.q_layernorm.weight": (hn,),
        "self_attention.k_layernorm.weight": (hn,),
        "self_attention.linear_proj.weight": (h, arch.num_attention_heads * hn),
        "mlp.linear_fc1.weight": (2 * arch.ffn_hidden_size, h),
        "mlp.linear_fc2.weight": (h, arch.ffn_hidden_size),
    }
    if suffix not in shapes:
        raise KeyError(f"no HF mapping for megatron parameter {name!r}")
    return shapes[suffix]


def _hf_tensor_plan(arch: ModelArch):
    """(megatron name, HF name, HF shape) of every HF tensor, in megatron parameter order."""
    for name in megatron_param_names(arch):
        meta = torch.empty(megatron_param_shape(arch, name), device="meta")
        for hf, t in hf_from_megatron(arch, name, meta):
            yield name, hf, tuple(t.shape)


def hf_param_shapes(arch: ModelArch) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor the model needs, in megatron parameter order."""
    return {hf: shape for _, hf, shape in _hf_tensor_plan(arch)}


def hf_sources(arch: ModelArch) -> dict[str, str]:
    """{HF name: the megatron parameter it comes from}."""
    return {hf: name for name, hf, _ in _hf_tensor_plan(arch)}


def row_segments(arch: ModelArch, name: str) -> list[Segment]:
    """Megatron tensor ``name`` as HF row ranges stacked along dim 0 (the whole mapping HF ->
    megatron: qkv interleave per query group, fc1 = [gate; up], zero-padded vocab)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        src = ("model.embed_tokens.weight" if name.startswith("embedding")
               or arch.tie_word_embeddings else "lm_head.weight")
        return [Segment(src, 0, arch.vocab_size),
                Segment(None, arch.vocab_size, arch.padded_vocab_size)]
    if name == "decoder.final_layernorm.weight":
        return [Segment("model.norm.weight", 0, arch.hidden_size)]
    hf, suffix = _layer_parts(name)
    rows = megatron_param_shape(arch, name)[0]
    if suffix in _DIRECT:
        return [Segment(hf + _DIRECT[suffix], 0, rows)]
    if suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = suffix.rsplit(".", 1)[1]
        q, k, v = (hf + f"self_attn.{x}_proj.{kind}" for x in "qkv")
        hn, q_rows = arch.head_dim, arch.num_attention_heads // arch.num_kv_heads * arch.head_dim
        segments = []
        for g in range(arch.num_kv_heads):
            segments += [Segment(q, g * q_rows, (g + 1) * q_rows),
                         Segment(k, g * hn, (g + 1) * hn), Segment(v, g * hn, (g + 1) * hn)]
        return segments
    if suffix == "mlp.linear_fc1.weight":
        f = arch.ffn_hidden_size
        return [Segment(hf + "mlp.gate_proj.weight", 0, f), Segment(hf + "mlp.up_proj.weight", 0, f)]
    raise KeyError(f"no HF mapping for megatron parameter {name!r}")


def megatron_from_hf(arch: ModelArch, name: str, source: TensorSource | Reader,
                     rows: list[tuple[int, int]] | None = None,
                     cols: tuple[int, int] | None = None) -> torch.Tensor:
    """Megatron tensor ``name`` (or its rows ``rows``, a list of [start, stop) ranges in megatron
    row order, and/or its columns ``cols``) read from HF tensors.

    ``source`` is a ``TensorSource`` (reads only the needed rows/columns) or a plain
    ``read(hf_name) -> full tensor`` callable.
    """
    if callable(source) and not hasattr(source, "read"):
        source = _CallableSource(source)
    shape = megatron_param_shape(arch, name)
    tail = shape[1:] if cols is None else (cols[1] - cols[0], *shape[2:])
    parts: list[torch.Tensor | int] = []  # an int stands for that many zero (padding) rows
    for a, b in rows if rows is not None else [(0, shape[0])]:
        offset = 0
        for seg in row_segments(arch, name):
            lo, hi = max(a, offset), min(b, offset + seg.rows)
            if lo < hi:
                parts.append(hi - lo if seg.hf_name is None else source.read(
                    seg.hf_name, rows=(seg.start + lo - offset, seg.start + hi - offset), cols=cols))
            offset += seg.rows
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    parts = [torch.zeros((p, *tail), dtype=dtype) if isinstance(p, int) else p for p in parts]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


class _CallableSource:
    def __init__(self, read: Reader):
        self._read = read

    def read(self, name, rows=None, cols=None):
        return DictSource({name: self._read(name)}).read(name, rows, cols)


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
