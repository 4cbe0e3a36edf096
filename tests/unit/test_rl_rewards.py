"""Verifier registry and scoring (real reasoning-gym and math-verify scorers, and scorers
that hang, crash, raise, flood, escape or return garbage), and the RL math (GRPO, running baseline, TIS, PG loss)
against hand-computed cases."""

import math

import pytest
import torch

from fake_scorers import misbehaving
from megatron_logra.rl import advantages as adv
from megatron_logra.data.tasks import PRESETS, resolve_tasks
from megatron_logra.data.tasks import TaskItem as RLItem
from megatron_logra.data.tasks import generate_items as generate_rl_items
from megatron_logra.rl.config import VerifierConfig
from megatron_logra.rl.verifiers import Verifier, extract_answer
from megatron_logra.runtime.sandbox import SandboxLimits


def test_task_specs_resolve_presets_weights_and_math():
    assert resolve_tasks("rg-hard") == tuple((n, 1.0) for n in PRESETS["rg-hard"])
    assert resolve_tasks("basic_arithmetic:2, math") == (("basic_arithmetic", 2.0), ("math", 1.0))
    with pytest.raises(ValueError, match=r"did you mean basic_arithmetic"):
        resolve_tasks("basic_arithmetik")
    with pytest.raises(ValueError, match="excluded: its scorer gives any non-empty answer"):
        resolve_tasks("game_of_life_halting")
    with pytest.raises(ValueError, match="must be > 0"):
        resolve_tasks("chain_sum:0")


def test_answer_extraction_takes_the_last_tag():
    assert extract_answer("think <answer>1</answer> no, <answer> 12 </answer>") == "12"
    assert extract_answer("  42 \n") == "42"


@pytest.fixture(scope="module")
def verifier():
    v = Verifier(VerifierConfig(timeout=20.0))
    yield v
    v.close()


def test_reasoning_gym_and_math_answers_are_scored_by_their_own_scorers(verifier):
    items = generate_rl_items((("basic_arithmetic", 1.0), ("math", 1.0)), 4, seed=3)
    assert [i.task for i in items] == ["basic_arithmetic"] * 2 + ["math"] * 2
    for item in items:
        right = verifier.score(item, f"<answer>{item.answer}</answer>")
        wrong = verifier.score(item, "<answer>-987654.25</answer>")
        assert (right.reward, right.status, wrong.reward) == (1.0, "ok", 0.0), item
    math_item = items[2]
    boxed = verifier.score(math_item, f"so the answer is $\\boxed{{{math_item.answer}}}$")
    assert boxed.reward == 1.0


def test_partial_credit_and_binary_threshold():
    item = RLItem("fake", "q", "a", 0, {})
    binary = Verifier(VerifierConfig(timeout=20.0), score_fn=misbehaving)
    partial = Verifier(VerifierConfig(reward="partial", timeout=20.0), score_fn=misbehaving)
    try:
        assert binary.score(item, "0.5").reward == 0.0
        assert binary.score(item, "1.0").reward == 1.0
        result = partial.score(item, "0.5")
        assert (result.reward, result.score) == (0.5, 0.5)
    finally:
        binary.close()
        partial.close()


def test_hanging_crashing_and_raising_scorers_cost_one_zero_reward_each():
    item = RLItem("fake", "q", "a", 7, {})
    v = Verifier(VerifierConfig(timeout=3.0), score_fn=misbehaving)
    try:
        assert v.score(item, "1.0").reward == 1.0  # also warms the child up
        hang = v.score(item, "hang")
        assert (hang.reward, hang.status) == (0.0, "timeout")
        assert v.score(item, "1.0").reward == 1.0  # a fresh child after the kill
        crash = v.score(item, "crash")
        assert crash.reward == 0.0 and "scorer process died" in crash.status
        raised = v.score(item, "raise")
        assert raised.reward == 0.0 and "ZeroDivisionError: scorer bug" in raised.status
        assert v.score(item, "1.0").reward == 1.0
        assert len(v.failures) == 3 and all("fake item 7" in f for f in v.failures)
    finally:
        v.close()


def test_scorers_that_flood_escape_or_return_garbage_cost_one_zero_reward_each(tmp_path):
    """The scoring process's sandbox: output capped (a flood fails that answer), no file
    written outside its scratch directory, memory capped, and only a finite number
    counts as a score; the process lives on (or is replaced) and scores the next one."""
    item = RLItem("fake", "q", "a", 3, {})
    outside = tmp_path / "escaped.txt"
    limits = SandboxLimits(memory_gib=2.0, file_mb=1.0)
    v = Verifier(VerifierConfig(timeout=20.0, limits=limits), score_fn=misbehaving)
    try:
        assert v.score(item, "1.0").reward == 1.0
        statuses = {answer: v.score(item, answer).status
                    for answer in ("flood", f"write:{outside}", "memory", "garbage", "nan")}
        assert "File too large" in statuses["flood"], statuses
        assert "may not write outside its scratch directory" in statuses[f"write:{outside}"]
        assert not outside.exists()
        assert "MemoryError" in statuses["memory"], statuses
        assert "not a finite number" in statuses["garbage"] and "'very good'" in \
            statuses["garbage"]
        assert "not a finite number" in statuses["nan"]
        assert v.score(item, "0.5").score == 0.5  # the same scoring process goes on
        assert len(v.failures) == 5
    finally:
        v.close()


def test_bad_verifier_settings_are_refused():
    with pytest.raises(ValueError, match="--reward 'soft': choose from binary, partial"):
        VerifierConfig(reward="soft")
    with pytest.raises(ValueError, match="--verifier-timeout 0: must be > 0 seconds"):
        VerifierConfig(timeout=0)


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    a = adv.grpo_advantages(rewards, eps=0.0 + 1e-12)
    assert torch.allclose(a[0], torch.tensor([1.0, -1.0, -1.0, 1.0]))  # mean .5, std .5
    assert torch.equal(a[1], torch.zeros(4))  # no signal in an all-equal group
    assert torch.allclose(adv.grpo_advantages(rewards, scale_by_std=False)[0],
                          torch.tensor([0.5, -0.5, -0.5, 0.5]))
    with pytest.raises(ValueError, match="prompts, responses per prompt"):
        adv.grpo_advantages(torch.ones(4))


def test_running_baseline_by_hand_and_its_state():
    """The reference's REINFORCE: outcomes 1 (reward >= 1) or the failure reward; the
    baseline starts at 0 and only past batches enter it (EMA weight 1 - decay)."""
    outcomes = adv.reinforce_outcomes(torch.tensor([1.0, 0.4, 0.0, 1.5]), -0.01)
    assert outcomes.tolist() == pytest.approx([1.0, -0.01, -0.01, 1.0])
    partial = torch.tensor([1.0, 0.4])
    assert adv.reinforce_outcomes(partial, None).tolist() == pytest.approx([1.0, 0.4])
    b = adv.RunningBaseline(decay=0.9)
    first = b.advantages(torch.tensor([1.0, -0.01]))
    assert first.tolist() == pytest.approx([1.0, -0.01])  # b = 0: the batch is not its own baseline
    assert b.value == pytest.approx(0.1 * 0.495)
    second = b.advantages(torch.tensor([1.0, 1.0]))
    assert second.tolist() == pytest.approx([1.0 - 0.0495, 1.0 - 0.0495])
    assert b.value == pytest.approx(0.9 * 0.0495 + 0.1 * 1.0)
    restored = adv.RunningBaseline()
    restored.load_state_dict(b.state_dict())
    assert restored == b
    old = adv.RunningBaseline()
    old.load_state_dict({"decay": 0.9, "value": None})  # a checkpoint of the earlier baseline
    assert old.value == 0.0


def test_truncated_importance_weights_and_loss_by_hand():
    """``rl.objective`` with one step per batch: w = min(pi_train / pi_rollout, cap), no
    gradient through it, and the loss -w A log pi over the generated tokens only."""
    from megatron_logra.rl.config import PolicyObjective
    from megatron_logra.rl.objective import objective_terms

    train = torch.tensor([[math.log(0.5), math.log(0.9)]], requires_grad=True)
    rollout = torch.tensor([[math.log(0.25), math.log(0.3)]])
    mask = torch.tensor([[1.0, 0.0]])
    terms = objective_terms(PolicyObjective(tis_cap=2.5), train, train.detach(), rollout,
                            torch.tensor([3.0]), mask)
    w = terms.weights
    assert torch.allclose(w, torch.tensor([[2.0, 2.5]]))  # 0.5/0.25 = 2; 0.9/0.3 = 3 -> cap
    assert not w.requires_grad
    assert float(terms.denominator) == 1
    # value -w A r with r = 1, gradient -w A d log pi
    assert torch.isclose(terms.numerator, torch.tensor(-3.0 * 2.0))
    terms.numerator.backward()
    assert torch.allclose(train.grad, torch.tensor([[-6.0, 0.0]]))  # masked token: no grad
    with pytest.raises(ValueError, match="--tis-cap must be >= 0"):
        PolicyObjective(tis_cap=-1.0)


def test_rollouts_become_aligned_microbatches():
    from megatron_logra.rl.policy_loss import RolloutSample, collate_rollouts

    s = RolloutSample(prompt_ids=[5, 6, 7], response_ids=[8, 9], rollout_logprobs=[-0.5, -1.5],
                      advantage=2.0)
    mb = collate_rollouts([s], seq_length=6, pad_id=0)
    assert mb["tokens"][0].tolist() == [5, 6, 7, 8, 0, 0]
    assert mb["labels"][0].tolist() == [6, 7, 8, 9, 0, 0]
    # the response tokens 8, 9 are the labels at positions 2 and 3
    assert mb["loss_mask"][0].tolist() == [0, 0, 1, 1, 0, 0]
    assert mb["rollout_logprobs"][0].tolist() == [0, 0, -0.5, -1.5, 0, 0]
    assert mb["advantages"].tolist() == [2.0]
    with pytest.raises(ValueError, match="exceeds --seq-length 3"):
        collate_rollouts([s], seq_length=3, pad_id=0)


def test_pass_at_k_and_prompt_order():
    from megatron_logra.data.sft import batch_indices
    from megatron_logra.rl.prompts_and_scores import pass_at, sample_seed

    p1, pk = pass_at([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 1.0]])
    assert (round(p1, 6), round(pk, 6)) == (round((0.25 + 0 + 0.75) / 3, 6), round(2 / 3, 6))
    # every item once per epoch, the same for the same (n, batch, step, seed)
    first_epoch = sum((batch_indices(10, 5, step, 3) for step in (0, 1)), [])
    assert sorted(first_epoch) == list(range(10))
    assert batch_indices(10, 5, 4, 3) == batch_indices(10, 5, 4, 3)
    assert len({sample_seed(0, u, p, g) for u in range(3) for p in range(8) for g in range(8)}) == 192


def test_gains_and_their_standard_errors_match_the_textbook_formulas():
    import statistics

    from megatron_logra.rl.prompts_and_scores import prompt_pass_rates
    from megatron_logra.rl.stats import mean_gain, paired_gain

    assert prompt_pass_rates([[1.0, 0.0, 0.5, 1.0], [0.0, 0.0]]) == [0.5, 0.0]
    before, after = [0.0, 0.25, 0.5, 0.5, 1.0], [0.25, 0.5, 0.5, 1.0, 1.0]
    diffs = [a - b for a, b in zip(after, before)]
    gain, se = paired_gain(before, after)
    assert gain == pytest.approx(statistics.mean(diffs))
    assert se == pytest.approx(statistics.stdev(diffs) / math.sqrt(5))
    # pairing: a uniform shift has zero spread, so any positive gain is many SEs
    assert paired_gain([0.1, 0.9], [0.2, 1.0]) == (pytest.approx(0.1), pytest.approx(0.0))
    first, last = [0.1, 0.2, 0.0], [0.5, 0.4, 0.6, 0.3]
    gain, se = mean_gain(first, last)
    assert gain == pytest.approx(statistics.mean(last) - statistics.mean(first))
    assert se == pytest.approx(math.sqrt(statistics.variance(first) / 3
                                         + statistics.variance(last) / 4))
    with pytest.raises(ValueError, match="same prompts"):
        paired_gain([0.1], [0.1, 0.2])
    with pytest.raises(ValueError, match="more updates"):
        mean_gain([0.1], [0.2, 0.3])


def test_learning_report_reads_gains_off_a_run():
    from megatron_logra.rl.learning_report import learning_report

    rewards = [0.1, 0.0, 0.2, 0.1, 0.2, 0.3, 0.4, 0.5]  # quarters: [0.1, 0.0] vs [0.4, 0.5]
    records = [{"step": 0, "eval_pass@1": 0.25, "eval_prompt_pass": [0.0, 0.5, 0.25, 0.25]}]
    records += [{"step": i + 1, "reward_mean": r} for i, r in enumerate(rewards)]
    records[-1].update({"eval_pass@1": 0.5, "eval_prompt_pass": [0.25, 0.75, 0.5, 0.5]})
    report = learning_report(records)
    assert report["train_reward"]["gain"] == pytest.approx(0.4)
    assert report["train_reward"]["se"] == pytest.approx(math.sqrt(0.005 / 2 + 0.005 / 2))
    assert report["eval_pass@1"]["gain"] == pytest.approx(0.25)
    assert report["eval_pass@1"]["se"] == pytest.approx(0.0)
    assert report["learned"]
    flat = records[:1] + [{"step": i + 1, "reward_mean": 0.1 + 0.1 * (i % 2)} for i in range(8)]
    flat[-1].update(records[-1])
    flat[-1]["reward_mean"] = 0.2
    assert not learning_report(flat)["learned"]  # pass@1 rose, but the reward did not
    with pytest.raises(ValueError, match="eval-interval"):
        learning_report(records[:-1])
