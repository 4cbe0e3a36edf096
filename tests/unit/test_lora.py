"""LoRA adapters (``--peft lora``) in one process (TP1) against a plain PyTorch reference.

The tiny Qwen2 model (qkv bias, gated MLP) is built twice from the same seed: with LoRA
adapters on qkv, proj, fc1 and fc2, and with megatron's dense layers whose weights are
set to the merged W + (alpha / r) B A. B is drawn at random (at step 0 it is zero, and
the adapted model must then equal the base). On one batch:
* the losses of the two models are equal (forward parity, fp32, rtol 1e-6);
* each adapter's gradient is the chain rule of the dense weight gradient G of the merged
  model: dA = s B^T G, dB = s G A^T (fp32, relative max error 1e-5);
* only the adapters train: no base parameter has a grad, a DDP buffer or optimizer state;
* A starts as PEFT's kaiming-uniform, B at zero (the adapted model is the base).
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.config import OptimizerConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.lora.layers import lora_modules
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, served_parameters, unwrap
from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.parallel import ParallelConfig, initialize
from megatron_logra.testing.batches import random_microbatches
from megatron_logra.training.build import build_training_objects
from megatron_logra.training.step import forward_backward

RANK, ALPHA, SEED = 4, 8.0, 3
SCALE = ALPHA / RANK


def _loss(reports: list[dict]) -> float:
    """Per-token loss from megatron's reports: {"lm loss": [loss_sum, tokens]}."""
    sums = torch.stack([r["lm loss"] for r in reports]).sum(0)
    return float(sums[0] / sums[1])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_runtime()
    initialize(ParallelConfig(), 1, seed=SEED)
    arch = load_arch(write_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "qwen2"))
    opt = OptimizerConfig(name="adam", lr=1e-3, clip_grad=0.0, peft="lora",
                          lora=LoraConfig(rank=RANK, alpha=ALPHA))
    lora = build_training_objects(arch, ModelBuildConfig(), opt, seed=SEED, train_iters=4)
    dense = build_training_objects(arch, ModelBuildConfig(),
                                   OptimizerConfig(name="adam", lr=1e-3, clip_grad=0.0),
                                   seed=SEED, train_iters=4)
    inner = unwrap(lora.model[0])
    init = {n: (m.lora_a.detach().clone(), m.lora_b.detach().clone())
            for n, m in lora_modules(inner)}
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for _, m in lora_modules(inner):
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * 0.05)
        dense_params = dict(unwrap(dense.model[0]).named_parameters())
        for n, m in lora_modules(inner):
            dense_params[f"{n}.weight"].copy_(m.weight + SCALE * m.lora_b @ m.lora_a)
    batch = random_microbatches(arch.vocab_size, count=1, batch=2, seq=32, seed=1,
                                mask_fraction=0.3)
    kw = dict(seq_length=32, micro_batch_size=2, vocab_size=arch.vocab_size)
    losses = {}
    for key, objs in (("lora", lora), ("dense", dense)):
        objs.optimizer.zero_grad()
        losses[key] = _loss(forward_backward(objs.model, batch, **kw))
    return lora, dense, init, losses


def test_adapters_start_as_peft_does(setup):
    lora, _, init, _ = setup
    assert len(init) == 4 * 4  # qkv, proj, fc1, fc2 in each of the 4 layers
    for name, (a, b) in init.items():
        assert b.abs().max() == 0, name
        bound = 1.0 / a.shape[1] ** 0.5
        assert a.abs().max() <= bound and a.abs().max() > 0.8 * bound, name


def test_forward_equals_the_merged_dense_model(setup):
    _, _, _, losses = setup
    assert abs(losses["lora"] - losses["dense"]) <= 1e-6 * abs(losses["dense"]), losses


def test_adapter_gradients_are_the_chain_rule_of_the_dense_gradient(setup):
    lora, dense, _, _ = setup
    dense_params = dict(unwrap(dense.model[0]).named_parameters())
    for name, m in lora_modules(unwrap(lora.model[0])):
        grad = dense_params[f"{name}.weight"].main_grad.double()
        a, b = m.lora_a.detach().double(), m.lora_b.detach().double()
        for got, want in ((m.lora_a.main_grad, SCALE * b.t() @ grad),
                          (m.lora_b.main_grad, SCALE * grad @ a.t())):
            err = float((got.double() - want).abs().max()) / float(want.abs().max())
            assert err <= 1e-5 and float(want.abs().max()) > 0, (name, err)


def test_only_the_adapters_train(setup):
    lora, _, _, _ = setup
    ddp = lora.model[0]
    buffered = {id(p) for buf in ddp.buffers for p in buf.params}
    for name, p in unwrap(ddp).named_parameters():
        adapter = name.endswith((".lora_a", ".lora_b"))
        assert p.requires_grad == adapter and (id(p) in buffered) == adapter, name
    stepped = {id(p) for g in lora.optimizer.param_groups for p in g["params"]}
    adapters = [p for n, p in unwrap(ddp).named_parameters() if n.endswith((".lora_a", ".lora_b"))]
    assert len(stepped) == len(adapters) == 2 * 16


def test_dropout_masks_come_from_the_rng_their_tp_layout_needs(setup):
    """A column-parallel adapter's input is replicated over TP ranks: its dropout mask
    comes from the default RNG (seeded alike on every TP rank, so ranks agree). A
    row-parallel one's input is a per-rank slice: its mask comes from megatron's
    model-parallel RNG (seeded per TP rank), leaving the default stream untouched."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    lora, _, _, _ = setup
    modules = dict(lora_modules(unwrap(lora.model[0])))
    column = next(m for m in modules.values() if m.lora_parallel == "column")
    row = next(m for m in modules.values() if m.lora_parallel == "row")
    tracker = get_cuda_rng_tracker()
    for m in (column, row):
        m.lora_dropout = 0.5
    try:
        for m, uses_default in ((column, True), (row, False)):
            x = torch.ones(3, 2, m.lora_a.shape[1])
            default_before = torch.get_rng_state()
            tracked_before = tracker.get_states()["model-parallel-rng"].clone()
            dropped = m._dropout(x)
            assert set(dropped.unique().tolist()) == {0.0, 2.0}  # dropped / rescaled by 1/p
            assert torch.equal(torch.get_rng_state(), default_before) != uses_default
            assert torch.equal(tracker.get_states()["model-parallel-rng"],
                               tracked_before) == uses_default
            torch.set_rng_state(default_before)  # leave the module's RNG as it was
            tracker.set_states({**tracker.get_states(), "model-parallel-rng": tracked_before})
    finally:
        for m in (column, row):
            m.lora_dropout = 0.0


def test_served_values_are_the_merged_weights_computed_one_at_a_time(setup, monkeypatch):
    """What a full push sends (``served_parameters``): W + s B A per adapted layer, each
    merged only when its turn comes (merging all at once would hold a second model)."""
    lora, dense, _, _ = setup
    inner = unwrap(lora.model[0])
    merged = []
    for name, m in lora_modules(inner):
        monkeypatch.setattr(m, "served_weight",
                            lambda f=m.served_weight, name=name: merged.append(name) or f())
    served = served_parameters(lora.model[0])
    assert not merged
    dense_params = dict(unwrap(dense.model[0]).named_parameters())
    for name, _ in lora_modules(inner):
        param, value = served[f"{name}.weight"]
        assert param is getattr(inner.get_submodule(name), "weight")
        torch.testing.assert_close(value(), dense_params[f"{name}.weight"].detach(),
                                   rtol=0, atol=1e-6)
        assert merged[-1] == name
    assert len(merged) == 16
    embedding, value = served["embedding.word_embeddings.weight"]  # not adapted: itself
    assert torch.equal(value(), embedding.detach())
