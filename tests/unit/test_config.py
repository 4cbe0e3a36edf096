"""The configs check themselves: one built in code is refused as the CLI refuses its flags.

Each frozen config's ``__post_init__`` checks its fields' declared ranges and choices
(``flags.check_fields``) and its own rules; ``RunConfig`` checks the rules across configs
(and ``check_world_size`` those that need the world size). So a config a test or a
benchmark builds directly fails with the very message ``parse_run_config`` gives for the
same flags. A config field is named as its flag (less the config's ``FLAG_PREFIX``); the
few flags named otherwise are listed here on purpose. Config modules import no torch.
"""

import subprocess
import sys

import pytest

from megatron_logra.cli import ConfigError, build_parser, parse_run_config
from megatron_logra.config import (CheckpointConfig, DataConfig, LoggingConfig, ModelSource,
                                   OptimizerConfig, RunConfig, TrainingConfig)
from megatron_logra.flags import FlagError, flag_name
from megatron_logra.kl.config import KLControlConfig
from megatron_logra.logra.config import LograConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.rl.config import PolicyObjective, RLConfig, VerifierConfig
from megatron_logra.rollout.config import EngineConfig
from megatron_logra.runtime.parallel import ParallelConfig
from megatron_logra.weight_sync.config import WeightSyncConfig


def _run(**slices) -> RunConfig:
    return RunConfig(model=ModelSource(model_dir="unused"), **slices)


def _rl_run(**slices) -> RunConfig:
    return _run(training=TrainingConfig(stage="rl", global_batch_size=32), **slices)


# (flags, the same settings built in code): both refused with one message
SAME_REFUSAL = [
    # a range declared on the field (flag_spec(minimum=...))
    (["--train-iters", "0"], lambda: TrainingConfig(train_iters=0)),
    (["--stage", "rl", "--weight-sync-anchor-interval", "-1"],
     lambda: WeightSyncConfig(anchor_interval=-1)),
    (["--peft", "lora", "--lora-rank", "0"], lambda: LoraConfig(rank=0)),
    (["--save-keep", "-1"], lambda: CheckpointConfig(save_keep=-1)),
    # a config's own rules
    (["--min-lr", "1", "--lr", "0.1"], lambda: OptimizerConfig(lr=0.1, min_lr=1.0)),
    (["--optimizer", "logra", "--logra-rank", "0"], lambda: LograConfig(rank=0)),
    (["--optimizer", "logra", "--logra-targets", "qkv,lm_head"],
     lambda: LograConfig(targets=("qkv", "lm_head"))),
    (["--peft", "lora", "--lora-targets", "qkv,embedding"],
     lambda: LoraConfig(targets=("qkv", "embedding"))),
    (["--peft", "lora", "--optimizer", "logra"],
     lambda: OptimizerConfig(name="logra", peft="lora")),
    (["--stage", "rl", "--kl-budget", "1e-5", "--kl-budget-final", "1e-4"],
     lambda: KLControlConfig(budget=1e-5, budget_final=1e-4)),
    (["--stage", "rl", "--temperature", "0"], lambda: RLConfig(temperature=0.0)),
    (["--stage", "rl", "--ppo-epochs", "2", "--kl-control", "predicted"],
     lambda: RLConfig(ppo_epochs=2, kl=KLControlConfig(control="predicted"))),
    (["--finetune"], lambda: CheckpointConfig(finetune=True)),
    (["--wandb-exp-name", "x"], lambda: LoggingConfig(wandb_exp_name="x")),
    (["--tensor-model-parallel-size", "0"], lambda: ParallelConfig(0, 1)),
    # rules across configs (RunConfig)
    (["--optimizer", "logra", "--logra-master-weights", "none"],
     lambda: _run(optimizer=OptimizerConfig(name="logra",
                                            logra=LograConfig(master_weights="none")))),
    (["--peft", "lora", "--transformer-impl", "transformer_engine"],
     lambda: _run(training=TrainingConfig(transformer_impl="transformer_engine"),
                  optimizer=OptimizerConfig(peft="lora"))),
    (["--stage", "rl", "--weight-sync", "sketch-delta"],
     lambda: _rl_run(rl=RLConfig(weight_sync=WeightSyncConfig(transport="sketch-delta")))),
    (["--stage", "rl", "--kl-control", "predicted", "--use-distributed-optimizer",
      "--optimizer-cpu-offload"],
     lambda: _rl_run(rl=RLConfig(kl=KLControlConfig(control="predicted")),
                     optimizer=OptimizerConfig(use_distributed_optimizer=True,
                                               optimizer_cpu_offload=True))),
    (["--stage", "rl", "--max-new-tokens", "300", "--seq-length", "256"],
     lambda: _rl_run(rl=RLConfig(max_new_tokens=300))),
    (["--task", "math"], lambda: _run(data=DataConfig(tasks=(("math", 1.0),)))),
]


@pytest.mark.parametrize("argv,build", SAME_REFUSAL)
def test_a_config_built_in_code_is_refused_as_the_cli_refuses_it(argv, build):
    with pytest.raises(ConfigError) as cli:
        parse_run_config(argv, world_size=1)
    with pytest.raises(ValueError) as code:
        build()
    assert str(code.value) == str(cli.value)


def test_world_size_rules_are_the_run_configs():
    argv = ["--global-batch-size", "4", "--micro-batch-size", "1"]
    with pytest.raises(ConfigError) as cli:
        parse_run_config(argv, world_size=8)
    cfg = _run(training=TrainingConfig(global_batch_size=4))
    cfg.check_world_size(4)
    with pytest.raises(ValueError) as code:
        cfg.check_world_size(8)
    assert str(code.value) == str(cli.value)
    rl = _rl_run(rl=RLConfig(prompts_per_step=4, responses_per_prompt=2, ppo_minibatches=8))
    rl.check_world_size(1)
    with pytest.raises(ValueError, match="--ppo-minibatches 8 must split"):
        rl.check_world_size(2)


def test_choices_are_refused_in_code_as_argparse_refuses_them(capsys):
    """A Literal or enum field outside its choices: argparse refuses the flag (exit 2), the
    config refuses the value, naming the flag and the choices."""
    for argv, build, message in (
            (["--logra-projection", "uniform"], lambda: LograConfig(projection="uniform"),
             "--logra-projection 'uniform': choose from rademacher, gaussian"),
            (["--kl-control", "yes"], lambda: KLControlConfig(control="yes"),
             "--kl-control 'yes': choose from none, predicted, measure"),
            (["--weight-sync", "rsync"], lambda: WeightSyncConfig(transport="rsync"),
             "--weight-sync 'rsync': choose from full, sparse-delta, sketch-delta, "
             "lora-adapter")):
        with pytest.raises(SystemExit):
            parse_run_config(argv, world_size=1)
        assert f"argument {argv[0]}: invalid" in capsys.readouterr().err
        with pytest.raises(FlagError) as err:
            build()
        assert str(err.value) == message


def test_zero_is_the_command_lines_none():
    """--tis-cap 0 is off (None); in code None says it, and 0 is refused."""
    cfg = parse_run_config(["--stage", "rl", "--tis-cap", "0"], world_size=1)
    assert cfg.rl.objective.tis_cap is None
    assert PolicyObjective(tis_cap=None).tis_cap is None
    with pytest.raises(FlagError, match="--tis-cap: 0 is how the command line says None"):
        PolicyObjective(tis_cap=0)


def test_a_field_is_named_as_its_flag():
    """Flag -> field -> use is one name: a field's flag is --{FLAG_PREFIX}{field}, and a
    nested config's field is named as its flags begin (rl.kl: --kl-*, rl.weight_sync:
    --weight-sync-*, rl.rollout: --rollout-*, rl.verifier: --verifier-*, optimizer.logra:
    --logra-*, optimizer.lora: --lora-*), or, for the two slices whose flags share no
    beginning, as the part of the stage that takes them (rl.objective: the loss's --tis-cap,
    --clip-ratio-*, --importance-ratio-level, --loss-agg-mode; rl.staleness:
    --async-rollouts and its bounds). The flags named otherwise, on purpose: --optimizer
    (OptimizerConfig.name), --task (the parsed DataConfig.tasks), --weight-sync
    (WeightSyncConfig.transport, the transport it picks), --sync-bucket-mb
    (WeightSyncConfig.bucket_mb), --reward (VerifierConfig.reward), --dry-run
    (DryRunConfig.enabled, the switch its --dry-run-* flags belong to)."""
    import dataclasses

    from megatron_logra.cli import FLAG_GROUPS

    renamed = {}
    for cls, _ in FLAG_GROUPS:
        prefix = getattr(cls, "FLAG_PREFIX", "")
        for f in dataclasses.fields(cls):
            flag = flag_name(cls, f.name)
            if flag != f"--{prefix}{f.name}".replace("_", "-"):
                renamed[flag] = f"{cls.__name__}.{f.name}"
    assert renamed == {"--optimizer": "OptimizerConfig.name", "--task": "DataConfig.tasks",
                       "--weight-sync": "WeightSyncConfig.transport",
                       "--sync-bucket-mb": "WeightSyncConfig.bucket_mb",
                       "--reward": "VerifierConfig.reward",
                       "--dry-run": "DryRunConfig.enabled"}
    assert {"kl", "weight_sync", "rollout", "verifier", "objective", "staleness"} <= {
        f.name for f in dataclasses.fields(RLConfig)}
    assert (KLControlConfig.FLAG_PREFIX, WeightSyncConfig.FLAG_PREFIX, LograConfig.FLAG_PREFIX,
            LoraConfig.FLAG_PREFIX, EngineConfig.FLAG_PREFIX, VerifierConfig.FLAG_PREFIX) == (
                "kl-", "weight-sync-", "logra-", "lora-", "rollout-", "verifier-")
    flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert {"--kl-control", "--kl-budget", "--kl-budget-final", "--weight-sync",
            "--verifier-timeout"} <= flags
    cfg = parse_run_config(["--stage", "rl", "--kl-budget", "3e-4", "--kl-budget-final", "1e-5",
                            "--verifier-timeout", "5", "--weight-sync", "sparse-delta"],
                           world_size=1).rl
    assert (cfg.kl.budget, cfg.kl.budget_final, cfg.verifier.timeout,
            cfg.weight_sync.transport) == (3e-4, 1e-5, 5.0, "sparse-delta")


def test_config_modules_import_no_torch():
    code = ("import sys; import megatron_logra.config, megatron_logra.cli; "
            "assert not {'torch', 'megatron'} & set(sys.modules), "
            "sorted({'torch', 'megatron'} & set(sys.modules))")
    subprocess.run([sys.executable, "-c", code], check=True)
