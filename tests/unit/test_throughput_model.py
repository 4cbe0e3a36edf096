"""The RL throughput model (``memory.throughput_model``, printed by
benchmarks/throughput_model.py): its arithmetic by hand on round numbers, the schedules'
forms, the replicas' roofline, the calibration against the paper, and every refusal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_logra.memory.throughput_model import (PAPER_LAYOUT, PAPER_UPDATES_PER_H,
                                                    Efficiency, Hardware, Inputs, Layout,
                                                    Workload, best, calibrate_step_overhead,
                                                    calibrate_train_mfu, decode_step_s,
                                                    dense_train_s_1p5b, engine_rollout_s,
                                                    kv_bytes_per_token,
                                                    kv_bytes_per_token_per_gpu, layouts,
                                                    matmul_params, min_train_gpus,
                                                    paper_inputs, rollout_s, train_s,
                                                    update_time)
from megatron_logra.model.arch import arch_from_hf_config
from megatron_logra.model.tiny_assets import tiny_hf_config

REPO = Path(__file__).resolve().parents[2]

# Round numbers: 1 layer, hidden 10, 2 heads of 5 (1 KV head), MLP 20, vocab 10, tied:
# matmul weights = 2*100 + 2*10*5 + 3*10*20 + 10*10 = 1000
TOY = arch_from_hf_config(tiny_hf_config("qwen2", hidden_size=10, num_layers=1, num_heads=2,
                                         num_kv_heads=1, intermediate_size=20, vocab_size=10))
TOY_HW = Hardware(memory_bytes=1e12, hbm_bytes_per_s=1e6, peak_flop_per_s=1e9,
                  hbm_efficiency=1.0, allreduce_s=0.0)
TOY_EFF = Efficiency(train_mfu=0.5, step_overhead_s=0.01, train_flop_factor=10.0,
                     prefill_mfu=1.0, push_bytes_per_s=1e5, colocated_push_bytes_per_s=1e4,
                     push_latency_s=0.1, switch_s=2.0)
TOY_WORK = Workload(prompts=4, responses_per_prompt=2, prompt_tokens=10.0,
                    mean_response_tokens=50.0, longest_response_tokens=100.0)


def _toy(**kw) -> Inputs:
    return Inputs(TOY, TOY_WORK, TOY_HW, replace(TOY_EFF, **kw), gpus=8)


def test_the_shapes_count_the_published_sizes():
    """Qwen2.5-Math-1.5B has 1.54B parameters, -7B 7.62B (their model cards)."""
    assert TOY.tie_word_embeddings and TOY.qkv_bias and matmul_params(TOY) == 1000
    small, big = paper_inputs("1.5B").model, paper_inputs("7B").model
    assert abs(small.num_parameters / 1.54e9 - 1) < 0.01
    assert abs(big.num_parameters / 7.62e9 - 1) < 0.01
    # 1.5B: 28 layers x 2 KV heads x 128 x (K, V) x 2 bytes
    assert kv_bytes_per_token(small) == 28 * 2 * 128 * 2 * 2
    assert kv_bytes_per_token_per_gpu(big, 4) == kv_bytes_per_token(big) / 4
    assert kv_bytes_per_token_per_gpu(small, 4) == kv_bytes_per_token(small) / 2  # replicated


def test_sync_update_by_hand():
    """Toy, sync, dedicated, 2 engines of TP1, trainer on 2 GPUs. Weights: 1000 matmul +
    (10 + 2*5 + 2*10) per layer + 10 final norm = 1050 params = 2100 B; KV 1*1*5*2*2 = 20 B
    per token. Each engine: 4 responses; live = 4 * 50 / 100 = 2 sequences of 10 + 25 = 35
    tokens: read 2100 + 2*35*20 = 3500 B -> 3.5 ms at 1e6 B/s; FLOP 2*1000*2 = 4000 ->
    4 us: the step is 10 + 3.5 ms, 100 steps = 1.35 s, plus prefill 2*1000*4*10 / 1e9 =
    80 us. Train: 10 * 1000 * 8 * (10 + 50) / (2 * 1e9 * 0.5) = 4.8 ms. Push: 0.1 s + 2 x
    2100 B / 1e5 B/s = 0.142 s."""
    inputs = _toy()
    assert TOY.num_parameters == 1050 and kv_bytes_per_token(TOY) == 20
    t = update_time(inputs, Layout("sync", "dedicated", replicas=2, engine_tp=1, train_gpus=2))
    assert t.rollout_s == pytest.approx(100 * (0.01 + 0.0035) + 80e-6)
    assert t.train_s == pytest.approx(4.8e-3)
    assert t.push_s == pytest.approx(0.142)
    assert t.update_s == pytest.approx(t.rollout_s + t.train_s + t.push_s)
    assert t.updates_per_h == pytest.approx(3600 / t.update_s)
    assert t.trainer_wait == pytest.approx(1 - (t.train_s + t.push_s) / t.update_s)
    assert t.engine_wait == pytest.approx(1 - (t.rollout_s + t.push_s) / t.update_s)
    # colocated: the same GPUs in turns, the slower push through host memory, the switch
    c = update_time(inputs, Layout("sync", "colocated", replicas=2, engine_tp=1, train_gpus=8))
    assert c.push_s == pytest.approx(0.1 + 2 * 2100 / 1e4)
    assert c.update_s == pytest.approx(c.rollout_s + c.train_s + c.push_s + 2.0)


def test_async_is_the_max_form_and_never_slower_than_sync():
    """On every dedicated layout of both paper settings (and the toy, where the trainer is
    the slow side once it is slowed down): async = max(rollout, train) + push, staged
    push max(rollout, train + push); both <= sync; the waits stay in [0, 1)."""
    cases = [paper_inputs("1.5B"), paper_inputs("7B"), _toy(train_mfu=1e-6)]
    for inputs in cases:
        for lay in layouts(inputs, "sync", "dedicated"):
            sync = update_time(inputs, lay)
            lazy = update_time(inputs, replace(lay, schedule="async"))
            staged = update_time(inputs, replace(lay, schedule="async", staged_push=True))
            r, t, p = sync.rollout_s, sync.train_s, sync.push_s
            assert lazy.update_s == pytest.approx(max(r, t) + p)
            assert staged.update_s == pytest.approx(max(r, t + p))
            assert staged.update_s <= lazy.update_s <= sync.update_s
            for x in (sync, lazy, staged):
                assert 0 <= x.trainer_wait < 1 and 0 <= x.engine_wait < 1
    slow_trainer = update_time(cases[2], Layout("async", "dedicated", 1, 1, 1))
    assert slow_trainer.train_s > slow_trainer.rollout_s and slow_trainer.trainer_wait == 0


def test_replicas_split_the_decode_as_the_roofline_says():
    """N replicas give each engine 1/N of the batch: where the step is compute-bound (big
    batch, no overhead) the rollout falls as 1/N; where the weights' read binds it does
    not fall at all; in general each engine's step is the roofline at its own batch."""
    compute = replace(_toy(step_overhead_s=0.0),
                      hardware=replace(TOY_HW, hbm_bytes_per_s=1e15, peak_flop_per_s=1e6),
                      workload=replace(TOY_WORK, prompts=64))  # FLOP-bound, 128 responses
    one = rollout_s(compute, 1, 1)
    for n in (2, 4, 8):
        assert rollout_s(compute, n, 1) == pytest.approx(one / n)
    weights = replace(compute, hardware=replace(TOY_HW, hbm_bytes_per_s=1e3),
                      workload=replace(compute.workload, prompt_tokens=1.0,
                                       mean_response_tokens=1.0))  # 2100 B of weights, ~no KV
    w1 = rollout_s(weights, 1, 1)
    assert rollout_s(weights, 4, 1) == pytest.approx(w1, rel=0.05)
    # the fullest engine counts: 8 responses over 3 engines -> 3 on the slowest
    inputs = _toy()
    assert rollout_s(inputs, 3, 1) == pytest.approx(engine_rollout_s(inputs, 1, 3))
    w = inputs.workload
    live = 3 * w.mean_response_tokens / w.longest_response_tokens
    step = decode_step_s(inputs, 1, live, w.prompt_tokens + w.mean_response_tokens / 2)
    assert engine_rollout_s(inputs, 1, 3) == pytest.approx(
        w.longest_response_tokens * step + 2 * 1000 * 3 * 10 / 1e9)


def test_tp_divides_the_reads_and_adds_all_reduces():
    inputs = replace(_toy(step_overhead_s=0.0), hardware=replace(TOY_HW, allreduce_s=1e-4))
    one = decode_step_s(inputs, 1, 0.0, 0.0)
    assert one == pytest.approx(2100 / 1e6)
    assert decode_step_s(inputs, 2, 0.0, 0.0) == pytest.approx(one / 2 + 2 * 1e-4)


@pytest.mark.parametrize("setting", ["1.5B", "7B"])
@pytest.mark.parametrize("fit", ["overhead", "trainer"])
def test_calibration_reproduces_the_papers_sync_figure(setting, fit):
    inputs = paper_inputs(setting, fit=fit)
    got = update_time(inputs, PAPER_LAYOUT).updates_per_h
    assert got == pytest.approx(PAPER_UPDATES_PER_H[setting]["dense_adam"], rel=0.01)
    assert 0 < inputs.efficiency.step_overhead_s < 0.1 and 0 < inputs.efficiency.train_mfu < 1


def test_calibration_pieces():
    """The 1.5B trainer time is LoGRA's cited 11.31 s plus the two runs' difference; the
    7B figure predicted from 1.5B's calibration alone lands within 10% of the paper's."""
    assert dense_train_s_1p5b() == pytest.approx(11.31 + 3600 / 54.28 - 3600 / 55.44)
    small = paper_inputs("1.5B")
    assert train_s(small, 4) == pytest.approx(dense_train_s_1p5b())
    assert paper_inputs("7B").efficiency.train_mfu == small.efficiency.train_mfu
    predicted = update_time(paper_inputs("7B", fit="none"), PAPER_LAYOUT).updates_per_h
    assert predicted == pytest.approx(25.28, rel=0.10)
    toy = calibrate_train_mfu(_toy(), 2, 1.0)
    assert train_s(toy, 2) == pytest.approx(1.0)
    lay = Layout("sync", "dedicated", 2, 1, 2)
    fitted = calibrate_step_overhead(_toy(), lay, 1000.0)
    assert update_time(fitted, lay).updates_per_h == pytest.approx(1000.0)


def test_best_is_the_fastest_layout_and_async_beats_sync():
    for setting in PAPER_UPDATES_PER_H:
        inputs = paper_inputs(setting)
        assert PAPER_LAYOUT in list(layouts(inputs, "sync", "dedicated"))
        for sched, place in (("sync", "dedicated"), ("sync", "colocated"),
                             ("async", "dedicated")):
            b = best(inputs, sched, place)
            every = [update_time(inputs, lay).update_s for lay in layouts(inputs, sched, place)]
            assert b.update_s <= min(every) + 0.1
        assert (best(inputs, "async", "dedicated").updates_per_h
                > best(inputs, "sync", "dedicated").updates_per_h
                >= PAPER_UPDATES_PER_H[setting]["dense_adam"] - 1e-9)
    assert min_train_gpus(paper_inputs("7B")) == 2  # 7.6e9 x 16 B over 80% of 80 GB


def test_refusals_name_the_setting_and_the_fix():
    with pytest.raises(ValueError, match=r"gpus=0: .*set gpus >= 1"):
        Inputs(TOY, TOY_WORK, gpus=0)
    with pytest.raises(ValueError, match="at least one response"):
        Inputs(TOY, replace(TOY_WORK, prompts=0))
    with pytest.raises(ValueError, match="mean_response_tokens=200.0 .*longest"):
        Inputs(TOY, replace(TOY_WORK, mean_response_tokens=200.0))
    inputs = paper_inputs("1.5B")
    cases = [
        (Layout("sync", "colocated", 4, 4, 8),
         r"replicas 4 x engine_tp 4 = 16 GPUs > the node's 8 \(colocated\): lower the "
         "replicas, the engine TP"),
        (Layout("sync", "dedicated", 4, 1, 6),
         r"train_gpus 6 \+ replicas 4 x engine_tp 1 = 10 GPUs > the node's 8 .*the "
         "trainer's GPUs"),
        (Layout("async", "colocated", 1, 1, 8), "use dedicated"),
        (Layout("sync", "dedicated", 1, 8, 4), "engine_tp=8 does not split .*12 attention"),
        (Layout("sync", "dedicated", 0, 1, 4), "replicas=0, .*must be >= 1"),
        (Layout("sync", "dedicated", 129, 1, 4), "replicas=129 > the 128 responses"),
        (Layout("sideways", "dedicated", 1, 1, 4), "schedule 'sideways': choose sync or async"),
        (Layout("sync", "remote", 1, 1, 4), "placement 'remote'"),
        (Layout("sync", "colocated", 1, 1, 9), "train_gpus=9 > the node's 8"),
    ]
    for lay, message in cases:
        with pytest.raises(ValueError, match=message):
            update_time(inputs, lay)
    with pytest.raises(ValueError, match=r"train_gpus=1: qwen2.5-7b's trainer state needs >= "
                                         r"2 GPUs \(give the trainer more\)"):
        update_time(paper_inputs("7B"), Layout("async", "dedicated", 1, 4, 1))
    with pytest.raises(ValueError, match="calibrate on a sync layout"):
        calibrate_step_overhead(inputs, replace(PAPER_LAYOUT, schedule="async"), 50.0)
    with pytest.raises(ValueError, match="faster than the model with no decode overhead"):
        calibrate_step_overhead(inputs, PAPER_LAYOUT, 1e6)
    with pytest.raises(ValueError, match="setting '3B': choose 1.5B or 7B"):
        paper_inputs("3B")


def test_the_benchmark_prints_the_table_rows_as_json():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/throughput_model.py")],
                          capture_output=True, text=True, timeout=120, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["benchmark"] == "throughput_model" and report["measured"] is False
    for setting, entry in report["settings"].items():
        rows = {r["mode"]: r for r in entry["rows"]}
        paper = PAPER_UPDATES_PER_H[setting]["dense_adam"]
        assert rows["paper's layout (calibration)"]["updates_per_h"] == pytest.approx(paper)
        assert rows["async, the paper's layout"]["updates_per_h"] > paper
        assert {"sync, N replicas, dedicated", "async, N replicas"} <= set(rows)
        assert rows["sync, N replicas, dedicated"]["replicas"] >= 2
        for r in entry["rows"]:
            assert r["train_gpus"] + (r["generate_gpus"] if r["placement"] == "dedicated"
                                      else 0) <= 8
