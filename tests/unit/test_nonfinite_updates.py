"""Bad numbers skip the update: a non-finite loss, or finite loss with non-finite gradients
(dense Adam's grad buffers, LoGRA's sketches), leaves the weights, the optimizer state and
the learning-rate schedule exactly as they were; the next update trains normally; and
the run stops after --max-skipped-updates skips in a row, with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

from megatron_logra.cli import parse_run_config
from megatron_logra.training.step import (SkippedUpdates, SkippedUpdatesError, nll_loss,
                                          train_step)


class _NanGradient(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss with non-finite gradients."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _nan_loss(vocab, batch, logits):
    loss, tokens, report = nll_loss(vocab, batch, logits)
    return loss * float("nan"), tokens, report


def _nan_grads(vocab, batch, logits):
    return nll_loss(vocab, batch, _NanGradient.apply(logits))


def _state(objs) -> tuple:
    """Weights, optimizer state (Adam's, or LoGRA's step count and row second moments) and
    the schedule's step."""
    params = [p.detach().clone() for chunk in objs.model for p in chunk.parameters()]
    opt = objs.optimizer
    if hasattr(opt, "row_v"):
        state = (opt.steps, [v.clone() for v in opt.row_v])
    else:
        state = copy.deepcopy(opt.state_dict())
    return params, state, objs.scheduler.num_steps


def _same(a, b) -> bool:
    params_a, opt_a, steps_a = a
    params_b, opt_b, steps_b = b
    return (all(torch.equal(x, y) for x, y in zip(params_a, params_b)) and steps_a == steps_b
            and repr(opt_a) == repr(opt_b))  # repr: every tensor value printed in full


@pytest.mark.parametrize("optimizer", [[], ["--optimizer", "logra", "--logra-rank", "8"]])
@pytest.mark.parametrize("bad_loss", [_nan_loss, _nan_grads], ids=["loss", "grads"])
def test_a_non_finite_update_is_skipped(tmp_path, optimizer, bad_loss):
    from megatron_logra.training.prepare import prepare_training
    from megatron_logra.training.sft import build_sft_batches

    cfg = parse_run_config(["--train-iters", "10", "--global-batch-size", "2",
                            "--micro-batch-size", "1", "--seq-length", "96",
                            "--dataset-size", "8", "--output-dir", str(tmp_path), *optimizer],
                           world_size=1)
    prep = prepare_training(cfg)
    objs, batches = prep.objs, build_sft_batches(cfg, prep.tokenizer)
    step = dict(seq_length=batches.step_length(0), micro_batch_size=1)
    assert train_step(objs, batches.microbatches(0, 0, 1), **step).update_successful
    before = _state(objs)
    out = train_step(objs, batches.microbatches(1, 0, 1), loss_fn=lambda b, logits: bad_loss(
        objs.arch.vocab_size, b, logits), **step)
    assert not out.update_successful and out.grad_norm is None
    assert _same(before, _state(objs))
    out = train_step(objs, batches.microbatches(1, 0, 1), **step)  # a good one trains
    assert out.update_successful and not _same(before, _state(objs))


def test_the_run_stops_after_k_skips_in_a_row(capsys):
    guard = SkippedUpdates(3)
    for update, ok in enumerate([False, False, True, False, False], 1):
        guard.record(ok, update, announce=True)
    assert "update 5 skipped" in capsys.readouterr().out and guard.in_a_row == 2
    with pytest.raises(SkippedUpdatesError, match="3 updates in a row .up to update 6."):
        guard.record(False, 6, announce=False)
    SkippedUpdates(0).record(False, 1, announce=False)  # 0: never stops
