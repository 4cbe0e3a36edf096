"""Where each HF tensor lives in a vLLM tensor-parallel worker (Llama/Qwen2/Qwen3 models).

Pure index arithmetic, no vLLM import: a vLLM worker (``weight_sync.worker_shards``) uses
it to write pushes straight into vLLM's fused, sharded parameters, and the trainer to
predict vLLM's checksums of them (``weight_sync.checksums``). vLLM's layout at TP size ``tp``, rank ``t``:

- ``qkv_proj`` rows are [q_t; k_t; v_t]: this rank's query heads, then its KV heads
  (KV heads are replicated when there are fewer than ``tp``: rank t holds KV head
  t // (tp / kv_heads)); the bias likewise.
- ``gate_up_proj`` rows are [gate_t; up_t].
- ``o_proj`` and ``down_proj`` hold every row and a column slice.
- ``embed_tokens`` and ``lm_head`` hold a vocab row slice of the vocab padded to 64.
- norms are whole on every rank.

Checked against vLLM's own loader in tests/integration (a loaded engine's parameters,
read back through these placements, equal the HF checkpoint).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron_logra.model.arch import ModelArch

VLLM_VOCAB_PADDING = 64  # vllm vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE


@dataclass(frozen=True)
class Placement:
    """HF rows [row0, row1) x columns [col0, col1) of one HF tensor sit in vLLM parameter
    ``param`` from local row ``local_row`` (columns from 0). ``primary``: this rank's copy
    is the one that counts when the pieces of all ranks are put together (replicated KV
    heads and norms are held by several ranks)."""

    param: str
    row0: int
    row1: int
    local_row: int
    col0: int | None = None  # None: a 1-D tensor
    col1: int | None = None
    primary: bool = True


Locate = Callable[[str], list[tuple[torch.Tensor, Placement]]]
"""HF name -> the receiver's tensors holding pieces of it, with where (``Placement``)."""


def whole_tensors(weights: dict[str, torch.Tensor]) -> Locate:
    """``Locate`` for a dict of whole HF tensors."""
    def locate(name: str) -> list[tuple[torch.Tensor, Placement]]:
        t = weights[name]
        cols = (0, t.shape[1]) if t.dim() == 2 else (None, None)
        return [(t, Placement(name, 0, t.shape[0], 0, *cols))]
    return locate


def _split(name: str) -> tuple[str, str]:
    """``model.layers.3.self_attn.q_proj.weight`` -> (``model.layers.3.``, the rest)."""
    if name.startswith("model.layers."):
        i = name.index(".", len("model.layers.")) + 1
        return name[:i], name[i:]
    return "", name


def vllm_placements(arch: ModelArch, hf_name: str, tp: int, rank: int) -> list[Placement]:
    """This worker's pieces of HF tensor ``hf_name`` (empty when it holds none)."""
    prefix, rest = _split(hf_name)
    h, hd = arch.hidden_size, arch.head_dim
    kind = rest.rsplit(".", 1)[-1]  # weight | bias
    cols = (0, h) if kind == "weight" else (None, None)
    if rest.startswith("self_attn.") and rest[len("self_attn."):].split(".")[0] in (
            "q_proj", "k_proj", "v_proj"):
        q_heads = arch.num_attention_heads // tp
        if arch.num_kv_heads >= tp:
            kv_heads, kv_first, kv_primary = arch.num_kv_heads // tp, rank * (
                arch.num_kv_heads // tp), True
        else:
            replicas = tp // arch.num_kv_heads
            kv_heads, kv_first, kv_primary = 1, rank // replicas, rank % replicas == 0
        param = f"{prefix}self_attn.qkv_proj.{kind}"
        which = rest.split(".")[1]
        if which == "q_proj":
            return [Placement(param, rank * q_heads * hd, (rank + 1) * q_heads * hd, 0, *cols)]
        local = (q_heads + (kv_heads if which == "v_proj" else 0)) * hd
        return [Placement(param, kv_first * hd, (kv_first + kv_heads) * hd, local, *cols,
                          primary=kv_primary)]
    if rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        f = arch.ffn_hidden_size // tp
        local = 0 if rest.startswith("mlp.gate") else f
        return [Placement(f"{prefix}mlp.gate_up_proj.weight", rank * f, (rank + 1) * f, local,
                          0, h)]
    if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        width = (arch.num_attention_heads * hd if rest.startswith("self_attn")
                 else arch.ffn_hidden_size) // tp
        return [Placement(hf_name, 0, h, 0, rank * width, (rank + 1) * width)]
    if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
        padded = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        per = padded // tp
        row0, row1 = rank * per, min((rank + 1) * per, arch.vocab_size)
        return [Placement(hf_name, row0, row1, 0, 0, h)] if row1 > row0 else []
    rows = hd if rest.startswith("self_attn.") else h  # q_norm/k_norm (Qwen3): head_dim
    return [Placement(hf_name, 0, rows, 0, primary=rank == 0)]  # a norm: whole everywhere
