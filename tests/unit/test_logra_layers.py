"""Sketched layers and the LoGRA step in one process (TP1) against dense references.

Every target is sketched: qkv (with bias), proj, fc1, fc2 and the tied embedding
matrix, whose sketch sums its lookup and output-layer uses.

The same tiny model (same seed) is built three times: with megatron's dense layers and
Adam; with the sketched layers, plain RowAdam and Adam for the unsketched parameters
(``--no-logra-norm-restoration --logra-untargeted adam``); and as the paper's LoGRA
(the defaults: the four layer targets, everything else frozen). On one batch:
* each sketch S equals G A^T with G the dense weight gradient (fp32, rtol 1e-5), also
  when every parameter is frozen (the embedding output carries the backward);
* sketched weights get no gradient anywhere: no .grad, no DDP buffer, no main_grad;
  frozen ones neither: the paper's LoGRA has no grad buffer and no dense optimizer;
* one LoGRA update equals W - lr D A (the scheduler's lr) with D from a textbook RowAdam on G A^T, and
  the unsketched parameters follow torch.optim.Adam (Adam's first step) as before;
  frozen parameters do not move at all.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.config import LograConfig, OptimizerConfig
from megatron_logra.logra.projection import parameter_seed, projection_block
from megatron_logra.logra.config import TARGETS
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, unwrap
from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.parallel import ParallelConfig, initialize
from megatron_logra.testing.batches import random_microbatches
from megatron_logra.training.build import build_training_objects
from megatron_logra.training.step import forward_backward

RANK = 8
SEED = 5
LR = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    init_runtime()
    initialize(ParallelConfig(), 1, seed=SEED)
    model_dir = write_tiny_model_dir(tmp_path_factory.mktemp("tiny"), "qwen2")  # qkv bias too
    arch = load_arch(model_dir)
    build = ModelBuildConfig()
    dense = build_training_objects(arch, build, OptimizerConfig(name="adam", lr=LR, clip_grad=0.0),
                                   seed=SEED, train_iters=10)
    logra_cfg = OptimizerConfig(name="logra", lr=LR, clip_grad=0.0,
                                logra=LograConfig(rank=RANK, eps=1e-8, targets=TARGETS,
                                                  norm_restoration=False, untargeted="adam",
                                                  update_factor_dtype="float32",
                                                  update_ratio=None))
    sketched = build_training_objects(arch, build, logra_cfg, seed=SEED, train_iters=10)
    paper = build_training_objects(arch, build, OptimizerConfig(
        name="logra", lr=LR, logra=LograConfig(rank=RANK, update_ratio=6e-5)), seed=SEED,
        train_iters=10)
    batch = random_microbatches(arch.vocab_size, count=2, batch=2, seq=32, seed=0,
                                mask_fraction=0.3)
    kw = dict(seq_length=32, micro_batch_size=2, vocab_size=arch.vocab_size)
    for objs in (dense, sketched, paper):
        objs.optimizer.zero_grad()
        forward_backward(objs.model, batch, **kw)
    return arch, dense, sketched, paper


def _named(objs) -> dict[str, torch.nn.Parameter]:
    return dict(unwrap(objs.model[0]).named_parameters())


def test_every_sketch_equals_the_dense_gradient_times_a_transposed(setup):
    _, dense, sketched, _ = setup
    dense_params = _named(dense)
    slots = sketched.optimizer.sketches.slots
    # qkv, proj, fc1, fc2 per layer (tiny: 4 layers) + the tied embedding (lookup + output)
    assert len(slots) == 4 * 4 + 1 and slots[-1].name == "embedding.word_embeddings.weight"
    for slot in slots:
        grad = dense_params[slot.name].main_grad.float()
        a = projection_block(parameter_seed(SEED, 0, slot.name), RANK, (0, grad.shape[1]))
        want = grad @ a.t()
        err = float((slot.sketch - want).abs().max()) / float(want.abs().max())
        assert err <= 1e-5, (slot.name, err)  # measured ~1e-7: fp32 summation order
        assert float(want.abs().max()) > 0


def test_sketched_weights_get_no_dense_gradient_anywhere(setup):
    _, dense, sketched, _ = setup
    ddp = sketched.model[0]
    buffer_params = {id(p) for buf in ddp.buffers for p in buf.params}
    for weight in sketched.optimizer.sketches.params:
        assert not weight.requires_grad and weight.grad is None
        assert getattr(weight, "main_grad", None) is None and id(weight) not in buffer_params
    # the dense optimizer holds no sketched weight, nor any state tensor of a sketched shape
    from megatron_logra.runtime.megatron_optimizer import torch_optimizers

    sketched_ids = {id(p) for p in sketched.optimizer.sketches.params}
    shapes = {tuple(p.shape) for p in sketched.optimizer.sketches.params}
    dense_shapes = {tuple(p.shape) for n, p in _named(sketched).items() if p.requires_grad}
    for torch_opt in torch_optimizers(sketched.dense_optimizer):
        for group in torch_opt.param_groups:
            for p in group["params"]:
                assert id(p) not in sketched_ids
                assert tuple(p.shape) not in shapes - dense_shapes
    grad_elems = sum(buf.grad_data.numel() for buf in ddp.buffers)
    sketched_elems = sum(p.numel() for p in sketched.optimizer.sketches.params)
    dense_elems = sum(buf.grad_data.numel() for buf in dense.model[0].buffers)
    assert grad_elems == dense_elems - sketched_elems


def test_one_logra_update_equals_the_reference(setup):
    _, dense, sketched, _ = setup
    before = {n: p.detach().clone() for n, p in _named(sketched).items()}
    dense_params = _named(dense)
    lr = sketched.optimizer.param_groups[0]["lr"]
    assert lr == dense.optimizer.param_groups[0]["lr"] and 0 < lr <= LR
    ok, _, _ = sketched.optimizer.step()
    assert ok
    after = _named(sketched)
    beta2, eps = 0.95, 1e-8
    for slot in sketched.optimizer.sketches.slots:
        grad = dense_params[slot.name].main_grad.double()
        a = projection_block(parameter_seed(SEED, 0, slot.name), RANK, (0, grad.shape[1])).double()
        s = grad @ a.t()
        rho = [math.sqrt((1 - beta2) * float((s[i] ** 2).mean()) / (1 - beta2)) for i in range(len(s))]
        mean = sum(rho) / len(rho)
        d = s / (torch.tensor(rho, dtype=torch.float64)[:, None] + eps * mean)
        want = before[slot.name].double() - lr * (d @ a)
        assert torch.allclose(after[slot.name].double(), want, rtol=0, atol=1e-6), slot.name
        assert float((after[slot.name] - before[slot.name]).abs().max()) > 1e-5
    # unsketched params: Adam's first step moves each element by lr * sign(g) (eps aside)
    for name, p in after.items():
        if not p.requires_grad:
            continue
        g = dense_params[name].main_grad
        expect = before[name] - lr * g / (g.abs() + 1e-8)
        firm = g.abs() > 1e-6  # where |g| ~ Adam's eps, fp32 noise in g decides the sign
        assert firm.float().mean() > 0.9, name
        assert torch.allclose(p[firm], expect[firm], atol=1e-6), name
    # the next update uses fresh projections, and the sketches start from zero
    slot = sketched.optimizer.sketches.slots[0]
    fresh = projection_block(parameter_seed(SEED, 1, slot.name), RANK, (0, slot.projection.shape[1]))
    assert torch.equal(slot.projection, fresh) and float(slot.sketch.abs().max()) == 0.0


def test_papers_logra_freezes_everything_it_does_not_sketch(setup):
    """Defaults: qkv/proj/fc1/fc2 sketched, the rest frozen (no dense optimizer, no grad
    buffers). The sketches are still G A^T: the embedding output carries the backward."""
    _, dense, _, paper = setup
    opt = paper.optimizer
    assert opt.dense is None and not paper.model[0].buffers
    assert not any(p.requires_grad for p in unwrap(paper.model[0]).parameters())
    assert {s.name.split(".")[-2] for s in opt.sketches.slots} == {
        "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    dense_params = _named(dense)
    for slot in opt.sketches.slots:
        grad = dense_params[slot.name].main_grad.float()
        a = projection_block(parameter_seed(SEED, 0, slot.name), RANK, (0, grad.shape[1]))
        want = grad @ a.t()
        err = float((slot.sketch - want).abs().max()) / float(want.abs().max())
        assert err <= 1e-5 and float(want.abs().max()) > 0, (slot.name, err)
    want_norm = sum(float(s.sketch.double().pow(2).sum()) for s in opt.sketches.slots) ** 0.5
    before = {n: p.detach().clone() for n, p in _named(paper).items()}
    ok, grad_norm, _ = opt.step()
    assert ok and grad_norm == pytest.approx(want_norm, rel=1e-6)  # the sketches' norm
    sketched_names = {s.name for s in opt.sketches.slots}
    for name, p in _named(paper).items():
        moved = not torch.equal(p.detach(), before[name])
        assert moved == (name in sketched_names), name
    assert opt.state_bytes()["row_states"] > 0


def test_targets_and_refresh_interval(setup):
    arch, _, _, _ = setup
    cfg = OptimizerConfig(name="logra", lr=LR, logra=LograConfig(rank=4, targets=("fc2",),
                                                                 refresh_interval=3,
                                                                 untargeted="adam"))
    objs = build_training_objects(arch, ModelBuildConfig(), cfg, seed=SEED, train_iters=4)
    sketches = objs.optimizer.sketches
    assert [s.name.split(".")[-2] for s in sketches.slots] == ["linear_fc2"] * 4
    assert [sketches.projection_update(u) for u in range(7)] == [0, 0, 0, 3, 3, 3, 6]
    requires = {n for n, p in _named(objs).items() if p.requires_grad}
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in requires
    assert "decoder.layers.0.mlp.linear_fc2.weight" not in requires
