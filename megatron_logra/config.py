"""Typed, frozen run configuration: built once from the CLI (``megatron_logra.cli``).

Each component receives only its own slice (``OptimizerConfig`` for the
optimizer, ``DataConfig`` for the data, ...). Nothing below the launcher reads an
argparse namespace.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from megatron_logra.runtime.parallel import ParallelConfig


@dataclass(frozen=True)
class ModelSource:
    model_dir: str
    """HF model folder: config.json + tokenizer files (weights optional)."""
    tokenizer_model: str | None = None
    """A sentencepiece ``tokenizer.model`` overriding the folder's tokenizer."""


@dataclass(frozen=True)
class LograConfig:
    """LoGRA's sketch and RowAdam settings (``--optimizer logra``)."""

    rank: int = 256  # r: sketch columns per weight
    projection: str = "rademacher"  # rademacher | gaussian
    refresh_interval: int = 1  # new projections every N updates
    targets: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")
    beta2: float = 0.95
    eps: float = 1e-8  # relative to the layer's mean row scale
    update_ratio: float | None = 6e-5
    """Norm-ratio step ||c D A|| = ratio ||W|| over all sketched weights (the reference's
    6e-5); None: --lr is the step size (meant for plain RowAdam, whose D is O(1) per element;
    a restored D carries the token-normalised sketch's norm)."""
    master_weights: str = "fp32"  # with --bf16: fp32 master copy | none (stochastic rounding)
    norm_restoration: bool = True
    """Rescale each HF module's direction to its sketch's Frobenius norm (the reference's
    ``row_adam_direction``); False: plain RowAdam (NVIDIA's simplified port)."""
    untargeted: str = "frozen"
    """Parameters that are not sketched: "frozen" (the reference: no optimizer, no grads)
    or "adam" (megatron's Adam at --lr, clipped by --clip-grad)."""
    update_factor_dtype: str = "bfloat16"
    """The final factor alpha c D is rounded to this dtype before it is applied (the
    reference's default); "float32" keeps it exact (not with --logra-master-weights none)."""


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adam"  # "adam" | "logra" (RowAdam on sketched weights, Adam on the rest)
    lr: float = 1e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"  # constant | linear | cosine
    lr_decay_iters: int | None = None  # None: --train-iters
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0  # 0 disables clipping (it never zeroes gradients)
    use_distributed_optimizer: bool = False
    logra: LograConfig = field(default_factory=LograConfig)


@dataclass(frozen=True)
class TrainingConfig:
    stage: str = "sft"  # "sft" | "rl"
    micro_batch_size: int = 1
    global_batch_size: int = 8
    seq_length: int = 256
    train_iters: int = 10
    seed: int = 1234
    bf16: bool = False
    recompute_activations: bool = False
    log_interval: int = 1


@dataclass(frozen=True)
class DataConfig:
    tasks: tuple[tuple[str, float], ...] = (("basic_arithmetic", 1.0),)
    """reasoning-gym task names with mixture weights."""
    dataset_size: int = 2000
    """Items generated per task mixture (split into train and held-out eval)."""
    data_seed: int | None = None
    """Seed of task generation and sample order; None: --seed."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    save_interval: int = 0  # 0: only at the end (when --save is given)
    load: str | None = None
    load_format: str = "megatron"  # "megatron" (a checkpoint folder) | "hf" (an HF model folder)
    finetune: bool = False  # load weights only: no optimizer/scheduler state, step 0


@dataclass(frozen=True)
class KLControlConfig:
    """Predicted-KL step control (logra-method.md section 3)."""

    mode: str = "none"  # none | predicted
    budget_start: float = 2e-4  # KL budget per update, cosine-decayed ...
    budget_end: float = 2e-5  # ... to this
    budget_steps: int = 300  # over this many updates
    alpha_max: float = 3.0
    probe_responses: int = 2  # responses per DP rank the prediction is computed on
    probe_max_tokens: int = 4096  # each probe response cut at this many tokens, prompt included
    mismatch_decay: float = 0.7  # m <- decay m + (1 - decay) max(0, mean(gen - prev))


@dataclass(frozen=True)
class RLConfig:
    """The RL stage (``--stage rl``): rollouts, rewards, advantages, evaluation."""

    algorithm: str = "grpo"  # grpo | reinforce (running baseline)
    prompts_per_step: int = 8
    responses_per_prompt: int = 4  # the global batch is prompts x responses sequences
    max_new_tokens: int = 64
    temperature: float = 1.0
    rollout_seed: int = 0
    tis_cap: float | None = 2.0  # truncated importance sampling cap; None: off
    baseline_decay: float = 0.9  # reinforce: b <- decay b + (1 - decay) mean(outcomes)
    failure_reward: float = -0.01  # reinforce, binary rewards: the outcome of a wrong answer
    reward: str = "binary"  # binary | partial
    verifier_timeout_s: float = 10.0
    eval_interval: int = 0  # updates between evaluations (0: only before and after)
    eval_prompts: int = 32
    eval_samples: int = 4  # k of pass@k
    eval_temperature: float = 0.7  # evaluation sampling (the reference's 0.7 / 0.7)
    eval_top_p: float = 0.7
    rollout_tensor_parallel_size: int = 1
    rollout_dtype: str = "float32"  # float32 | bfloat16
    rollout_kv_cache_gib: float = 1.0
    sync_bucket_mb: int = 64
    weight_sync: str = "full"  # full | sparse-delta (changed elements) | sketch-delta (LoGRA)
    weight_sync_anchor_interval: int = 0  # a full push every N updates (0: only when needed)
    weight_sync_verify_interval: int = 1  # fingerprint check every N delta pushes (0: never)
    kl: KLControlConfig = field(default_factory=KLControlConfig)


@dataclass(frozen=True)
class RunConfig:
    model: ModelSource
    output_dir: str
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def to_dict(self) -> dict:
        return asdict(self)
