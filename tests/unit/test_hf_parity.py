"""megatron-core GPTModel built by the provider vs HF transformers, same weights (fp32, TP=1).

This pins the architecture mapping (rope, GQA, qkv interleave, RMSNorm, SwiGLU,
qkv bias, q/k norm, tied/untied heads). A naive [q; k; v] concatenation is the
negative control: it must fail the same tolerance.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.model.arch import arch_from_hf_config
from megatron_logra.model.hf_mapping import (
    hf_from_megatron,
    interleave_qkv,
    megatron_from_hf,
    megatron_param_names,
    split_qkv,
)
from megatron_logra.model.tiny_assets import tiny_hf_config

TOL = 1e-5


def hf_param_names(arch) -> list[str]:
    """Every HF tensor name the model needs, listed by hand (the reference the mapping's
    round trip must produce)."""
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


def _hf_model(family: str, **arch):
    import transformers

    cfg_dict = tiny_hf_config(family, **arch)
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config}[family]
    config = cls(**{k: v for k, v in cfg_dict.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # make norms and biases non-trivial so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model, arch_from_hf_config(cfg_dict)


@pytest.fixture(scope="module")
def megatron_tp1():
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    rt = init_runtime()
    initialize(ParallelConfig(), rt.world_size, seed=0)
    return rt


def _megatron_logits(arch, hf_state, tokens, read=None):
    from megatron_logra.model.provider import ModelBuildConfig, assign_full_values, build_gpt_model

    model = build_gpt_model(arch, ModelBuildConfig(), seed=0).eval()
    read = read or hf_state.__getitem__
    assign_full_values(model, arch, lambda name, shape: megatron_from_hf(arch, name, read))
    b, s = tokens.shape
    pos = torch.arange(s).unsqueeze(0).expand(b, -1)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s)
    with torch.no_grad():
        return model(tokens, pos, mask)[..., : arch.vocab_size]


CASES = [
    ("llama", {}),
    ("llama", {"tie_word_embeddings": False, "num_kv_heads": 1}),
    ("qwen2", {"tie_word_embeddings": False}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("qwen3", {"head_dim": 48}),
]


@pytest.mark.parametrize("family,arch_kw", CASES)
def test_logits_match_transformers(megatron_tp1, family, arch_kw):
    hf, arch = _hf_model(family, **arch_kw)
    state = hf.state_dict()
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    got = _megatron_logits(arch, state, tokens)
    assert (got - ref).abs().max().item() < TOL


def test_naive_qkv_concatenation_fails_parity(megatron_tp1):
    hf, arch = _hf_model("llama")
    state = hf.state_dict()
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits

    def naive(name, shape):
        if name.endswith("linear_qkv.weight"):
            hf_prefix = name.replace("decoder.", "model.").replace(
                "self_attention.linear_qkv.weight", "self_attn.")
            return torch.cat([state[hf_prefix + f"{x}_proj.weight"] for x in "qkv"])
        return megatron_from_hf(arch, name, state.__getitem__)

    from megatron_logra.model.provider import ModelBuildConfig, assign_full_values, build_gpt_model

    model = build_gpt_model(arch, ModelBuildConfig(), seed=0).eval()
    assign_full_values(model, arch, naive)
    s = tokens.shape[1]
    with torch.no_grad():
        got = model(tokens, torch.arange(s).unsqueeze(0).expand(2, -1),
                    torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(2, 1, s, s))
    assert (got[..., : arch.vocab_size] - ref).abs().max().item() > 100 * TOL


@pytest.mark.parametrize("family,arch_kw", CASES)
def test_mapping_round_trip_is_bit_exact(family, arch_kw):
    hf, arch = _hf_model(family, **arch_kw)
    state = hf.state_dict()
    back = {}
    for name in megatron_param_names(arch):
        back.update(hf_from_megatron(arch, name, megatron_from_hf(arch, name, state.__getitem__)))
    assert sorted(back) == sorted(hf_param_names(arch))
    for name, tensor in back.items():
        assert torch.equal(tensor, state[name]), name


def test_qkv_interleave_is_per_group():
    hf, arch = _hf_model("llama", num_heads=4, num_kv_heads=2, hidden_size=8 * 4)
    hn = arch.head_dim
    q = torch.arange(4 * hn).float().unsqueeze(1)
    k = 100 + torch.arange(2 * hn).float().unsqueeze(1)
    v = 200 + torch.arange(2 * hn).float().unsqueeze(1)
    fused = interleave_qkv(arch, q, k, v).squeeze(1)
    group0 = fused[: 4 * hn]  # q heads 0-1, k head 0, v head 0
    assert torch.equal(group0[: 2 * hn], q[: 2 * hn, 0])
    assert torch.equal(group0[2 * hn: 3 * hn], k[:hn, 0])
    assert torch.equal(group0[3 * hn:], v[:hn, 0])
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(arch, fused.unsqueeze(1)), (q, k, v)))
