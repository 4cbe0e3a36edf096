"""The results tables that show updates/h show tokens/s per GPU beside it (the field's
measure, NeMo-RL's tables): benchmarks/async_rollouts.py (measured: from the runs'
metrics.jsonl) and benchmarks/throughput_model.py (modelled), checked on reports built
here, no benchmark run."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_logra.memory.throughput_model import PAPER_LAYOUT, paper_inputs, update_time

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def benchmarks():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import async_rollouts
        import throughput_model
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    return async_rollouts, throughput_model


def _update(step_s: float, generated: int, trained: int, world: int) -> dict:
    """An RL update's record as the loop writes it (``training.throughput.rates``)."""
    return {"step_time_s": step_s, "rollout_time_s": 1.0, "train_time_s": 2.0,
            "sync_time_s": 0.5, "generated_tokens": generated, "trained_tokens": trained,
            "generated_tokens_per_s_per_gpu": generated / step_s / world,
            "trained_tokens_per_s_per_gpu": trained / step_s / world}


def test_async_rollouts_table_shows_tokens_per_gpu_beside_updates_per_hour(benchmarks):
    async_rollouts, _ = benchmarks
    # two updates of 4 s and 6 s on 2 processes: (400 + 600) / 10 s / 2 generated
    figures = async_rollouts.summarize([_update(4.0, 400, 1200, 2), _update(6.0, 600, 1800, 2)])
    assert figures["updates_per_h"] == pytest.approx(720.0)
    assert figures["generated_tokens_per_s_per_gpu"] == pytest.approx(50.0)
    assert figures["trained_tokens_per_s_per_gpu"] == pytest.approx(150.0)
    old = {k: v for k, v in _update(5.0, 1, 1, 1).items() if "per_gpu" not in k}
    report = {"variants": {"dedicated sync": figures,
                           "shared sync 1 engine": async_rollouts.summarize([old])},
              "ratios": {"dedicated": float("nan")}, "setup": "setup."}
    lines = async_rollouts.markdown(report).splitlines()
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    at = header.index("updates / h")
    assert header[at + 1] == "tokens/s/GPU generated / trained"
    row = [c.strip() for c in lines[2].strip("|").split("|")]
    assert row[at] == "**720**" and row[at + 1] == "50.0 / 150.0"
    older = [c.strip() for c in lines[3].strip("|").split("|")]
    assert older[at + 1] == "- / -"  # a run from before these figures


def test_throughput_model_rows_and_table_show_tokens_per_gpu(benchmarks):
    _, throughput_model = benchmarks
    inputs = paper_inputs("1.5B")
    timing = update_time(inputs, PAPER_LAYOUT)
    row = throughput_model.row(inputs, "1.5B", "paper's layout (calibration)", timing)
    w, lay = inputs.workload, PAPER_LAYOUT
    gpus = lay.train_gpus + (lay.generate_gpus if lay.placement == "dedicated" else 0)
    assert row["gpus"] == gpus
    assert row["generated_tokens_per_s_per_gpu"] == pytest.approx(
        w.prompts * w.responses_per_prompt * w.mean_response_tokens / timing.update_s / gpus)
    assert row["trained_tokens_per_s_per_gpu"] == pytest.approx(
        w.prompts * w.responses_per_prompt * (w.prompt_tokens + w.mean_response_tokens)
        / timing.update_s / gpus)
    entry = {"rows": [row], "inputs": {"efficiency": {"step_overhead_s": 0.01,
                                                      "train_mfu": 0.1}},
             "paper_rollout_s_without_tail": 1.0, "engines_on_4_gpus": [],
             "predicted_from_1p5b_updates_per_h": 1.0}
    report = {"settings": {"1.5B": entry, "7B": entry}, "sensitivity": [],
              "paper_updates_per_h": {"1.5B": {"dense_adam": 54.28, "logra": 55.44},
                                      "7B": {"dense_adam": 25.28, "logra": 25.73}}}
    lines = throughput_model.markdown(report).splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("| setting | mode"))
    header = [c.strip() for c in lines[head].strip("|").split("|")]
    at = header.index("updates/h")
    assert header[at + 1] == "tokens/s/GPU generated / trained"
    cells = [c.strip() for c in lines[head + 2].strip("|").split("|")]
    assert cells[at + 1] == (f"{row['generated_tokens_per_s_per_gpu']:.0f} / "
                             f"{row['trained_tokens_per_s_per_gpu']:.0f}")
