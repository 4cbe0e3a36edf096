"""``weight_sync.vllm_layout`` at TP sizes the CPU integration test cannot start (4, 8).

Two properties, each against an independent count:
- over all ranks, the primary pieces of every HF tensor cover each element exactly once
  (replicated KV heads and norms counted on one rank only);
- on each rank, the pieces that land in one vLLM parameter tile its local shard exactly
  (no gap, no overlap), the shard shape computed here from vLLM's own sharding rules:
  qkv rows (np/tp + 2 max(1, ng/tp)) hn, gate_up rows 2F/tp, o_proj/down_proj columns
  split tp ways, vocab rows padded to 64 and split tp ways (the padding left untouched).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.weight_sync.vllm_layout import vllm_placements
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import hf_param_shapes


def _arch(kv: int, tied: bool, bias: bool, qk_norm: bool) -> ModelArch:
    return ModelArch(family="qwen3" if qk_norm else "qwen2", hidden_size=64, num_layers=2,
                     num_attention_heads=8, num_kv_heads=kv, head_dim=16, ffn_hidden_size=96,
                     vocab_size=200, padded_vocab_size=256, max_position_embeddings=64,
                     rope_theta=1e4, rms_norm_eps=1e-6, tie_word_embeddings=tied,
                     qkv_bias=bias, qk_norm=qk_norm)


LAYOUTS = [(_arch(2, False, True, False), 8), (_arch(2, True, False, True), 4),
           (_arch(8, False, True, False), 4), (_arch(1, True, True, True), 2),
           (_arch(4, False, False, True), 1)]


def _local_shape(arch: ModelArch, param: str, full_shape: tuple[int, ...], tp: int):
    hd, kv_local = arch.head_dim, max(1, arch.num_kv_heads // tp)
    cols = () if len(full_shape) == 1 else (arch.hidden_size,)
    if ".qkv_proj." in param:
        return ((arch.num_attention_heads // tp + 2 * kv_local) * hd, *cols)
    if ".gate_up_proj." in param:
        return (2 * arch.ffn_hidden_size // tp, arch.hidden_size)
    if param.endswith(("o_proj.weight", "down_proj.weight")):
        return (full_shape[0], full_shape[1] // tp)
    if param in ("model.embed_tokens.weight", "lm_head.weight"):
        return (-(-arch.vocab_size // 64) * 64 // tp, arch.hidden_size)
    return full_shape


@pytest.mark.parametrize("arch,tp", LAYOUTS, ids=lambda x: str(x) if isinstance(x, int) else
                         f"kv{x.num_kv_heads}{'-tied' if x.tie_word_embeddings else ''}")
def test_placements_partition_hf_tensors_and_tile_vllm_shards(arch, tp):
    shapes = hf_param_shapes(arch)
    covered = {name: torch.zeros(shape, dtype=torch.int32) for name, shape in shapes.items()}
    for rank in range(tp):
        local_cover = {}
        for name, shape in shapes.items():
            for p in vllm_placements(arch, name, tp, rank):
                assert p.row1 <= shape[0] and (p.col1 is None or p.col1 <= shape[1]), (name, p)
                box = (slice(p.row0, p.row1),) + (() if p.col0 is None else
                                                  (slice(p.col0, p.col1),))
                if p.primary:
                    covered[name][box] += 1
                if p.param not in local_cover:
                    local_cover[p.param] = torch.zeros(
                        _local_shape(arch, p.param, shape, tp), dtype=torch.int32)
                local = (slice(p.local_row, p.local_row + p.row1 - p.row0),) + (
                    () if p.col0 is None else (slice(0, p.col1 - p.col0),))
                assert local_cover[p.param][local].numel() == covered[name][box].numel(), p
                local_cover[p.param][local] += 1
        for param, count in local_cover.items():
            if param in ("model.embed_tokens.weight", "lm_head.weight"):
                per = count.shape[0]
                real = max(0, min(per, arch.vocab_size - rank * per))
                assert bool((count[:real] == 1).all()) and bool((count[real:] == 0).all())
            else:
                assert bool((count == 1).all()), (rank, param)
    for name, count in covered.items():
        assert bool((count == 1).all()), name
