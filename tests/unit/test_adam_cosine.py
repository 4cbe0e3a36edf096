"""``--log-adam-cosine`` (training/adam_cosine.py): the cosine between an update and dense
Adam's step from the same gradients.

- dense Adam without clipping: the shadow Adam, driven by gradients the hooks take from
  each layer's input and output gradient, reproduces megatron's Adam step exactly:
  cosine 1 over two steps of two microbatches each (momentum and bias correction);
- LoGRA: the logged cosine equals one computed by hand from the dense gradients of a
  dense Adam model built from the same seed on the same batch (Adam's first step is
  G / (|G| + eps));
- the hooks change nothing the run computes: the weights after two steps are bit-identical
  with and without them.
"""

from __future__ import annotations

import pytest
import torch

from megatron_logra.cli import parse_run_config
from megatron_logra.model.provider import unwrap
from megatron_logra.testing.batches import random_microbatches
from megatron_logra.training.adam_cosine import KINDS, AdamCosine
from megatron_logra.training.step import train_step

SEQ = 32


def _prepare(tmp_path, *extra):
    from megatron_logra.training.prepare import prepare_training

    cfg = parse_run_config(["--train-iters", "4", "--global-batch-size", "4",
                            "--micro-batch-size", "2", "--seq-length", str(SEQ),
                            "--clip-grad", "0", "--lr", "1e-3", "--lr-decay-style",
                            "constant", "--output-dir", str(tmp_path), *extra], world_size=1)
    return cfg, prepare_training(cfg).objs


def _steps(objs, probe: AdamCosine | None, count: int = 2) -> list[dict]:
    """``count`` steps of two microbatches each (the same batches for every caller)."""
    records = []
    for i in range(count):
        batches = random_microbatches(objs.arch.vocab_size, count=2, batch=2, seq=SEQ,
                                      seed=100 + i)

        def step(reports):
            probe.before_step()
            ok, grad_norm, _ = objs.optimizer.step()
            records.append(probe.after_step(ok))
            return ok, grad_norm

        if probe is not None:
            probe.begin()
        out = train_step(objs, batches, seq_length=SEQ, micro_batch_size=2,
                         optimizer_step=step if probe is not None else None)
        assert out.update_successful
    return records


def _probe(cfg, objs) -> AdamCosine:
    opt = cfg.optimizer
    return AdamCosine(objs.model, beta1=opt.adam_beta1, beta2=opt.adam_beta2,
                      eps=opt.adam_eps)


def _weights(objs) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in unwrap(objs.model[0]).named_parameters()}


def test_dense_adam_without_clipping_has_cosine_one(tmp_path):
    cfg, objs = _prepare(tmp_path)
    probe = _probe(cfg, objs)
    assert len(probe.modules) == 4 * objs.arch.num_layers
    records = _steps(objs, probe)
    for t, record in enumerate(records, start=1):
        assert record["adam_cosine_history"] == t
        for key in ("adam_cosine", *(f"adam_cosine_{k.removeprefix('linear_')}"
                                      for k in KINDS)):
            assert record[key] == pytest.approx(1.0, abs=1e-9), (t, key, record)


def test_the_hooks_change_nothing(tmp_path):
    _, plain = _prepare(tmp_path / "plain")
    _steps(plain, None)
    cfg, hooked = _prepare(tmp_path / "hooked")
    _steps(hooked, _probe(cfg, hooked))
    a, b = _weights(plain), _weights(hooked)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_logra_cosine_matches_a_dense_reference(tmp_path):
    # the dense gradients of the same weights on the same batch: a dense model, same seed
    _, dense = _prepare(tmp_path / "dense")
    start = _weights(dense)
    batches = random_microbatches(dense.arch.vocab_size, count=2, batch=2, seq=SEQ,
                                  seed=100)
    dense.optimizer.zero_grad()
    from megatron_logra.training.step import forward_backward

    forward_backward(dense.model, batches, seq_length=SEQ, micro_batch_size=2,
                     vocab_size=dense.arch.vocab_size)
    grads = {n: p.main_grad.detach().clone()
             for n, p in unwrap(dense.model[0]).named_parameters()
             if n.rsplit(".", 2)[-2] in KINDS}
    cfg, logra = _prepare(tmp_path / "logra", "--optimizer", "logra", "--logra-rank", "8")
    weights = _weights(logra)
    assert all(torch.equal(weights[n], start[n]) for n in grads)  # the same start
    record = _steps(logra, _probe(cfg, logra), count=1)[0]
    after = _weights(logra)
    eps = cfg.optimizer.adam_eps
    dot = aa = bb = 0.0
    for n, g in grads.items():
        u = g.double() / (g.double().abs() + eps)  # Adam's first step, bias-corrected
        delta = (after[n] - weights[n]).double()
        dot, aa, bb = dot - (delta * u).sum(), aa + delta.square().sum(), bb + u.square().sum()
    expected = float(dot / (aa * bb).sqrt())
    assert 0.0 < expected < 0.9  # a sketched step: aligned with Adam's, far from equal
    assert record["adam_cosine"] == pytest.approx(expected, abs=1e-6)
