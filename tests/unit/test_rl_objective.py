"""The policy-loss switches of published recipes (``rl.objective``), each against a hand
computation: PPO ratio clipping with separate low/high bounds (DAPO's clip-higher), GSPO's
sequence ratio, the loss aggregations (token-mean, seq-mean-token-sum, seq-mean-token-mean,
Dr.GRPO's constant normaliser), the engine's truncated importance weights; DAPO's dynamic
sampling's group selection; and the command lines that combine them, accepted or refused."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_logra.cli import ConfigError, parse_run_config
from megatron_logra.rl import advantages as adv
from megatron_logra.rl import prompts_and_scores
from megatron_logra.rl.config import PolicyObjective, RLConfig
from megatron_logra.rl.objective import objective_terms

# two responses, four positions; response 0 has 3 generated tokens, response 1 has 2
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [0.0, -1.5, -0.7, 0.0]])
# current logprobs after some steps: ratios exp(logp - old) of 1.35, 0.70, 1.25 and 0.95, 1.10
LOGP = OLD + torch.tensor([[math.log(1.35), math.log(0.70), math.log(1.25), 0.0],
                           [0.0, math.log(0.95), math.log(1.10), 0.0]])
ROLLOUT = OLD + torch.tensor([[0.1, -0.9, 0.0, 0.0], [0.0, 0.2, -0.05, 0.0]])
ADV = torch.tensor([1.5, -0.8])
TOKENS = [(0, 0), (0, 1), (0, 2), (1, 1), (1, 2)]


def _run(obj: PolicyObjective, logp=LOGP, old=OLD, max_new_tokens=1):
    x = logp.clone().requires_grad_(True)
    terms = objective_terms(obj, x, old, ROLLOUT, ADV, MASK, max_new_tokens)
    (terms.numerator / terms.denominator).backward()
    return terms, x.grad


def _w(i, t, cap=2.0):
    return min(math.exp(OLD[i, t] - ROLLOUT[i, t]), cap)


def _r(i, t):
    return math.exp(LOGP[i, t] - OLD[i, t])


def _reinforce_loss_sum(logprobs, advantages, mask, weights):
    """The loss the trainer had before the switches: sum over generated tokens of
    -w A log pi (logprobs [B, T] with grad, advantages [B], mask and weights [B, T])."""
    return (-advantages[:, None] * logprobs * mask * weights).sum()


def test_one_step_is_reinforce_with_tis():
    """old = logp (one step per batch): value sum(-w A), gradient of -w A log pi, the
    REINFORCE/GRPO loss with truncated importance weights (``_reinforce_loss_sum``)."""
    terms, grad = _run(PolicyObjective(tis_cap=2.0), old=LOGP.detach())
    w = torch.exp(LOGP - ROLLOUT).clamp(max=2.0)
    x = LOGP.clone().requires_grad_(True)
    (_reinforce_loss_sum(x, ADV, MASK, w) / MASK.sum()).backward()
    assert torch.allclose(grad, x.grad, atol=1e-7)
    hand = sum(-ADV[i] * min(math.exp(LOGP[i, t] - ROLLOUT[i, t]), 2.0) for i, t in TOKENS)
    assert float(terms.numerator.detach()) == pytest.approx(float(hand), rel=1e-6)
    assert float(terms.denominator) == 5


@pytest.mark.parametrize("high", [0.2, 0.28])
def test_ppo_clipping_with_clip_higher(high):
    """Token ratios 1.35, 0.70, 1.25 (A = +1.5) and 0.95, 1.10 (A = -0.8), bounds
    [0.8, 1 + high]: 1.35 is clipped (no gradient), 1.25 only when high = 0.2; 0.70 with
    A > 0 is not (the unclipped term is the larger); A < 0 tokens stay inside."""
    terms, grad = _run(PolicyObjective(tis_cap=2.0, clip_ratio_low=0.2, clip_ratio_high=high))
    value, expected_grad, clipped = 0.0, torch.zeros_like(LOGP), set()
    for i, t in TOKENS:
        a, r = float(ADV[i]), _r(i, t)
        unclipped, bounded = -a * r, -a * min(max(r, 0.8), 1 + high)
        value += _w(i, t) * max(unclipped, bounded)
        if bounded > unclipped:
            clipped.add((i, t))
        else:
            expected_grad[i, t] = _w(i, t) * -a * r / 5  # d(-A r)/dlogp = -A r
    assert clipped == ({(0, 0), (0, 2)} if high == 0.2 else {(0, 0)})
    assert float(terms.numerator.detach()) == pytest.approx(value, rel=1e-6)
    assert {tuple(ix) for ix in terms.clipped.nonzero().tolist()} == clipped
    assert torch.allclose(grad, expected_grad, atol=1e-7)


def test_gspo_sequence_ratio_and_seq_mean_token_mean():
    """GSPO: s_i = exp(mean of i's log-ratios), one clipped term per response, the mean of
    its tokens' terms, averaged over responses; gradient -A s_i / n_i on each token (0 when
    clipped)."""
    obj = PolicyObjective(tis_cap=None, clip_ratio_low=0.05, clip_ratio_high=0.1,
                          importance_ratio_level="sequence", loss_agg_mode="seq-mean-token-mean")
    terms, grad = _run(obj)
    s0 = math.exp((math.log(1.35) + math.log(0.70) + math.log(1.25)) / 3)  # 1.0513: inside
    s1 = math.exp((math.log(0.95) + math.log(1.10)) / 2)  # 1.0223: inside
    l0 = max(-1.5 * s0, -1.5 * min(max(s0, 0.95), 1.1))
    l1 = max(0.8 * s1, 0.8 * min(max(s1, 0.95), 1.1))
    assert float(terms.numerator.detach()) == pytest.approx(l0 + l1, rel=1e-6)
    assert float(terms.denominator) == 2
    expected = torch.zeros_like(LOGP)
    expected[0, :3] = -1.5 * s0 / 3 / 2
    expected[1, 1:3] = 0.8 * s1 / 2 / 2
    assert torch.allclose(grad, expected, atol=1e-7)
    # a tighter bound clips response 0 (A > 0, s0 > 1 + 0.03): its tokens get no gradient
    terms, grad = _run(PolicyObjective(tis_cap=None, clip_ratio_low=0.03, clip_ratio_high=0.03,
                                       importance_ratio_level="sequence",
                                       loss_agg_mode="seq-mean-token-mean"))
    assert grad[0].abs().sum() == 0 and grad[1].abs().sum() > 0
    assert int(terms.clipped.sum()) == 3


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                  "seq-mean-token-sum-norm"])
def test_loss_aggregations(mode):
    terms, _ = _run(PolicyObjective(tis_cap=2.0, loss_agg_mode=mode), max_new_tokens=8)
    per_token = {(i, t): _w(i, t) * -float(ADV[i]) * _r(i, t) for i, t in TOKENS}
    seq_sum = [sum(v for (i, _), v in per_token.items() if i == k) for k in (0, 1)]
    expected = {"token-mean": (sum(per_token.values()), 5),
                "seq-mean-token-sum": (sum(seq_sum), 2),
                "seq-mean-token-mean": (seq_sum[0] / 3 + seq_sum[1] / 2, 2),
                "seq-mean-token-sum-norm": (sum(per_token.values()) / 8, 2)}[mode]
    assert float(terms.numerator.detach()) == pytest.approx(expected[0], rel=1e-6)
    assert float(terms.denominator) == expected[1]


def test_dr_grpo_advantages_are_not_scaled_by_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 0.0]])
    assert torch.equal(adv.grpo_advantages(rewards, scale_by_std=False),
                       torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.25, 0.25, 0.25, -0.75]]))


def test_dynamic_sampling_keeps_groups_with_signal_and_fills_the_rest():
    has_signal, fill_groups = prompts_and_scores.has_signal, prompts_and_scores.fill_groups
    assert has_signal([0.0, 1.0]) and not has_signal([1.0, 1.0, 1.0])
    kept, dropped = ["a", "b"], ["x", "y", "z"]
    assert fill_groups(kept, dropped, 4) == (["a", "b", "x", "y"], 2)
    assert fill_groups(kept + ["c", "d", "e"], dropped, 4) == (["a", "b", "c", "d"], 4)


def test_later_rounds_draw_their_own_prompts_and_seeds():
    prompts = [prompts_and_scores.Prompt(None, [k]) for k in range(50)]
    cfg = RLConfig(prompts_per_step=4, responses_per_prompt=2)  # --rollout-seed 0
    first, req0 = prompts_and_scores.step_requests(prompts, cfg, 3, 11)
    again, _ = prompts_and_scores.step_requests(prompts, cfg, 3, 11, 0)
    second, req1 = prompts_and_scores.step_requests(prompts, cfg, 3, 11, 1)
    assert first == again and first != second
    seeds = [r.seed for r in req0 + req1]
    assert len(set(seeds)) == len(seeds) == 16
    # round 0 is the update's batch as before the switches: seeds of prompts 0..P-1
    assert [r.seed for r in req0] == [prompts_and_scores.sample_seed(0, 3, i, j)
                                      for i in range(4) for j in range(2)]


RL = ["--stage", "rl", "--prompts-per-step", "8", "--responses-per-prompt", "4",
      "--micro-batch-size", "4"]


def test_recipe_flags_build_the_objective():
    cfg = parse_run_config([*RL, "--ppo-epochs", "2", "--ppo-minibatches", "2",
                            "--clip-ratio-low", "0.2", "--clip-ratio-high", "0.28",
                            "--importance-ratio-level", "sequence", "--loss-agg-mode",
                            "seq-mean-token-sum-norm", "--no-grpo-std-norm",
                            "--dynamic-sampling", "--dynamic-sampling-max-rounds", "4",
                            "--optimizer", "logra"], world_size=2)
    assert cfg.rl.steps_per_update == 4 and cfg.rl.dynamic_sampling_max_rounds == 4
    assert cfg.rl.objective == PolicyObjective(
        tis_cap=2.0, clip_ratio_low=0.2, clip_ratio_high=0.28, importance_ratio_level="sequence",
        loss_agg_mode="seq-mean-token-sum-norm")
    assert not cfg.rl.grpo_std_norm


@pytest.mark.parametrize("flags, message", [
    (["--ppo-epochs", "2", "--kl-control", "predicted"], "--kl-control predicted sizes the one"),
    (["--ppo-minibatches", "2", "--optimizer", "logra", "--bf16", "--rollout-dtype",
      "bfloat16", "--logra-master-weights", "none", "--weight-sync", "sketch-delta"],
     "sends one LoGRA step's factors per push"),
    (["--ppo-minibatches", "3"], "--ppo-minibatches 3 must split the rollout batch of 32"),
    (["--ppo-minibatches", "8"], "multiples of --micro-batch-size x data-parallel size = 8"),
    (["--clip-ratio-high", "0.28"], "--clip-ratio-high needs --clip-ratio-low"),
    (["--clip-ratio-low", "1.5"], "must be in (0, 1)"),
    (["--dynamic-sampling", "--algorithm", "reinforce"], "use them with --algorithm grpo"),
    (["--no-grpo-std-norm", "--algorithm", "reinforce"], "use them with --algorithm grpo"),
])
def test_bad_combinations_are_refused(flags, message):
    with pytest.raises(ConfigError) as err:
        parse_run_config([*RL, *flags], world_size=2)
    assert message in str(err.value)
