"""TensorBoard and W&B get every metric of metrics.jsonl at its update step, read back with
the libraries' own formats (``testing.log_readers``); a resumed run continues both; an
unreachable W&B service turns into an offline run and never stops training."""

from __future__ import annotations

import os

import pytest

from megatron_logra.cli import ConfigError, parse_run_config
from megatron_logra.config import LoggingConfig
from megatron_logra.testing.log_readers import (check_logs_match, tensorboard_scalars,
                                                tensorboard_text, wandb_run)
from megatron_logra.training.log_sinks import open_sinks
from megatron_logra.training.metrics import MetricsLog, read_metrics


def _record(step: int) -> dict:
    """A record with the RL loop's kinds of values: train, eval, KL control, sync, memory,
    timing; a string, a boolean, a list, a None (not logged), a NaN."""
    return {"step": step, "loss": 0.5 / (step + 1), "reward_mean": 0.1 * step, "tokens": 96 + step,
            "kl_pred": 1e-3 * (step + 1), "kl_realized": 9e-4, "alpha": 1.5,
            "eval_pass@1": 0.25 + 0.01 * step, "eval_prompt_pass": [0.0, 0.5, 1.0],
            "sync_bytes": 123456789 * (step + 1), "sync_transport": "full",
            "peak_mem_bytes": 2**31 + step, "step_time_s": 1.25, "grad_norm": None,
            "update_successful": step != 2, "logprob_mismatch": float("nan") if step == 1
            else 1e-7}


def _log(tmp_path, steps, resume_step=0):
    cfg = LoggingConfig(tensorboard_dir=str(tmp_path / "tb"), wandb_project="test")
    with MetricsLog(tmp_path, True, resume_step, sinks=open_sinks(
            cfg, str(tmp_path), {"lr": 1e-5, "flags": {"--lr": {"source": "x.yaml"}}},
            resume_step)) as log:
        for step in steps:
            log.write(_record(step))


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")


def test_every_metric_reaches_both(tmp_path):
    _log(tmp_path, range(4))
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    # 12 numbers per record to TensorBoard, and the string too to W&B
    assert check_logs_match(metrics, tmp_path / "tb", tmp_path) == 4 * 12 + 4 * 13
    assert tensorboard_scalars(tmp_path / "tb")["update_successful"] == {0: 1, 1: 1, 2: 0, 3: 1}
    config, history = wandb_run(tmp_path)
    assert config["lr"] == 1e-5 and config["flags"]["--lr"]["source"] == "x.yaml"
    assert [row["sync_transport"] for row in history] == ["full"] * 4
    assert '"lr": 1e-05' in tensorboard_text(tmp_path / "tb", "config")


def test_resumed_run_continues_both(tmp_path):
    _log(tmp_path, range(5))  # checkpointed at 2, died after 4
    _log(tmp_path, range(3, 6), resume_step=2)  # resumed: 3, 4 again, then 5
    metrics = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in metrics] == list(range(6))
    # TensorBoard purges the dead run's 3 and 4; W&B continues the same run id
    check_logs_match(metrics, tmp_path / "tb", tmp_path)
    run_ids = {p.name.split("-")[3] for p in (tmp_path / "wandb").glob("offline-run-*")}
    assert run_ids == {(tmp_path / "wandb_run_id").read_text().strip()}  # offline-run-T-ID


def test_unreachable_wandb_goes_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "3")
    cfg = LoggingConfig(wandb_project="test")
    with pytest.warns(RuntimeWarning, match="W&B could not start"):
        sinks = open_sinks(cfg, str(tmp_path), {"lr": 1e-5}, 0)
    with MetricsLog(tmp_path, True, sinks=sinks) as log:
        for step in range(2):
            log.write(_record(step))
    check_logs_match(read_metrics(tmp_path / "metrics.jsonl"), None, tmp_path)


def test_flags_and_refusals(tmp_path):
    cfg = parse_run_config(["--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "p",
                            "--wandb-exp-name", "n", "--wandb-save-dir", str(tmp_path)],
                           world_size=1)
    assert cfg.logging == LoggingConfig(str(tmp_path / "tb"), "p", "n", str(tmp_path))
    with pytest.raises(ConfigError, match="need --wandb-project"):
        parse_run_config(["--wandb-exp-name", "n"], world_size=1)
    assert parse_run_config([], world_size=1).logging == LoggingConfig()
    assert not os.path.exists(tmp_path / "tb")  # parsing writes nothing


def test_megatron_does_not_import_wandb():
    """megatron-core imports wandb (0.5 s) at import when installed; the entry points keep
    it out of megatron's imports only: the user's own ``import wandb`` still works. Importing
    the package alone installs no hook."""
    import subprocess
    import sys

    code = ("import sys, megatron_logra\n"
            "from megatron_logra.runtime.lazy_wandb import _NoWandbForMegatron, "
            "keep_out_of_megatron\n"
            "assert not any(isinstance(f, _NoWandbForMegatron) for f in sys.meta_path)\n"
            "keep_out_of_megatron()\n"  # what the entry points do first
            "import megatron_logra.training.sft, megatron.core.timers as t\n"
            "assert 'wandb' not in sys.modules and t.wandb is None\n"
            "import wandb\n"
            "assert wandb.__version__ == '0.31.0'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
