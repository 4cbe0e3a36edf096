"""``--config FILE.yaml``: every flag from a YAML file, the command line on top, each
value's source recorded; bad files refused with the file, the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_logra.cli import ConfigError, parse_run_config


def _yaml(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_file_then_command_line_with_sources(tmp_path):
    _yaml(tmp_path / "base.yaml", "stage: rl\nlr: 1.0e-5\nbf16: true\n"
                                  "logra-targets: [qkv, proj]\nuse_distributed_optimizer: true\n")
    child = _yaml(tmp_path / "child.yaml", "defaults: base.yaml\n--optimizer: logra\n"
                                           "prompts-per-step: 4\nlr: 3.0e-5\n")
    cfg = parse_run_config(["--config", str(child), "--lr", "2e-5", "--logra-rank", "8",
                            "--no-logra-norm-restoration"], world_size=1)
    # the child overrides its base, the command line overrides both
    assert cfg.optimizer.lr == 2e-5 and cfg.optimizer.name == "logra"
    assert cfg.optimizer.logra.targets == ("qkv", "proj") and cfg.training.bf16
    assert cfg.optimizer.use_distributed_optimizer and cfg.rl.prompts_per_step == 4
    assert cfg.optimizer.logra.rank == 8 and not cfg.optimizer.logra.norm_restoration
    src = {flag: v["source"] for flag, v in cfg.flag_sources.items()}
    assert src["--lr"] == src["--logra-rank"] == src["--config"] == "command line"
    assert src["--optimizer"] == src["--prompts-per-step"] == str(child)
    assert src["--bf16"] == src["--logra-targets"] == str(tmp_path / "base.yaml")
    assert src["--seed"] == "default" and cfg.flag_sources["--seed"]["value"] == 1234
    assert cfg.flag_sources["--logra-targets"]["value"] == ["qkv", "proj"]


def test_same_config_from_file_or_flags(tmp_path):
    flags = ["--stage", "rl", "--optimizer", "logra", "--logra-rank", "16", "--bf16",
             "--kl-control", "predicted", "--kl-budget", "1e-3", "--kl-budget-final", "1e-4",
             "--task", "gcd:2,basic_arithmetic"]
    recipe = _yaml(tmp_path / "r.yaml", "stage: rl\noptimizer: logra\nlogra-rank: 16\n"
                   "bf16: true\nkl-control: predicted\nkl-budget: 1e-3\nkl-budget-final: 1e-4\n"
                   "task: gcd:2,basic_arithmetic\n")
    from_flags = parse_run_config(flags, world_size=1)
    from_file = parse_run_config(["--config", str(recipe)], world_size=1)
    assert from_file.to_dict() == from_flags.to_dict()


@pytest.mark.parametrize("text, message", [
    ("optimiser: logra\n", "unknown key 'optimiser'; did you mean optimizer?"),
    ("logra-rnak: 8\n", "did you mean logra-rank or"),
    ("lr: abc\n", "argument --lr: invalid float value: 'abc'"),
    ("optimizer: sgd\n", "argument --optimizer: invalid choice: 'sgd'"),
    ("bf16: 1\n", "bf16 is a switch: give true or false"),
    ("lr:\n", "lr has no value; leave the key out for the default"),
    ("lr: {a: 1}\n", "lr takes a single value, not a mapping"),
    ("config: other.yaml\n", "'config' cannot be set inside a config file"),
    ("- lr\n- 1\n", "expected a mapping of flag names to values"),
    ("lr: [1\n", "not valid YAML"),
    ("defaults: missing.yaml\n", "missing.yaml: file not found (named by 'defaults' in"),
    ("defaults: bad.yaml\n", "'defaults' chain loops back to itself"),
])
def test_bad_files_are_refused(tmp_path, text, message):
    path = _yaml(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as err:
        parse_run_config(["--config", str(path)], world_size=1)
    assert message in str(err.value) and "bad.yaml" in str(err.value)


def test_missing_file_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml: file not found"):
        parse_run_config(["--config", str(tmp_path / "nope.yaml")], world_size=1)
