"""Pure TP slicing rules and layout-independent names (``model/sharding.py``).

Slicing a full tensor into TP shards and joining them back is the identity (rows or
columns, stride 1 or 2); stride 2 gives each rank its own gate and up rows of fc1, as
megatron lays them out; a split that does not divide is refused; parameter names map
to the same canonical (TP=1, PP=1) name from any pipeline stage and wrapper.
"""

import pytest
import torch

from megatron_logra.model.sharding import canonical_name, full_of_shards, shard_of_full


@pytest.mark.parametrize("dim,stride,size", [(0, 1, 2), (1, 1, 4), (0, 2, 2), (0, 2, 4)])
def test_shards_round_trip(dim, stride, size):
    full = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) if dim == 0 else \
        torch.arange(8 * 16, dtype=torch.float32).reshape(8, 16)
    shards = [shard_of_full(full, dim, stride, r, size) for r in range(size)]
    assert all(s.shape[dim] == full.shape[dim] // size for s in shards)
    assert torch.equal(full_of_shards(shards, dim, stride), full)


def test_stride_two_gives_each_rank_its_gate_and_up_rows():
    gate, up = torch.arange(4.0), 10 + torch.arange(4.0)
    full = torch.cat([gate, up]).unsqueeze(1)  # fc1 at TP1: [gate; up]
    rank1 = shard_of_full(full, 0, 2, 1, 2).squeeze(1)
    assert rank1.tolist() == [2.0, 3.0, 12.0, 13.0]  # [gate_1; up_1]


def test_bad_split_is_refused():
    with pytest.raises(ValueError, match="does not split"):
        shard_of_full(torch.zeros(6, 2), 0, 2, 0, 2)


def test_canonical_names_are_layout_independent():
    assert canonical_name("decoder.layers.1.mlp.linear_fc1.weight", 2) == \
        "decoder.layers.3.mlp.linear_fc1.weight"
    assert canonical_name("module.module.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                          4) == "decoder.layers.4.input_layernorm.weight"
    assert canonical_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", 0) == \
        "decoder.layers.0.pre_mlp_layernorm.weight"
    assert canonical_name("embedding.word_embeddings.weight", 3) == "embedding.word_embeddings.weight"
