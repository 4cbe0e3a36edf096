"""The quality benchmark's report (benchmarks/quality_report.py) and replay check
(benchmarks/quality_replay.py) on run folders written here: the per-update budget check,
the cosine over whole-shadow updates only, paired differences against a hand computation
with the t bound, the one-seed wording, and the replay's comparison."""

from __future__ import annotations

import json
import math
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
import quality_replay  # noqa: E402
import quality_report as qr  # noqa: E402

sys.path.remove(str(REPO / "benchmarks"))

PASS_BEFORE = [0.0, 0.25, 0.5, 0.25]


def _write_run(folder: Path, *, gain: float, budget_miss_at: int | None = None,
               resumed_at: int | None = None, reward_shift: float = 0.0) -> Path:
    """A run of 8 updates with evaluations at 0 and 8, as quality.py's runs log them."""
    folder.mkdir(parents=True)
    rows = [{"step": 0, "eval_pass@1": statistics.fmean(PASS_BEFORE), "eval_pass@4": 0.5,
             "eval_prompt_pass": PASS_BEFORE}]
    for step in range(1, 9):
        history = step - resumed_at if resumed_at and step > resumed_at else step
        predicted = 0.02 if step == budget_miss_at else 0.01
        rows.append({"step": step, "reward_mean": 0.25 + 0.01 * step + reward_shift,
                     "response_len": 2.0, "logprob_mismatch": 0.05, "kl_budget": 0.01,
                     "kl_pred": predicted, "kl_realized": 0.011, "alpha": 0.5,
                     "kl_quadratic": 1.0, "adam_cosine": 1.0 if history == step else 0.3,
                     "adam_cosine_history": history})
    after = [p + gain for p in PASS_BEFORE]
    rows.append({"step": 8, "eval_pass@1": statistics.fmean(after), "eval_pass@4": 0.6,
                 "eval_prompt_pass": after})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"provenance": {"commit": "a" * 40,
                                                                   "clean": True}}))
    return folder


def test_a_run_reports_budget_misses_and_the_cosine_of_whole_shadow_updates(tmp_path):
    run = qr.summarize_run(_write_run(tmp_path / "logra-s1", gain=0.1, budget_miss_at=3,
                                      resumed_at=5), "logra", k=4)
    assert [m["update"] for m in run["budget_misses"]] == [3]
    assert run["budget_misses"][0]["predicted_over_budget"] == pytest.approx(2.0)
    # updates 6-8 ran after a resume with an empty shadow (cosine 0.3): left out
    assert [s for s, _ in run["adam_cosine"]] == [1, 2, 3, 4, 5]
    assert run["adam_cosine_mean"] == pytest.approx(1.0)
    assert run["gain_pass@1"] == pytest.approx(0.1)
    assert run["kl_realized_sum"] == pytest.approx(8 * 0.011)
    assert run["gain_pass@1_per_kl"] == pytest.approx(0.1 / (8 * 0.011))


def test_paired_differences_against_a_hand_computation(tmp_path):
    gains = {"dense": [0.10, 0.14, 0.12], "logra": [0.08, 0.09, 0.13], "lora": [0.2, 0.2, 0.2]}
    for method, per_seed in gains.items():
        for seed, g in enumerate(per_seed, start=1):
            _write_run(tmp_path / f"{method}-s{seed}", gain=g)
    summary = qr.summarize(tmp_path, {"eval_samples": 4, "updates": 8}, tuple(qr.LABELS), {})
    pairs = {(p["a"], p["b"]): p for p in summary["groups"]["comparison"]["pairs"]}
    diffs = [a - b for a, b in zip(gains["logra"], gains["dense"])]
    se = statistics.stdev(diffs) / math.sqrt(3)
    p = pairs[("logra", "dense")]
    assert p["mean"] == pytest.approx(statistics.fmean(diffs))
    assert p["se"] == pytest.approx(se)
    assert p["t95_bound"] == pytest.approx(4.303 * se)
    assert p["verdict"] == "within noise"
    assert pairs[("logra", "lora")]["verdict"] == "behind"  # -0.1 against a bound of 0.05
    account = qr.markdown_account(summary)
    assert "| LoRA r=16 |" in account and "LoGRA behind" in account
    assert "| dense Adam |" in account and "within noise" in account


def test_one_seed_calls_nothing(tmp_path):
    for method, g in (("dense", 0.1), ("logra", 0.05), ("lora", 0.2)):
        _write_run(tmp_path / f"{method}-s1", gain=g)
    summary = qr.summarize(tmp_path, {"eval_samples": 4, "updates": 8}, tuple(qr.LABELS), {})
    assert summary["groups"]["comparison"]["pairs"] == []
    assert qr.markdown(summary).startswith("One seed (1) so far")
    assert "one seed: no SE across seeds" in qr.markdown_account(summary)
    assert "quality.png" in qr.markdown(summary)
    assert qr.markdown_rank(summary).startswith("(no finished runs")  # and no figure link
    assert ".png" not in qr.markdown_rank(summary)


def test_the_replay_check_finds_a_changed_update(tmp_path):
    recorded = _write_run(tmp_path / "a" / "logra-s1", gain=0.1)
    same = _write_run(tmp_path / "b" / "logra-s1", gain=0.1)
    other = _write_run(tmp_path / "c" / "logra-s1", gain=0.1, reward_shift=0.01)
    assert quality_replay.compare(recorded, same, updates=4)["same"]
    changed = quality_replay.compare(recorded, other, updates=4)
    assert not changed["same"]
    assert changed["values"]["reward_mean"]["steps"] == [1, 2, 3, 4]
    assert changed["values"]["reward_mean"]["max_rel_diff"] == pytest.approx(0.01 / 0.26)
    assert changed["values"]["loss"]["max_rel_diff"] is None  # not logged: not compared
    assert changed["first_differing_step"] == 1
    assert quality_replay.compare(recorded, same, updates=4)["first_differing_step"] is None
    report = {"method": "logra", "seed": 1, "updates": 4, "recorded_commit": "a" * 40,
              "provenance": {"commit": "b" * 40, "load_avg": [3.1, 2.0, 1.5]}, **changed}
    verdict = quality_replay.markdown(report).splitlines()[0]
    assert "**not the same numbers** from update 1 on" in verdict
    assert "load average at the replay's start: [3.1, 2.0, 1.5]" in verdict
