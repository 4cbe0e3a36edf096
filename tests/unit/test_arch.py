"""HF config.json -> ``ModelArch`` (``model/arch.py``), against hand-written expectations.

Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm, head_dim != hidden / heads) parse to the
right fields and fused-qkv row count; the padded vocab (a multiple of 128) does not
depend on TP; transformers 5's ``rope_parameters`` and Llama-3 rope scaling with
megatron-core's fixed factors are read. Every unsupported config (other families, MoE,
sliding windows, other activations or rope scalings, kv heads not dividing heads) is
refused naming the offending field, as are layouts the model cannot take (heads or
layers not divisible by TP / PP); kv heads fewer than TP are allowed.
"""

import json

import pytest

from megatron_logra.model.arch import (
    UnsupportedModelError,
    arch_from_hf_config,
    load_arch,
    pad_vocab,
)
from megatron_logra.model.tiny_assets import tiny_hf_config


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_families_parse(family):
    arch = arch_from_hf_config(tiny_hf_config(family, head_dim=48 if family == "qwen3" else None))
    assert arch.family == family
    assert arch.qkv_bias == (family == "qwen2")
    assert arch.qk_norm == (family == "qwen3")
    if family == "qwen3":
        assert arch.head_dim == 48 != arch.hidden_size // arch.num_attention_heads
    assert arch.qkv_rows == (arch.num_attention_heads + 2 * arch.num_kv_heads) * arch.head_dim


def test_padded_vocab_does_not_depend_on_tp():
    assert pad_vocab(151936) == 151936 and pad_vocab(49152) == 49152 and pad_vocab(259) == 384
    arch = arch_from_hf_config(tiny_hf_config(vocab_size=1000))
    assert arch.padded_vocab_size == 1024
    for tp in (1, 2, 4):
        arch.check_parallel(tp, 1)


def test_transformers5_rope_parameters():
    cfg = tiny_hf_config()
    del cfg["rope_theta"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    assert arch_from_hf_config(cfg).rope_theta == 500000.0


def test_llama3_rope_scaling_with_megatron_factors_is_accepted():
    cfg = tiny_hf_config()
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert arch_from_hf_config(cfg).rope_scaling_factor == 8.0


@pytest.mark.parametrize("change,match", [
    ({"model_type": "gpt2"}, "model_type='gpt2'"),
    ({"num_local_experts": 8}, "mixture-of-experts"),
    ({"use_sliding_window": True}, "sliding-window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
     "low_freq_factor"),
    ({"num_key_value_heads": 3}, "not a multiple"),
])
def test_unsupported_configs_are_refused(change, match):
    cfg = tiny_hf_config()
    cfg.update(change)
    with pytest.raises(UnsupportedModelError, match=match):
        arch_from_hf_config(cfg)


@pytest.mark.parametrize("tp,pp,match", [
    (8, 1, "num_attention_heads=4 is not divisible"),
    (1, 3, "num_hidden_layers=4 is not divisible"),
    (3, 1, "one must divide the other"),
])
def test_layouts_the_model_cannot_take(tp, pp, match):
    arch = arch_from_hf_config(tiny_hf_config())
    with pytest.raises(ValueError, match=match):
        arch.check_parallel(tp, pp)


def test_kv_heads_fewer_than_tp_is_allowed():
    arch = arch_from_hf_config(tiny_hf_config(num_heads=4, num_kv_heads=1))
    arch.check_parallel(4, 1)


def test_missing_or_broken_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_arch(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UnsupportedModelError, match="not valid JSON"):
        load_arch(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(tiny_hf_config("qwen2")))
    assert load_arch(tmp_path).family == "qwen2"
