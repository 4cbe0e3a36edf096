"""TensorBoard and Weights & Biases: where the metrics go besides ``metrics.jsonl`` (rank 0).

Each sink gets every record ``MetricsLog`` writes, at the record's ``step`` (the update
index; 0 is the evaluation before training):

- numbers and booleans (as 0/1) go to both, under the record's own key;
- strings (``sync_transport``) go to W&B only (TensorBoard has scalars, not labels);
- lists (``eval_prompt_pass``, per-prompt pass rates) stay in metrics.jsonl only.

The resolved config goes to TensorBoard as text (``config``) and to W&B as the run's
config. Neither library is imported unless its flag is given. W&B never stops a run: a
service that cannot be reached at start-up turns the run into an offline one (synced later
with ``wandb sync``), and a logging call that fails later disables W&B with a warning.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import warnings
from pathlib import Path
from typing import Protocol

from megatron_logra.config import LoggingConfig, RunConfig
from megatron_logra.training.metrics import MetricsLog

INIT_TIMEOUT_S = 30.0
"""Seconds W&B may take to reach its service before the run goes offline
(WANDB_INIT_TIMEOUT overrides it)."""


class MetricSink(Protocol):
    def write(self, record: dict) -> None: ...

    def close(self) -> None: ...


def scalars(record: dict) -> dict[str, float]:
    """The record's numbers (booleans as 0/1), ``step`` left out."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float))}


class TensorBoardSink:
    def __init__(self, log_dir: str, config: dict, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard drops the events a run that died after its last
        # checkpoint wrote for the updates the resumed run writes again
        self.writer = SummaryWriter(log_dir, purge_step=resume_step + 1 if resume_step else None)
        if not resume_step:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1) + "\n```", 0)

    def write(self, record: dict) -> None:
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per output folder: its id is kept in ``OUTPUT_DIR/wandb_run_id``, so a
    resumed run continues the same W&B run."""

    def __init__(self, cfg: LoggingConfig, output_dir: str, config: dict):
        import wandb

        self.wandb, self.run = wandb, None
        id_file = Path(output_dir) / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        save_dir = Path(cfg.wandb_save_dir or output_dir)
        save_dir.mkdir(parents=True, exist_ok=True)
        kwargs = dict(project=cfg.wandb_project, name=cfg.wandb_exp_name or
                      Path(output_dir).resolve().name, dir=str(save_dir), config=config,
                      id=run_id, resume="allow")
        timeout = float(os.environ.get("WANDB_INIT_TIMEOUT", INIT_TIMEOUT_S))
        try:
            self.run = wandb.init(**kwargs, settings=wandb.Settings(init_timeout=timeout,
                                                                    console="off"))
        except Exception as exc:  # noqa: BLE001 - W&B must never stop training
            _warn(f"W&B could not start ({type(exc).__name__}: {str(exc)[:200]}); logging "
                  f"to an offline run in {save_dir}/wandb instead ('wandb sync' uploads it)")
            try:
                wandb.teardown()  # the failed run still holds its id in this process
                self.run = wandb.init(**kwargs, mode="offline",
                                      settings=wandb.Settings(console="off"))
            except Exception as exc2:  # noqa: BLE001
                _warn(f"W&B offline run failed too ({type(exc2).__name__}: {exc2}); "
                      f"continuing without W&B")
        if self.run is not None:
            id_file.write_text(run_id + "\n")

    def write(self, record: dict) -> None:
        if self.run is None:
            return
        values = {k: v for k, v in record.items()
                  if k != "step" and isinstance(v, (int, float, str))}
        try:
            self.run.log(values, step=record["step"])
        except Exception as exc:  # noqa: BLE001
            _warn(f"W&B logging failed ({type(exc).__name__}: {exc}); continuing without "
                  f"W&B (metrics.jsonl has every record)")
            self.run = None

    def close(self) -> None:
        """Finish the run and stop this process's W&B service (a later sink starts afresh,
        with the environment as it is then)."""
        try:
            if self.run is not None:
                self.run.finish()
            self.wandb.teardown()
        except Exception as exc:  # noqa: BLE001
            _warn(f"W&B finish failed ({type(exc).__name__}: {exc})")
        self.run = None


def _warn(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)
    print(f"warning: {message}", file=sys.stderr, flush=True)


def open_sinks(cfg: LoggingConfig, output_dir: str, config: dict,
               resume_step: int) -> list[MetricSink]:
    """The sinks the flags ask for (call on the logging rank only)."""
    sinks: list[MetricSink] = []
    if cfg.tensorboard_dir:
        sinks.append(TensorBoardSink(cfg.tensorboard_dir, config, resume_step))
    if cfg.wandb_project:
        sinks.append(WandbSink(cfg, output_dir, config))
    return sinks


def open_metrics_log(cfg: RunConfig, enabled: bool, resume_step: int) -> MetricsLog:
    """The run's ``MetricsLog`` (``enabled`` on the logging rank), with the sinks of its
    flags; the config they record is the resolved one, with every flag's source."""
    sinks = open_sinks(cfg.logging, cfg.output_dir, {**cfg.to_dict(), "flags": cfg.flag_sources},
                       resume_step) if enabled else []
    return MetricsLog(cfg.output_dir, enabled, resume_step, sinks=sinks)
