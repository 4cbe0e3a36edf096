"""metrics.jsonl across a resume: records after the resumed checkpoint are dropped, since
the resumed run writes those updates again; a fresh run starts a new file."""

from __future__ import annotations

from megatron_logra.training.metrics import MetricsLog, read_metrics


def _write(out, steps, **kwargs):
    log = MetricsLog(out, enabled=True, **kwargs)
    for step in steps:
        log.write({"step": step, "loss": float(step)})


def test_resume_drops_records_after_the_checkpoint(tmp_path):
    _write(tmp_path, range(0, 6))  # a run that checkpointed at 3 and died after 5
    _write(tmp_path, range(4, 7), resume_step=3)  # resumed from 3: updates 4-6 again
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == list(range(7))


def test_fresh_run_starts_a_new_file(tmp_path):
    _write(tmp_path, range(0, 4))
    _write(tmp_path, range(1, 3))
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]


def test_disabled_rank_touches_nothing(tmp_path):
    _write(tmp_path, range(0, 3))
    MetricsLog(tmp_path, enabled=False, resume_step=1).write({"step": 9})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2]
