"""LoGRA's update against a restatement of the paper's reference arithmetic.

The reference (``skzhang1/RL``, ``nemo_rl/models/automodel/logra.py``) works on separate HF
modules (q, k, v, o, gate, up, down), each with its own RowAdam second moment. Restated
here per module m, for the sketch S (of the per-token mean loss) of an update with N
generated tokens:

    S'  = S / N                                  (``prepare_update``: divided again)
    v   <- b2 v + (1 - b2) mean_j S'_ij^2
    rho = sqrt(v / (1 - b2^t)),  den = rho + eps * mean_m(rho)
    D   = (min(den) / den) S', RMS-normalised, then rescaled to ||S'||_F  (restoration)
    c   = ratio * sqrt(sum_m ||W_m||^2 / sum_m ||D_m A||^2)       (one global factor)
    W_m <- W_m - bf16(alpha c D_m) A

Our optimizer holds megatron's fused weights (qkv interleaved per query group, fc1 =
[gate; up]) and must give every HF module the same change. Sketches are random, with
module scales spread over four orders of magnitude, token counts differ per update and
one row has no gradient, over three updates (v carries over). Without restoration both
sides are plain RowAdam (D = S' / den), which the same test checks too.

The same tiny model then takes real LoGRA steps through the CLI, and its per-module
updates follow the sketch norms with restoration (and do not without it).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.cli import parse_run_config
from megatron_logra.config import LograConfig, OptimizerConfig
from megatron_logra.model.arch import load_arch
from megatron_logra.model.hf_mapping import hf_from_megatron
from megatron_logra.model.provider import ModelBuildConfig, unwrap
from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.parallel import ParallelConfig, initialize
from megatron_logra.training.build import build_training_objects

SEED = 11
RANK = 16
RATIO = 6e-5


# --- the restatement ----------------------------------------------------------------------
def reference_direction(sketch: torch.Tensor, v: torch.Tensor, step: int, beta2: float,
                        eps: float, restore: bool) -> torch.Tensor:
    """One module's RowAdam direction as the reference computes it (v [out, 1] in place)."""
    tiny = torch.finfo(sketch.dtype).tiny
    v.mul_(beta2).add_(sketch.square().mean(1, keepdim=True), alpha=1 - beta2)
    root = (v / (1 - beta2 ** step)).sqrt()
    den = root + (eps * root.mean()).clamp_min(tiny)
    if not restore:
        return sketch / den
    scale = den.min() / den
    scale = scale / scale.square().mean().sqrt().clamp_min(tiny)
    direction = scale * sketch
    return direction * (sketch.norm() / direction.norm().clamp_min(tiny))


class ReferenceLoGRA:
    """The reference's state and update over HF modules (fp32, one process)."""

    def __init__(self, weights: dict[str, torch.Tensor], restore: bool, beta2=0.95, eps=1e-8,
                 factor_dtype=torch.bfloat16):
        self.weights = {n: w.clone() for n, w in weights.items()}
        self.factor_dtype = factor_dtype
        self.factors: dict[str, torch.Tensor] = {}
        self.v = {n: torch.zeros(w.shape[0], 1) for n, w in weights.items()}
        self.restore, self.beta2, self.eps, self.step = restore, beta2, eps, 0

    def update(self, sketches: dict[str, torch.Tensor], projections: dict[str, torch.Tensor],
               tokens: float, alpha: float = 1.0) -> None:
        self.step += 1
        directions = {n: reference_direction(s / tokens, self.v[n], self.step, self.beta2,
                                             self.eps, self.restore)
                      for n, s in sketches.items()}
        w_sq = sum(w.double().square().sum() for w in self.weights.values())
        da_sq = sum((d @ projections[n]).double().square().sum() for n, d in directions.items())
        factor = RATIO * (w_sq / da_sq).sqrt().item()
        for n, d in directions.items():
            self.factors[n] = (d * factor * alpha).to(self.factor_dtype).float()
            self.weights[n] -= self.factors[n] @ projections[n]


# --- helpers ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    init_runtime()
    initialize(ParallelConfig(), 1, seed=SEED)
    # 4 query heads over 2 groups: q, k, v rows interleave in the fused qkv
    return write_tiny_model_dir(tmp_path_factory.mktemp("ref"), "llama")


def _hf(arch, slots, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused megatron tensors (weights or sketches, by canonical name) -> HF modules."""
    return {hf: t for slot in slots for hf, t in hf_from_megatron(arch, slot.name,
                                                                   tensors[slot.name])}


def _random_sketches(arch, slots, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fused sketches whose HF modules have very different norms (10^-2 .. 10^2)."""
    out = {}
    for slot in slots:
        s = torch.randn(slot.sketch.shape, generator=gen)
        ids = slot.module_rows
        scales = 10.0 ** (4 * torch.rand(len(slot.module_names), generator=gen) - 2)
        s *= scales[ids][:, None] * (0.5 + torch.rand(s.shape[0], 1, generator=gen))
        out[slot.name] = s
    first = slots[0].name
    out[first][3] = 0.0  # a row without gradient: D = 0 there
    return out


@pytest.mark.parametrize("restore,factor", [(True, "float32"), (False, "float32"),
                                            (True, "bfloat16")])
def test_update_equals_the_reference_per_hf_module(model_dir, restore, factor):
    """fp32 factors: every module's change within 1e-4 (relative Frobenius norm; measured
    1.2e-7). bf16 factors (the default): the same rounding on both sides, so the factors
    agree except where fp32 noise tips an element over a rounding boundary (one bf16 ulp,
    at most 0.1% of the elements; changes within 1.4e-4). The stored weights are W - factor
    A up to fp32's own rounding of W."""
    arch = load_arch(model_dir)
    objs = build_training_objects(
        arch, ModelBuildConfig(), OptimizerConfig(name="logra", logra=LograConfig(
            rank=RANK, update_ratio=RATIO, norm_restoration=restore,
            update_factor_dtype=factor)), seed=SEED, train_iters=3)
    opt, sk = objs.optimizer, objs.optimizer.sketches
    opt.keep_updates = True
    params = dict(unwrap(objs.model[0]).named_parameters())
    fused = {s.name: params[s.name].detach() for s in sk.slots}
    ref = ReferenceLoGRA(_hf(arch, sk.slots, fused), restore,
                         factor_dtype=getattr(torch, factor))
    assert len(ref.weights) == 7 * arch.num_layers  # q k v o gate up down per layer
    gen = torch.Generator().manual_seed(0)
    for tokens in (37.0, 212.0, 5.0):
        sketches = _random_sketches(arch, sk.slots, gen)
        projections = {hf: slot.projection.float() for slot in sk.slots
                       for hf, _ in hf_from_megatron(arch, slot.name, sketches[slot.name])}
        for slot in sk.slots:  # as SketchSet.reduce leaves them: summed and per-token
            slot.sketch.copy_(sketches[slot.name])
        sk.num_tokens = tokens
        old = _hf(arch, sk.slots, {n: p.clone() for n, p in fused.items()})
        ok, _, _ = opt.step()
        assert ok
        ref.update(_hf(arch, sk.slots, sketches), projections, tokens)
        ours = _hf(arch, sk.slots, fused)
        factors = _hf(arch, sk.slots, {n: u.d * u.coefficient
                                       for n, u in opt.last_updates.items()})
        for name, want in ref.weights.items():
            # the change each side applies, factor A (before W's own fp32 rounding)
            got_change = factors[name].double() @ projections[name].double()
            want_change = ref.factors[name].double() @ projections[name].double()
            err = float((got_change - want_change).norm() / want_change.norm())
            if factor == "float32":
                assert err <= 1e-4, (name, tokens, err)
            else:
                ulp = 2.0 ** (torch.frexp(ref.factors[name])[1] - 8)
                off = (factors[name] - ref.factors[name]).abs()
                assert bool((off <= ulp).all()) and float((off > 0).float().mean()) < 0.01
                assert err <= 1e-3, (name, tokens, err)
            # and the stored weights: W - factor A, up to fp32's rounding of W itself
            tol = 4 * torch.finfo(torch.float32).eps * float(old[name].abs().max())
            assert float((ours[name] - want).abs().max()) <= tol + 2 * float(
                (got_change - want_change).abs().max()), name
            ref.weights[name] = ours[name].clone()  # the next update starts from the same W


def test_restoration_changes_the_update_it_is_tested_against(model_dir):
    """The check above can fail: with and without restoration the reference's per-module
    changes differ by far more than its tolerance (modules of different sketch norms)."""
    arch = load_arch(model_dir)
    gen = torch.Generator().manual_seed(0)
    objs = build_training_objects(arch, ModelBuildConfig(), OptimizerConfig(
        name="logra", logra=LograConfig(rank=RANK)), seed=SEED, train_iters=1)
    sk = objs.optimizer.sketches
    params = dict(unwrap(objs.model[0]).named_parameters())
    weights = _hf(arch, sk.slots, {s.name: params[s.name].detach() for s in sk.slots})
    sketches = _hf(arch, sk.slots, _random_sketches(arch, sk.slots, gen))
    projections = {hf: slot.projection.float() for slot in sk.slots
                   for hf, _ in hf_from_megatron(arch, slot.name, slot.sketch)}
    on, off = ReferenceLoGRA(weights, True), ReferenceLoGRA(weights, False)
    on.update(sketches, projections, 10.0)
    off.update(sketches, projections, 10.0)
    worst = max(float(((on.weights[n] - weights[n]) - (off.weights[n] - weights[n])).norm()
                      / (on.weights[n] - weights[n]).norm()) for n in weights)
    assert worst > 0.5  # measured: 1700x on the worst module


# --- real steps through the CLI -----------------------------------------------------------
def _module_change_per_sketch_norm(model_dir, tmp_path, restore: bool, monkeypatch):
    """One LoGRA SFT step of the tiny model from the command line; per HF module
    ||dW_m|| / (||S_m|| sqrt(in_m)) (dW = D A with A A^T ~ (in / r) I), and the change
    against the restatement on the captured sketches."""
    from megatron_logra.logra.optimizer import LograOptimizer
    from megatron_logra.training import prepare, sft

    captured = {}
    original = LograOptimizer._directions

    def capture(self):
        captured["sketches"] = {s.name: s.sketch.clone() for s in self.sketches.slots}
        captured["tokens"] = self.sketches.num_tokens
        captured["projections"] = {s.name: s.projection.float().clone()
                                   for s in self.sketches.slots}
        return original(self)

    monkeypatch.setattr(LograOptimizer, "_directions", capture)
    built = {}
    build = prepare.build_training_objects

    def keep(*args, **kwargs):
        built["objs"] = build(*args, **kwargs)
        built["before"] = {n: p.detach().clone() for n, p in
                           unwrap(built["objs"].model[0]).named_parameters()}
        return built["objs"]

    monkeypatch.setattr(prepare, "build_training_objects", keep)
    argv = ["--model-dir", str(model_dir), "--optimizer", "logra", "--logra-rank", "16",
            "--train-iters", "1", "--global-batch-size", "8", "--micro-batch-size", "4",
            "--seq-length", "64", "--dataset-size", "64", "--seed", str(SEED),
            "--output-dir", str(tmp_path / ("on" if restore else "off"))]
    if not restore:
        argv.append("--no-logra-norm-restoration")
    sft.run_sft(parse_run_config(argv, world_size=1))
    arch = load_arch(model_dir)
    objs = built["objs"]
    sk = objs.optimizer.sketches
    after = {n: p.detach() for n, p in unwrap(objs.model[0]).named_parameters()}
    before = built["before"]
    old = _hf(arch, sk.slots, before)
    new = _hf(arch, sk.slots, after)
    sketches = _hf(arch, sk.slots, captured["sketches"])
    ref = ReferenceLoGRA(old, restore)
    ref.update(sketches, {hf: captured["projections"][slot.name] for slot in sk.slots
                          for hf, _ in hf_from_megatron(arch, slot.name, before[slot.name])},
               captured["tokens"])
    errors = {n: float(((new[n] - old[n]) - (ref.weights[n] - old[n])).norm()
                       / (ref.weights[n] - old[n]).norm()) for n in old}
    per_norm = {n: float((new[n] - old[n]).norm() / (sketches[n].norm()
                                                    * math.sqrt(old[n].shape[1])))
                for n in old}
    moved = {n: not torch.equal(after[n], before[n]) for n in after}
    return errors, per_norm, moved, sk


def test_a_cli_step_moves_modules_in_proportion_to_their_sketch_norms(model_dir, tmp_path,
                                                                       monkeypatch):
    errors, per_norm, moved, sk = _module_change_per_sketch_norm(model_dir, tmp_path, True,
                                                                 monkeypatch)
    # bf16 factors, as the restatement's; stored fp32 weights (measured 6e-5)
    assert max(errors.values()) <= 1e-3, errors
    spread = max(per_norm.values()) / min(per_norm.values())
    assert spread < 1.5, per_norm  # one global c: change ~ sketch norm (measured 1.22: A's noise)
    sketched = {s.name for s in sk.slots}
    assert all(moved[n] == (n in sketched) for n in moved)  # everything else is frozen
    monkeypatch.undo()
    _, plain, _, _ = _module_change_per_sketch_norm(model_dir, tmp_path, False, monkeypatch)
    assert max(plain.values()) / min(plain.values()) > 10 * spread, plain  # measured 311
