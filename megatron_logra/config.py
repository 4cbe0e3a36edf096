"""Typed, frozen run configuration: built once from the CLI (``megatron_logra.cli``).

Each component owns its config dataclass (``logra.config.LograConfig``,
``lora.config.LoraConfig``, ``rl.config.RLConfig``, ``kl.config.KLControlConfig``, ``weight_sync.config.WeightSyncConfig``,
``runtime.parallel.ParallelConfig``); this module holds the trainer's own and composes
them into ``RunConfig``. A field is its flag: its default, its meaning (the string under
it) and its checks build the command line (``flags``). Each component receives only its
own slice; nothing below the launcher reads an argparse namespace. No torch, no megatron.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

from megatron_logra.flags import flag_spec
from megatron_logra.kl.config import KLControlConfig  # noqa: F401 - the run's sub-configs
from megatron_logra.logra.config import LograConfig
from megatron_logra.lora.config import LoraConfig
from megatron_logra.rl.config import RLConfig
from megatron_logra.runtime.parallel import ParallelConfig

_POSITIVE = flag_spec(minimum=1)


@dataclass(frozen=True)
class ModelSource:
    model_dir: str = field(metadata=flag_spec(cli_default=None))
    """HF model folder (config.json + tokenizer); default: the --load HF folder if there is
    one, else the embedded tiny Llama."""
    tokenizer_model: str | None = None
    """A sentencepiece tokenizer.model overriding the folder's tokenizer."""


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


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    """Checkpoint directory."""
    save_interval: int = field(default=0, metadata=flag_spec(minimum=0))
    """Updates between checkpoints (0: only at the end)."""
    save_keep: int | None = field(default=None, metadata=flag_spec(minimum=0,
                                                                   zero_is_none=True))
    """Keep only the newest N checkpoints in --save (0: keep all); the one 'latest'
    selects is never deleted."""
    auto_resume: bool = False
    """Resume from the newest checkpoint in --save that verifies, when there is one,
    instead of --load (always on when torchrun restarts the job: --max-restarts); a
    damaged newest checkpoint is passed over, and said so."""
    load: str | None = None
    """Checkpoint directory (or one iter_* folder in it) to resume from, or an HF model
    folder / converted checkpoint to start from (weights only)."""
    load_format: str = field(default="megatron", metadata=flag_spec(cli=False))
    """megatron (a checkpoint folder) | hf (an HF model folder): what --load names."""
    finetune: bool = False
    """With --load: take the weights only (fresh optimizer, step 0)."""


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
    flag_sources: dict[str, dict] = field(default_factory=dict,
                                          metadata=flag_spec(cli=False))
    """{flag: {"value", "source"}}: every flag's resolved value and where it came from
    (default, a --config file, or the command line); written to config.json."""

    def to_dict(self) -> dict:
        """The configs (``flag_sources`` left out: config.json writes it on its own)."""
        out = asdict(self)
        out.pop("flag_sources")
        return out
