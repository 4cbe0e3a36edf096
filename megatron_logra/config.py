"""Typed, frozen run configuration: built once from the CLI (``megatron_logra.cli``).

Each component owns its config dataclass (``logra.config.LograConfig``,
``lora.config.LoraConfig``, ``rl.config.RLConfig``, ``kl.config.KLControlConfig``,
``weight_sync.config.WeightSyncConfig``, ``rollout.config.EngineConfig``,
``checkpoint.config.CheckpointConfig``, ``runtime.parallel.ParallelConfig``); this module
holds the trainer's own and composes them into ``RunConfig``. A field is its flag: its
default, its meaning (the string under it) and its checks build the command line
(``flags``). Each component receives only its own slice; nothing below the launcher
reads an argparse namespace. No torch, no megatron.

Where a rule lives (every refusal is a ValueError naming the flags and the fix):

- a rule on one config's own fields: that config's ``__post_init__``, which first calls
  ``flags.check_fields`` (each field's declared range and choices); so a config built in
  code (tests, benchmarks) is refused exactly as the same flags are;
- a rule across configs (bf16 for LoGRA's bf16-only weights, TE vs LoGRA/LoRA, KL
  control vs offload/TE, the RL stage vs the optimizer and the sequence length):
  ``RunConfig.__post_init__``; those that need the world size too (batches that split
  over data parallel): ``RunConfig.check_world_size``;
- a rule that needs the model's architecture (TP/PP vs heads and layers, LoGRA's qkv vs
  kv heads, --seq-length vs max_position_embeddings) or files (--model-dir, --load):
  ``cli.parse_run_config``, once it has read config.json (``ModelArch.check_parallel``,
  ``LograConfig.check_fits``);
- what depends on the machine (CUDA, Transformer Engine installed): where it is built
  (``training.build``, ``model.provider``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from megatron_logra.checkpoint.config import CheckpointConfig
from megatron_logra.dry_run.config import DryRunConfig
from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.kl.config import KLControlConfig  # noqa: F401 - the run's sub-configs
from megatron_logra.logra.config import LograConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.rl.config import RLConfig
from megatron_logra.runtime.parallel import ParallelConfig
from megatron_logra.weight_sync.contract import check_run

_POSITIVE = flag_spec(minimum=1)


@dataclass(frozen=True)
class ModelSource:
    model_dir: str = field(metadata=flag_spec(cli_default=None))
    """HF model folder (config.json + tokenizer); default: the --load HF folder if there is
    one, else the embedded tiny Llama."""
    tokenizer_model: str | None = None
    """A sentencepiece tokenizer.model overriding the folder's tokenizer."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class OptimizerConfig:
    name: Literal["adam", "logra"] = field(default="adam", metadata=flag_spec(flag="--optimizer"))
    """The update rule: megatron's Adam, or LoGRA (RowAdam on sketched weights)."""
    lr: float = field(default=1e-4, metadata=flag_spec(minimum=0))
    """Peak learning rate."""
    min_lr: float = field(default=0.0, metadata=flag_spec(minimum=0))
    """Final learning rate of the decay."""
    lr_warmup_iters: int = field(default=0, metadata=flag_spec(minimum=0))
    """Linear warm-up updates."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "cosine"
    """Decay after warm-up."""
    lr_decay_iters: int | None = None
    """Updates over which to decay (default: --train-iters)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    clip_grad: float = field(default=1.0, metadata=flag_spec(minimum=0))
    """Global grad-norm clip; 0 disables clipping (it never zeroes grads)."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state and fp32 master weights over data parallel."""
    optimizer_cpu_offload: bool = False
    """CUDA: keep Adam's state (a fraction of it, --optimizer-offload-fraction) and its
    update in host memory (megatron-core's HybridDeviceOptimizer), freeing GPU memory,
    e.g. for a colocated rollout engine."""
    optimizer_offload_fraction: float = field(default=1.0, metadata=flag_spec(minimum=0))
    """With --optimizer-cpu-offload: the fraction of Adam's state kept on the host."""
    peft: Literal["none", "lora"] = "none"
    """Parameter-efficient fine-tuning: lora trains low-rank adapters (--lora-*) on the
    frozen base with --optimizer adam."""
    logra: LograConfig = field(default_factory=LograConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_fields(self)
        if self.min_lr > self.lr:
            raise ValueError(f"need 0 <= --min-lr <= --lr, got --lr {self.lr} "
                             f"--min-lr {self.min_lr}")
        if not (0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1):
            raise ValueError("--adam-beta1/--adam-beta2 must lie in [0, 1)")
        if not 0 <= self.optimizer_offload_fraction <= 1:
            raise ValueError(f"--optimizer-offload-fraction {self.optimizer_offload_fraction} "
                             f"must lie in [0, 1]")
        if self.optimizer_cpu_offload and not self.use_distributed_optimizer:
            raise ValueError("--optimizer-cpu-offload needs --use-distributed-optimizer "
                             "(megatron-core's precision-aware optimizer, which its offload "
                             "runs inside, shards the state over DP)")
        if self.peft == "lora" and self.name != "adam":
            raise ValueError(f"--peft lora trains its adapters with Adam: use --optimizer adam "
                             f"(not {self.name}); LoGRA and LoRA are alternatives")


@dataclass(frozen=True)
class TrainingConfig:
    stage: Literal["sft", "rl"] = "sft"
    """What to train: supervised fine-tuning or RL with verifier rewards."""
    micro_batch_size: int = field(default=1, metadata=_POSITIVE)
    """Sequences per microbatch."""
    global_batch_size: int = field(default=8, metadata=_POSITIVE)
    """Sequences per update (RL: --prompts-per-step x --responses-per-prompt)."""
    seq_length: int = field(default=256, metadata=_POSITIVE)
    """Tokens per sequence (padded)."""
    train_iters: int = field(default=10, metadata=_POSITIVE)
    """Number of updates."""
    seed: int = 1234
    """Init, data and sampling seed."""
    bf16: bool = False
    """bf16 parameters (fp32 main grads)."""
    recompute_activations: bool = False
    """Full activation recompute, one layer at a time."""
    transformer_impl: Literal["auto", "local", "transformer_engine"] = "auto"
    """Layer implementation: megatron-core's local spec, Transformer Engine's (CUDA with TE
    installed), or auto (TE when available, for dense Adam only: LoGRA and LoRA build on
    the local spec). Compare methods with local, so all run the same layers."""
    log_interval: int = field(default=1, metadata=_POSITIVE)
    """Updates between progress lines."""
    max_skipped_updates: int = field(default=3, metadata=flag_spec(minimum=0))
    """Stop the run after this many updates in a row were skipped for a non-finite loss,
    sketch or gradient (each skip leaves weights and optimizer state untouched; 0: never
    stop)."""
    distributed_timeout_minutes: int = field(default=60, metadata=_POSITIVE)
    """How long a collective of the default process group waits for the other ranks
    (Megatron-LM's flag): the others wait this long while rank 0 alone starts a rollout
    engine or generates an evaluation. The default is above the engine's own bounds (a
    start 10 min, one request 30 min), so those fire first; raise it where one phase on
    rank 0 takes longer."""
    log_adam_cosine: bool = False
    """RL: log, every update, the cosine between the update applied to the layers' linear
    weights and the step dense Adam would take from the same gradients (a shadow Adam;
    training/adam_cosine.py). A diagnostic for method comparisons: it costs a dense weight
    gradient and four fp32 copies of those weights."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class DataConfig:
    tasks: tuple[tuple[str, float], ...] = field(
        default=(("basic_arithmetic", 1.0),),
        metadata=flag_spec(flag="--task", parse=str, cli_default="basic_arithmetic"))
    """reasoning-gym tasks with optional weights: NAME[:WEIGHT],..., a preset (rg-hard),
    or math (RL only)."""
    dataset_size: int = field(default=2000, metadata=_POSITIVE)
    """Items generated per task mixture (split into train and held-out eval)."""
    data_seed: int | None = None
    """Seed of task generation and sample order (default: --seed)."""

    def __post_init__(self) -> None:
        check_fields(self)


@dataclass(frozen=True)
class LoggingConfig:
    """Where the metrics go besides ``metrics.jsonl`` (megatron's flag names)."""

    tensorboard_dir: str | None = None
    """Write every metric (and the resolved config, as text) as TensorBoard events here."""
    wandb_project: str | None = None
    """Log every metric and the resolved config to this Weights & Biases project
    (WANDB_MODE=offline writes a local run that 'wandb sync' uploads later; an unreachable
    service never stops the run)."""
    wandb_exp_name: str | None = None
    """The W&B run's name (default: the --output-dir folder's name)."""
    wandb_save_dir: str | None = None
    """Where W&B keeps its run files (default: --output-dir)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if (self.wandb_exp_name or self.wandb_save_dir) and not self.wandb_project:
            raise ValueError("--wandb-exp-name / --wandb-save-dir need --wandb-project")


@dataclass(frozen=True)
class RunConfig:
    model: ModelSource
    output_dir: str = "runs/latest"
    """Where config.json and metrics.jsonl go."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rl: RLConfig = field(default_factory=RLConfig)
    dry_run: DryRunConfig = field(default_factory=DryRunConfig)
    flag_sources: dict[str, dict] = field(default_factory=dict,
                                          metadata=flag_spec(cli=False))
    """{flag: {"value", "source"}}: every flag's resolved value and where it came from
    (default, a --config file, or the command line); written to config.json."""

    def __post_init__(self) -> None:
        """The rules across this run's configs (each config has checked its own)."""
        check_fields(self)
        if self.training.stage == "rl":
            _check_rl(self)
        else:
            _check_sft(self)
        _check_optimizer(self.optimizer, self.training)

    @property
    def data_seed(self) -> int:
        """The seed of task generation and sample order: --data-seed, default --seed."""
        return self.data.data_seed if self.data.data_seed is not None else self.training.seed

    def check_world_size(self, world_size: int) -> None:
        """Refuse (ValueError) a world size this run's layout or batches do not split over."""
        dp = self.parallel.data_parallel_size(world_size)
        training, rl = self.training, self.rl
        mb = training.micro_batch_size
        if training.stage == "rl":
            batch = rl.prompts_per_step * rl.responses_per_prompt
            if batch % (mb * dp):
                raise ValueError(f"the RL global batch, --prompts-per-step x "
                                 f"--responses-per-prompt = {batch}, is not divisible by "
                                 f"--micro-batch-size x data-parallel size = {mb * dp}")
            if batch % rl.ppo_minibatches or (batch // rl.ppo_minibatches) % (mb * dp):
                raise ValueError(f"--ppo-minibatches {rl.ppo_minibatches} must split the "
                                 f"rollout batch of {batch} responses into minibatches that "
                                 f"are multiples of --micro-batch-size x data-parallel size = "
                                 f"{mb * dp}")
            if rl.kl.control != "none" and rl.kl.probe_responses > batch // dp:
                raise ValueError(f"--kl-probe-responses {rl.kl.probe_responses} exceeds the "
                                 f"{batch // dp} responses each data-parallel rank trains on")
        if training.global_batch_size % (mb * dp):
            raise ValueError(
                f"--global-batch-size {training.global_batch_size} is not divisible by "
                f"--micro-batch-size {mb} x data-parallel size {dp} = {mb * dp}; "
                f"choose a global batch that is a multiple of {mb * dp}")

    def to_dict(self) -> dict:
        """The configs (``flag_sources`` left out: config.json writes it on its own)."""
        out = asdict(self)
        out.pop("flag_sources")
        return out


def _check_optimizer(opt: OptimizerConfig, training: TrainingConfig) -> None:
    if opt.name == "logra" and opt.logra.master_weights == "none" and not training.bf16:
        raise ValueError("--logra-master-weights none keeps bf16 weights only: add --bf16 "
                         "(fp32 parameters are their own master)")
    if training.transformer_impl == "transformer_engine" and (opt.name == "logra"
                                                               or opt.peft == "lora"):
        feature = "LoGRA's sketched" if opt.name == "logra" else "LoRA's adapted"
        raise ValueError(f"--transformer-impl transformer_engine: {feature} linears are "
                         f"megatron-core's local Column/RowParallelLinear; use "
                         f"--transformer-impl local (or auto)")


def _check_sft(cfg: RunConfig) -> None:
    from megatron_logra.data.tasks import MATH

    if cfg.training.log_adam_cosine:
        raise ValueError("--log-adam-cosine is an RL diagnostic (it compares each RL update "
                         "with dense Adam's); drop it for --stage sft")

    if any(name == MATH for name, _ in cfg.data.tasks):
        raise ValueError(f"--task: {MATH!r} has no SFT targets here; SFT takes reasoning-gym "
                         "tasks (use it with --stage rl)")


def _check_rl(cfg: RunConfig) -> None:
    """``--stage rl`` against the optimizer, precision, layers and sequence length."""
    rl, opt, training = cfg.rl, cfg.optimizer, cfg.training
    check_run(rl.weight_sync.transport, optimizer=opt.name, peft=opt.peft, bf16=training.bf16,
              master_weights=opt.logra.master_weights, rollout_dtype=rl.rollout.dtype,
              projection=opt.logra.projection)
    if training.seq_length < rl.max_new_tokens + 8:
        raise ValueError(f"--seq-length {training.seq_length} leaves no room for prompts with "
                         f"--max-new-tokens {rl.max_new_tokens}; raise --seq-length")
    if rl.kl.control != "none" and opt.optimizer_cpu_offload:
        raise ValueError(f"--kl-control {rl.kl.control} with --optimizer-cpu-offload: the control "
                         "scales the update on the GPU's master params, while the offloaded "
                         "optimizer keeps its own host copy, which would stay unscaled; drop "
                         "one of them (colocated runs fit the engine without offload under "
                         "LoGRA: benchmarks/results/memory_plan.md)")
    if rl.kl.control != "none" and training.transformer_impl == "transformer_engine":
        raise ValueError(f"--kl-control {rl.kl.control} with --transformer-impl transformer_engine: "
                         "the KL tangent is carried through megatron-core's local linears "
                         "only; use --transformer-impl local (or auto, which builds local "
                         "under predicted-KL control)")

