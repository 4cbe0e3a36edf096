"""Predicted-KL control in one process: the math against brute force, the forward-mode
tangent of a real model against finite differences, and the scaled step.

* ``fisher_quadratic`` equals lim KL(p(z) || p(z + eps d)) / eps^2 (fp64 brute force),
  with vocab padding excluded; ``token_kl`` equals the textbook KL.
* On a tiny megatron model (TP1), the logits' tangent along the update, from the
  forward-mode pass, equals the central finite difference (z(+eps) - z(-eps)) / 2 eps
  of the *same* update applied for real: dense Adam (tangent = Adam's step) and LoGRA
  (tangent of the sketched layers -(X A^T)(c D)^T, finite difference through
  W - eps c D A formed densely, every target including the tied embedding).
* The applied update is alpha times the unscaled one, and the realized KL after it
  is alpha^2 K to second order.
* With bf16 params the step is scaled on the fp32 copies (megatron's main params,
  LoGRA's masters): each ends at old + alpha (new - old) against a twin's unscaled
  step, and the bf16 params are those copies rounded.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from megatron_logra.config import KLControlConfig, LograConfig, OptimizerConfig
from megatron_logra.kl import budget as kl_control
from megatron_logra.kl.controller import PredictedKLStep, cap_probe
from megatron_logra.kl.scaled_step import scaled_optimizer_step
from megatron_logra.kl.tangent_forward import UpdateTangents, logits_with_tangent
from megatron_logra.logra.optimizer import LograOptimizer
from megatron_logra.logra.config import TARGETS
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, unwrap
from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.parallel import ParallelConfig, initialize
from megatron_logra.testing.batches import random_microbatches
from megatron_logra.training.build import build_training_objects
from megatron_logra.training.step import forward_backward

SEED = 3


# --- the math -----------------------------------------------------------------------------
def _kl(z0: torch.Tensor, z1: torch.Tensor) -> torch.Tensor:
    p = torch.softmax(z0, -1)
    return (p * (torch.log_softmax(z0, -1) - torch.log_softmax(z1, -1))).sum(-1)


def test_fisher_quadratic_is_the_second_order_kl():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 40, generator=g, dtype=torch.float64) * 3
    d = torch.randn(5, 40, generator=g, dtype=torch.float64)
    temperature = 0.7
    k = kl_control.fisher_quadratic(z, d, temperature=temperature, vocab_size=40).double()
    eps = 1e-4
    brute = _kl(z / temperature, (z + eps * d) / temperature) / eps ** 2
    torch.testing.assert_close(k, brute, rtol=1e-3, atol=0)
    # padded vocabulary entries (global index >= vocab_size) take no part
    padded_z = torch.cat([z, torch.full((5, 8), 50.0, dtype=torch.float64)], -1)
    padded_d = torch.cat([d, torch.full((5, 8), 9.0, dtype=torch.float64)], -1)
    k_pad = kl_control.fisher_quadratic(padded_z, padded_d, temperature=temperature,
                                        vocab_size=40)
    torch.testing.assert_close(k_pad.double(), k, rtol=1e-5, atol=0)
    kl = kl_control.token_kl(z, z + 0.3 * d, temperature=temperature, vocab_size=40)
    torch.testing.assert_close(kl.double(), _kl(z / temperature, (z + 0.3 * d) / temperature),
                               rtol=1e-5, atol=1e-7)


def test_step_scale_budget_and_mismatch():
    assert kl_control.step_scale(0.0, 1e-4, 3.0) == 1.0
    assert kl_control.step_scale(1e-4, 1e-4, 3.0) == pytest.approx(1.0)
    assert kl_control.step_scale(4e-4, 1e-4, 3.0) == pytest.approx(0.5)
    assert kl_control.step_scale(1e-9, 1e-4, 3.0) == 3.0  # alpha_max
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(FloatingPointError, match="quadratic form"):
            kl_control.step_scale(bad, 1e-4, 3.0)
    cfg = KLControlConfig(control="predicted", budget=2e-4, budget_final=2e-5, budget_steps=300)
    # the reference's schedule: 2e-4 at update 0, the final 2e-5 reached at update H - 1
    assert kl_control.scheduled_budget(cfg, 0) == pytest.approx(2e-4)
    assert kl_control.scheduled_budget(cfg, 299) == kl_control.scheduled_budget(cfg, 900) \
        == pytest.approx(2e-5)
    assert kl_control.scheduled_budget(cfg, 298) > 2e-5 * 1.0001
    want = 2e-5 + 0.5 * 1.8e-4 * (1 + math.cos(math.pi * 150 / 299))
    assert kl_control.scheduled_budget(cfg, 150) == pytest.approx(want, rel=1e-12)
    assert abs(want - 1.1e-4) > 1e-7  # an H (not H - 1) schedule would give 1.1e-4 here
    ctl = kl_control.KLController(cfg)
    ctl.observe_mismatch(-0.5)  # negative mismatch counts as 0
    assert ctl.mismatch == 0.0 and ctl.budget(0) == pytest.approx(2e-4)
    ctl.observe_mismatch(1e-4)
    assert ctl.mismatch == pytest.approx(3e-5)
    assert ctl.budget(0) == pytest.approx(2e-4 - 3e-5)
    ctl.observe_mismatch(1.0)  # a large mismatch: never below half the budget
    assert ctl.budget(0) == pytest.approx(1e-4)
    ctl.observe_mismatch(None)  # no EOS-terminated response: unchanged
    state = ctl.state_dict()
    other = kl_control.KLController(cfg)
    other.load_state_dict(state)
    assert other.mismatch == ctl.mismatch
    # --no-kl-mismatch-adjust: m is still tracked, the budget is the schedule alone
    plain = kl_control.KLController(dataclasses.replace(cfg, mismatch_adjust=False))
    plain.observe_mismatch(1e-4)
    assert plain.mismatch == pytest.approx(3e-5) and plain.budget(0) == pytest.approx(2e-4)


# --- the tangent of a real model ----------------------------------------------------------
@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    init_runtime()
    initialize(ParallelConfig(), 1, seed=SEED)
    return write_tiny_model_dir(tmp_path_factory.mktemp("tiny_kl"), "qwen2")  # qkv bias


def _batch(vocab: int) -> list[dict]:
    return random_microbatches(vocab, count=2, batch=2, seq=24, seed=1, mask_fraction=0.3)


# "logra": the paper's (frozen unsketched params, restoration, norm ratio; an fp32 factor so
# the applied step is exactly alpha times the tangent's direction); "logra_adam": plain
# RowAdam at --lr beside megatron's Adam for the unsketched params (dense + low-rank tangents)
LOGRA = {"logra": LograConfig(rank=8, targets=TARGETS, update_ratio=3e-3,
                              update_factor_dtype="float32"),
         "logra_adam": LograConfig(rank=8, targets=TARGETS, update_ratio=None,
                                   untargeted="adam", norm_restoration=False,
                                   update_factor_dtype="float32")}


def _objects(arch, name: str, bf16: bool = False, lr: float = 3e-3, logra=None):
    logra = logra or LOGRA.get(name, LograConfig())
    return build_training_objects(arch, ModelBuildConfig(bf16=bf16),
                                  OptimizerConfig(name="adam" if name == "adam" else "logra",
                                                  lr=lr, clip_grad=0.0, logra=logra),
                                  seed=SEED, train_iters=4)


def _step_then_grads(objs, batch: list[dict], vocab: int) -> None:
    """One plain step (so Adam's second moments are not the first step's |g|), then the
    gradients of the step under test."""
    kw = dict(seq_length=24, micro_batch_size=2, vocab_size=vocab)
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)
    objs.optimizer.step()
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)


def _perturbed_logits(objs, probe, tangents, eps: float) -> torch.Tensor:
    """Logits with the update applied for real at scale eps (dense params + eps tangent,
    sketched weights + eps (-c D A) formed densely), then restored."""
    module = unwrap(objs.model[0])
    params = dict(module.named_parameters())
    sketched = {}
    for p in params.values():
        slot = getattr(p, "logra_slot", None)
        if slot is not None and slot in tangents.low_rank:
            t = tangents.low_rank[slot]
            sketched[id(p)] = (p, -t.coefficient * (t.d @ t.projection))
    with torch.no_grad():
        for n, t in tangents.dense.items():
            params[n].add_(t, alpha=eps)
        for p, dw in sketched.values():
            p.add_(dw, alpha=eps)
        logits, _ = logits_with_tangent(objs.model, probe, None)
        for n, t in tangents.dense.items():
            params[n].sub_(t, alpha=eps)
        for p, dw in sketched.values():
            p.sub_(dw, alpha=eps)
    return logits


def test_cap_probe_cuts_each_response_at_max_tokens_prompt_included():
    """The reference's probe: each response cut at max_tokens tokens including its prompt;
    a kept position predicts a token among the first max_tokens (position t predicts
    token t + 1, so t < max_tokens - 1)."""
    g = torch.Generator().manual_seed(0)
    b, s = 4, 10
    mask = torch.zeros(b, s)
    mask[0, 3:7] = 1.0  # prompt of 4 tokens, 4 generated
    mask[1, 5:10] = 1.0  # prompt of 6, 5 generated
    mask[3, 2:9] = 1.0  # prompt of 3, 7 generated; row 2 has none
    probe = {"tokens": torch.randint(0, 50, (b, s), generator=g), "loss_mask": mask,
             "labels": torch.randint(0, 50, (b, s), generator=g),
             "position_ids": torch.arange(s).expand(b, -1),
             "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s),
             "advantages": torch.arange(b, dtype=torch.float32)}
    assert cap_probe(probe, 11) is probe  # every sequence fits: nothing to cut
    out = cap_probe(probe, 7)  # positions t <= 5 of each row; row 2 has none, dropped
    assert out["loss_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 1],
                                         [0, 0, 1, 1, 1, 1]]
    assert torch.equal(out["tokens"], probe["tokens"][[0, 1, 3], :6])
    assert torch.equal(out["labels"], probe["labels"][[0, 1, 3], :6])
    assert torch.equal(out["position_ids"], probe["position_ids"][[0, 1, 3], :6])
    assert torch.equal(out["attention_mask"], probe["attention_mask"][[0, 1, 3], :, :6, :6])
    assert out["advantages"].tolist() == [0.0, 1.0, 3.0]
    out = cap_probe(probe, 6)  # row 1's prompt fills it: only rows 0 and 3 keep positions
    assert out["advantages"].tolist() == [0.0, 3.0] and out["loss_mask"].sum() == 5
    empty = cap_probe(probe, 2)  # no generated position left anywhere: one masked row
    assert empty["loss_mask"].sum() == 0 and empty["tokens"].shape == (1, 1)


@pytest.mark.parametrize("name", ["adam", "logra", "logra_adam"])
def test_tangent_matches_finite_difference_and_step_is_scaled(arch_dir, name):
    arch = load_arch(arch_dir)
    objs = _objects(arch, name)
    batch = _batch(arch.vocab_size)
    _step_then_grads(objs, batch, arch.vocab_size)
    probe = batch[0]
    kl = PredictedKLStep(KLControlConfig(control="predicted"), temperature=0.8,
                         vocab_size=arch.vocab_size)
    module = unwrap(objs.model[0])
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    seen = {}
    alpha = 0.05  # KL ~ 1e-3 here: second order dominates

    def choose_alpha(tangents):
        if name != "adam":  # every sketched weight; + norms, biases beside Adam
            assert len(tangents.low_rank) == 4 * 4 + 1
            assert bool(tangents.dense) == (name == "logra_adam")
        # the model is at the old weights while alpha is chosen
        for n, p in module.named_parameters():
            assert torch.equal(p, before[n]), n
        seen["k_capped"] = kl.quadratic_form(objs.model, cap_probe(probe, 9), tangents)
        logits, tangent = logits_with_tangent(objs.model, probe, tangents)
        mask = probe["loss_mask"].bool()
        first9 = mask & (torch.arange(mask.shape[1]) < 8)  # tokens 0..8 of each sequence
        seen["k_first9"] = float(kl_control.fisher_quadratic(
            logits[first9], tangent[first9], temperature=0.8, vocab_size=arch.vocab_size).mean())
        eps = 1e-2
        fd = (_perturbed_logits(objs, probe, tangents, eps)
              - _perturbed_logits(objs, probe, tangents, -eps)) / (2 * eps)
        seen["rel_err"] = float((tangent - fd).abs().max() / fd.abs().max())
        seen["k"] = kl.quadratic_form(objs.model, probe, tangents)
        mask = probe["loss_mask"].bool()
        seen["k_fd"] = float(kl_control.fisher_quadratic(
            logits[mask], fd[mask], temperature=0.8, vocab_size=arch.vocab_size).mean())
        seen["dense"] = {n: t.clone() for n, t in tangents.dense.items()}
        seen["low_rank"] = {id(s): -t.coefficient * (t.d @ t.projection)
                            for s, t in zip(objs.optimizer.sketches.slots,
                                            tangents.low_rank.values())} if name != "adam" else {}
        return alpha

    ok, _, got_alpha = scaled_optimizer_step(objs.optimizer, objs.model, choose_alpha)
    assert ok and got_alpha == alpha
    assert seen["rel_err"] < 1e-3, seen
    assert seen["k"] > 0 and seen["k"] == pytest.approx(seen["k_fd"], rel=1e-3)
    # the capped probe (fewer rows, shorter) gives its kept positions' own K
    assert seen["k_capped"] == pytest.approx(seen["k_first9"], rel=1e-6)
    assert seen["k_capped"] != pytest.approx(seen["k"], rel=1e-3)
    # the applied update is alpha times the direction the tangent was taken along
    after = dict(module.named_parameters())
    for n, t in seen["dense"].items():
        torch.testing.assert_close(after[n].detach() - before[n], alpha * t, rtol=1e-4,
                                   atol=1e-7)
    if name != "adam":
        for slot, p in zip(objs.optimizer.sketches.slots, objs.optimizer.sketches.params):
            n = next(k for k, v in after.items() if v is p)
            torch.testing.assert_close(p.detach() - before[n], alpha * seen["low_rank"][id(slot)],
                                       rtol=1e-4, atol=1e-7)
    # realized KL(alpha) ~ alpha^2 K at this small step
    realized = kl.realized_kl(objs.model, probe)
    assert realized == pytest.approx(alpha ** 2 * seen["k"], rel=0.05), (realized, seen["k"])
    assert math.isfinite(realized)


def _fp32_copies(objs) -> dict[str, torch.Tensor]:
    """bf16 params: the fp32 tensor each stepped param is updated through, by param name:
    megatron's Float16 optimizer's main params (fp32 params such as the norms are their
    own), and LoGRA's fp32 masters of the sketched weights."""
    names = {id(p): n for n, p in unwrap(objs.model[0]).named_parameters()}
    dense = getattr(objs.optimizer, "dense", objs.optimizer)
    out = {}
    for sub in getattr(dense, "chained_optimizers", [dense] if dense is not None else []):
        for g16, g32 in zip(sub.float16_groups, sub.fp32_from_float16_groups):
            out.update((names[id(p)], m) for p, m in zip(g16, g32))
        out.update((names[id(p)], p) for group in sub.fp32_from_fp32_groups for p in group)
    if isinstance(objs.optimizer, LograOptimizer):
        out.update((names[id(p)], m) for p, m in zip(objs.optimizer.sketches.params,
                                                      objs.optimizer.masters))
    return out


@pytest.mark.parametrize("name", ["adam", "logra", "logra_adam"])
def test_bf16_step_is_scaled_on_the_fp32_copies(arch_dir, name):
    """bf16 params (megatron's Float16 optimizer; LoGRA with fp32 masters): the scaled step
    puts every fp32 copy at old + alpha (new - old), where new is megatron's and RowAdam's
    own unscaled step on a twin built from the same seed; the bf16 params are those copies
    rounded, they are the old ones while alpha is chosen, and the realized KL is alpha^2 K
    (bf16 rounding of the applied step adds a little)."""
    arch = load_arch(arch_dir)
    batch = _batch(arch.vocab_size)
    # steps well above bf16's resolution, so the bf16 model's own KL is alpha^2 K too
    logra = LograConfig(rank=8, targets=TARGETS, update_ratio=0.1,
                        update_factor_dtype="float32") if name == "logra" else None
    twin, objs = (_objects(arch, name, bf16=True, logra=logra) for _ in range(2))
    for o in (twin, objs):
        _step_then_grads(o, batch, arch.vocab_size)
    old = {n: t.detach().clone() for n, t in _fp32_copies(objs).items()}
    stepped = len(objs.optimizer.sketches) if name == "logra" else \
        len(list(unwrap(objs.model[0]).parameters()))  # the paper's: only sketched ones
    assert len(old) == stepped
    for n, t in _fp32_copies(twin).items():
        assert torch.equal(t, old[n]), n
    twin.optimizer.step()
    new = _fp32_copies(twin)
    params = dict(unwrap(objs.model[0]).named_parameters())
    params_old = {n: p.detach().clone() for n, p in params.items()}
    kl = PredictedKLStep(KLControlConfig(control="predicted"), temperature=0.8,
                         vocab_size=arch.vocab_size)
    seen, alpha = {}, 0.05

    def choose_alpha(tangents):
        seen["at_old"] = all(torch.equal(p, params_old[n]) for n, p in params.items())
        seen["k"] = kl.quadratic_form(objs.model, batch[0], tangents)
        return alpha

    ok, _, got_alpha = scaled_optimizer_step(objs.optimizer, objs.model, choose_alpha)
    assert ok and got_alpha == alpha and seen["at_old"]
    after = _fp32_copies(objs)
    assert any(params[n].dtype == torch.bfloat16 for n in after)
    for n, t in after.items():
        step = new[n] - old[n]
        assert step.abs().max() > 0, n
        torch.testing.assert_close(t - old[n], alpha * step, rtol=1e-4, atol=1e-7)
        assert torch.equal(params[n].detach(), t.to(params[n].dtype)), n
    realized = kl.realized_kl(objs.model, batch[0])
    assert seen["k"] > 0 and realized == pytest.approx(alpha ** 2 * seen["k"], rel=0.2)


def _kl_of_fp32_weights(arch, weights: list[dict[str, torch.Tensor]], probe) -> float:
    """Mean KL(first || second) on the probe's response tokens of an fp32 model holding
    each of two full weight sets in turn (by param name)."""
    twin = _objects(arch, "adam")
    params = dict(unwrap(twin.model[0]).named_parameters())
    logits = []
    for state in weights:
        with torch.no_grad():
            for n, t in state.items():
                params[n].copy_(t)
        logits.append(logits_with_tangent(twin.model, probe, None)[0][probe["loss_mask"].bool()])
    return float(kl_control.token_kl(*logits, temperature=0.8,
                                     vocab_size=arch.vocab_size).mean())


@pytest.mark.parametrize("name,lr,logra", [
    ("adam", 1e-6, None), ("logra", 0.0, LograConfig(rank=8, update_ratio=6e-5))])
def test_bf16_prediction_at_realistic_step_sizes(arch_dir, name, lr, logra):
    """bf16 params at the paper's step sizes (dense Adam lr 1e-6, LoGRA norm ratio 6e-5): the
    step is far below bf16's resolution, so the tangent must come from the fp32 copies.
    The predicted KL alpha^2 K matches the realized KL of the update those fp32 copies hold
    (within 20%; measured 0.01% and 0.08%). Taken from the bf16 params' own difference, as
    before this fix, Adam's K is 9x too small (only elements near zero cross half an ulp).
    The bf16 model's own per-update KL is not alpha^2 K at such steps: its elements move
    only when the fp32 copy has drifted half an ulp (lumpy), or, stochastically rounded, by
    whole ulps whose noise outweighs the step on a model this small (README)."""
    arch = load_arch(arch_dir)
    batch = _batch(arch.vocab_size)
    objs = _objects(arch, name, bf16=True, lr=lr, logra=logra)
    _step_then_grads(objs, batch, arch.vocab_size)
    params = dict(unwrap(objs.model[0]).named_parameters())

    def fp32_weights() -> dict[str, torch.Tensor]:
        state = {n: p.detach().float().clone() for n, p in params.items()}
        state.update((n, t.detach().clone()) for n, t in _fp32_copies(objs).items())
        return state

    old = fp32_weights()
    bf16_old = {n: p.detach().clone() for n, p in params.items()}
    kl = PredictedKLStep(KLControlConfig(control="predicted"), temperature=0.8,
                         vocab_size=arch.vocab_size)
    seen = {}

    def choose_alpha(tangents):
        seen["k"] = kl.quadratic_form(objs.model, batch[0], tangents)
        seen["alpha"] = kl_control.step_scale(seen["k"], 2e-4, 3.0)
        return seen["alpha"]

    ok, _, _ = scaled_optimizer_step(objs.optimizer, objs.model, choose_alpha)
    assert ok and seen["k"] > 0
    predicted = seen["alpha"] ** 2 * seen["k"]
    realized = _kl_of_fp32_weights(arch, [old, fp32_weights()], batch[0])
    assert realized == pytest.approx(predicted, rel=0.2), (realized, predicted)
    if name != "adam":
        return
    # Adam: the bf16 params' own difference (the tangent before this fix) predicts another KL
    bf16_new = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(bf16_old[n])
    diffs = {n: (bf16_new[n].float() - bf16_old[n].float()) / seen["alpha"] for n in params}
    k_bf16 = kl.quadratic_form(objs.model, batch[0], UpdateTangents(dense=diffs))
    assert not k_bf16 == pytest.approx(seen["k"], rel=0.5), (k_bf16, seen["k"])


def test_measure_mode_takes_the_plain_step_and_logs_its_kl(arch_dir):
    """--kl-control measure: the update goes in at alpha = 1, the weights a plain step
    gives, while its K (= its predicted KL at alpha 1) and realized KL are logged; the
    same budget under predicted control would have scaled it far down."""
    arch = load_arch(arch_dir)
    batch = _batch(arch.vocab_size)
    plain, measured = _objects(arch, "logra"), _objects(arch, "logra")
    for objs in (plain, measured):
        _step_then_grads(objs, batch, arch.vocab_size)
    plain.optimizer.step()
    kl = PredictedKLStep(KLControlConfig(control="measure", budget=1e-9, budget_final=1e-9),
                         temperature=0.8, vocab_size=arch.vocab_size)
    ok, _, record = kl.step(measured, 1, batch[0], None)
    assert ok and record["alpha"] == 1.0
    assert record["kl_pred"] == record["kl_quadratic"] > 0
    assert kl_control.step_scale(record["kl_quadratic"], 1e-9, 3.0) < 0.01
    assert record["kl_realized"] > 0 and math.isfinite(record["kl_realized"])
    for (name, p), q in zip(unwrap(plain.model[0]).named_parameters(),
                            unwrap(measured.model[0]).parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-7, msg=name)
