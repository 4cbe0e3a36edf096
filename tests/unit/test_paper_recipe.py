"""The paper's runs as commands: ``launch/paper_table1.sh`` and the dense baseline's schedule.

* Every Table 1 command (1.5B / 7B / 27B, dense / LoGRA) is accepted by the launcher's
  own checks at world size 8 on a model of that shape (config only), and resolves to the
  reference's settings.
* megatron's scheduler, advanced before each update (``training.step``), gives the
  reference's dense schedule exactly: warm-up (i + 1) / 9, then cosine to 0.1 x lr over
  300 updates (``research/logra/schedule.py`` of the reference, restated below).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from megatron_logra.cli import parse_run_config
from megatron_logra.config import OptimizerConfig
from megatron_logra.memory.shapes import PAPER_SHAPES, hf_config
from megatron_logra.training.build import build_scheduler

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "launch" / "paper_table1.sh"
def paper_shape(size: str) -> dict:
    """The HF config.json of the paper's ``size`` (``memory.shapes.PAPER_SHAPES``), its
    positions enough for the recipes' --seq-length 4096."""
    return hf_config(PAPER_SHAPES[size], max_position_embeddings=32768)


def _command(size: str, method: str, seed: int, model: Path) -> list[str]:
    out = subprocess.run(["bash", str(SCRIPT), size, method, str(seed), str(model)],
                         env=dict(os.environ, DRY_RUN="1"), capture_output=True, text=True,
                         check=True).stdout
    argv = shlex.split(out)
    assert argv[:4] == ["torchrun", "--nproc-per-node", "8", "launch/pretrain_rl.py"]
    return argv[4:]


@pytest.mark.parametrize("size", list(PAPER_SHAPES))
@pytest.mark.parametrize("method", ["dense", "logra"])
def test_table1_commands_pass_the_launchers_checks(tmp_path, size, method):
    model = tmp_path / size
    model.mkdir()
    (model / "config.json").write_text(json.dumps(paper_shape(size)))
    argv = _command(size, method, 42, model)
    i = argv.index("--load")
    argv[i:i + 2] = ["--model-dir", str(model)]  # a shape without weights: check the flags
    cfg = parse_run_config(argv, world_size=8)
    rl, opt = cfg.rl, cfg.optimizer
    assert cfg.parallel.data_parallel_size(8) * cfg.parallel.tensor_model_parallel_size * \
        cfg.parallel.pipeline_model_parallel_size == 8
    assert (rl.algorithm, rl.prompts_per_step, rl.responses_per_prompt) == ("reinforce", 128, 1)
    assert (rl.failure_reward, rl.baseline_decay, rl.objective.tis_cap, rl.temperature) == (
        -0.01, 0.9, 2.0, 1.0)
    assert (rl.eval_interval, rl.eval_samples, rl.eval_temperature, rl.eval_top_p) == (
        5, 4, 0.7, 0.7)
    assert cfg.training.seq_length == 4096 and cfg.training.recompute_activations
    assert cfg.training.seed == rl.rollout.seed == 42 and cfg.training.train_iters == 200
    if method == "dense":
        assert (opt.name, opt.lr, opt.adam_beta2, opt.clip_grad, opt.lr_warmup_iters,
                opt.lr_decay_iters, opt.min_lr) == ("adam", 1e-6, 0.95, 0.0, 9, 300, 1e-7)
        assert rl.kl.control == "none"
    else:
        lg = opt.logra
        assert (lg.rank, lg.update_ratio, lg.untargeted, lg.norm_restoration) == (
            256, 6e-5, "frozen", True)
        assert (rl.kl.control, rl.kl.budget, rl.kl.budget_final, rl.kl.budget_steps) == (
            "predicted", 2e-4, 2e-5, 300)


def test_bad_arguments_are_refused():
    proc = subprocess.run(["bash", str(SCRIPT), "3B", "logra", "1", "/m"], capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "SIZE must be 1.5B, 7B or 27B" in proc.stderr
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert proc.returncode == 2 and "SIZE METHOD SEED MODEL_DIR" in proc.stderr


def reference_lr_factor(index: int, steps: int = 300, warmup: int = 9,
                        min_ratio: float = 0.1) -> float:
    """The reference's ControlledAdamScheduler factor at update ``index`` (0-based)."""
    if index < warmup:
        return (index + 1) / warmup
    progress = min((index - warmup + 1) / (steps - warmup), 1.0)
    return min_ratio + (1 - min_ratio) * (1 + math.cos(math.pi * progress)) / 2


class _Groups:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def test_dense_schedule_is_the_references():
    lr = 1e-6
    cfg = OptimizerConfig(lr=lr, min_lr=0.1 * lr, lr_warmup_iters=9, lr_decay_iters=300,
                          lr_decay_style="cosine")
    opt = _Groups()
    scheduler = build_scheduler(opt, cfg, train_iters=400)
    got = []
    for _ in range(310):
        scheduler.step(increment=1)  # as training.step.train_step does before each update
        got.append(opt.param_groups[0]["lr"])
    want = [lr * reference_lr_factor(i) for i in range(310)]
    assert got == pytest.approx(want, rel=1e-12, abs=0)
    assert got[0] == pytest.approx(lr / 9) and got[8] == pytest.approx(lr)
    assert got[299] == pytest.approx(0.1 * lr) and got[305] == pytest.approx(0.1 * lr)
