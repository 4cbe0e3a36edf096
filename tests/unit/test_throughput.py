"""Throughput figures (``training.throughput``) through the one loop (``run_stage``):
tokens/s in total and per trainer process over the update's wall time, written to
metrics.jsonl and TensorBoard, and shown on the progress line with the time split.
The counts and the split of a real RL update are checked in tests/distributed/
test_rl_loop.py and test_async_rollouts.py."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from megatron_logra.config import TrainingConfig
from megatron_logra.testing.log_readers import tensorboard_scalars
from megatron_logra.training.log_sinks import TensorBoardSink
from megatron_logra.training.metrics import MetricsLog, read_metrics
from megatron_logra.training.throughput import SPLIT, progress_parts, rates, split_keys
from megatron_logra.training.trainer import run_stage


def test_rates_are_tokens_over_the_wall_time_per_process():
    record = {"step_time_s": 2.0, "generated_tokens": 300, "trained_tokens": 1000}
    assert rates(record, world_size=4) == {
        "generated_tokens_per_s": 150.0, "generated_tokens_per_s_per_gpu": 37.5,
        "trained_tokens_per_s": 500.0, "trained_tokens_per_s_per_gpu": 125.0}
    # SFT records count no generated tokens: only what the record has
    assert rates({"step_time_s": 1.0, "trained_tokens": 10}, 1) == {
        "trained_tokens_per_s": 10.0, "trained_tokens_per_s_per_gpu": 10.0}
    assert rates({"step_time_s": 1.0}, 2) == {}
    with pytest.raises(ValueError, match="world_size"):
        rates(record, 0)


def test_progress_parts_show_per_gpu_rates_and_the_split():
    record = {"generated_tokens_per_s_per_gpu": 37.5, "trained_tokens_per_s_per_gpu": 125.0,
              "time_generation_s": 1.234, "time_scoring_s": 0.1, "time_training_s": 3.0,
              "time_push_s": 0.25, "time_waiting_s": 0.0}
    assert progress_parts(record) == ["tok/s/gpu gen 37.5 train 125.0",
                                      "s: gen 1.23 score 0.10 train 3.00 push 0.25"]
    assert progress_parts({"loss": 1.0}) == []
    assert split_keys() == [f"time_{p}_s" for p in SPLIT]


class _Stage:
    """Each update sleeps its parts and reports them, as ``RLStage.step`` does."""

    def step(self, update: int) -> dict:
        record = {"update_successful": True, "generated_tokens": 40 + update,
                  "trained_tokens": 100 + update}
        for key in split_keys():
            t0 = time.perf_counter()
            time.sleep(0.01)
            record[key] = time.perf_counter() - t0
        return record

    def after(self, update: int, last: bool) -> dict:
        return {}


def test_the_loop_writes_the_rates_to_every_sink_and_the_progress_line(tmp_path, capsys):
    prep = SimpleNamespace(objs=SimpleNamespace(logra_stats=dict), start_step=0,
                           checkpoints=SimpleNamespace(save=lambda step, last: None))
    sink = TensorBoardSink(str(tmp_path / "tb"), {}, 0)
    with MetricsLog(tmp_path, True, sinks=[sink]) as log:
        run_stage(_Stage(), prep, TrainingConfig(train_iters=2), log)
    records = read_metrics(tmp_path / "metrics.jsonl")
    for update, r in enumerate(records):
        # one process: per GPU = in total; the wall time is the loop's own clock
        assert r["trained_tokens_per_s"] == pytest.approx((100 + update) / r["step_time_s"])
        assert r["generated_tokens_per_s_per_gpu"] == r["generated_tokens_per_s"]
        assert 0 <= r["step_time_s"] - sum(r[k] for k in split_keys()) < 0.01
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert scalars["trained_tokens_per_s_per_gpu"][2] == pytest.approx(
        records[1]["trained_tokens_per_s_per_gpu"])
    assert set(split_keys()) <= set(scalars)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and "tok/s/gpu gen " in lines[1] and "s: gen 0.01" in lines[1]
