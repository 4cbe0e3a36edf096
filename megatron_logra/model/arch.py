"""The decoder architecture, read from an HF ``config.json`` and validated.

``ModelArch`` is the one description of the network that the model provider, the
checkpoint converter and weight sync share. Supported: Llama, Qwen2
(qkv bias) and Qwen3 (q/k RMSNorm, head_dim may differ from hidden/heads), with
GQA, RMSNorm, SwiGLU, rope and tied or untied embeddings. Anything megatron-core
cannot express exactly is refused here with a message naming the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

VOCAB_PAD_MULTIPLE = 128
"""Padded vocab = vocab rounded up to this multiple, independent of TP, fixed once so
checkpoints reshard (a multiple of 128 divides evenly by every power-of-two TP <= 128)."""

LINEAR_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""A transformer layer's linears a feature may replace (``--logra-targets``,
``--lora-targets``): column-parallel qkv and fc1, row-parallel proj and fc2
(``model.provider.replace_linears``)."""

_FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

# megatron-core's Llama-3 rope scaling hard-codes these (rotary_pos_embedding.py).
_MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192}


class UnsupportedModelError(ValueError):
    """The HF config describes something this project cannot train exactly."""


@dataclass(frozen=True)
class ModelArch:
    """A dense decoder-only transformer (shapes in HF terms)."""

    family: str  # "llama" | "qwen2" | "qwen3"
    hidden_size: int  # H
    num_layers: int  # L
    num_attention_heads: int  # np
    num_kv_heads: int  # ng
    head_dim: int  # hn
    ffn_hidden_size: int  # F
    vocab_size: int  # V, as in config.json (never len(tokenizer))
    padded_vocab_size: int  # Vp
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling_factor: float | None = None  # Llama-3 style scaling, megatron's fixed factors
    init_std: float = 0.02

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused qkv weight: ng * (np/ng + 2) * hn."""
        return (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def num_parameters(self) -> int:
        """Parameters of the HF model (unpadded vocabulary; biases and norms included)."""
        h, f = self.hidden_size, self.ffn_hidden_size
        q = self.num_attention_heads * self.head_dim
        layer = (h * self.qkv_rows + q * h + 3 * h * f + 2 * h
                 + (self.qkv_rows if self.qkv_bias else 0)
                 + (2 * self.head_dim if self.qk_norm else 0))
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + embeddings + h

    def to_dict(self) -> dict:
        return asdict(self)

    def check_parallel(self, tp: int, pp: int) -> None:
        """Refuse a TP/PP layout this model cannot be split into."""
        problems = []
        if self.num_attention_heads % tp:
            problems.append(f"num_attention_heads={self.num_attention_heads} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            problems.append(f"num_key_value_heads={self.num_kv_heads} and "
                            f"--tensor-model-parallel-size {tp}: one must divide the other")
        if self.ffn_hidden_size % tp:
            problems.append(f"intermediate_size={self.ffn_hidden_size} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
        if self.padded_vocab_size % tp:
            problems.append(f"padded vocab {self.padded_vocab_size} is not divisible by "
                            f"--tensor-model-parallel-size {tp}")
        if self.num_layers % pp:
            problems.append(f"num_hidden_layers={self.num_layers} is not divisible by "
                            f"--pipeline-model-parallel-size {pp}")
        if problems:
            raise ValueError("model cannot be split this way: " + "; ".join(problems)
                             + ". Fix: choose sizes that divide these dimensions.")


def pad_vocab(vocab_size: int, multiple: int = VOCAB_PAD_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def _rope(cfg: dict) -> tuple[float, float | None]:
    """(rope_theta, llama3 scaling factor or None) from either transformers 4 or 5 keys."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or None
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if scaling is None and rope_type != "default":
        scaling = params
    if scaling is None:
        return float(theta), None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return float(theta), None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"rope scaling type {kind!r} is not supported (megatron-core implements only "
            f"Llama-3 scaling); use a model without rope_scaling")
    for key, expected in _MCORE_LLAMA3_ROPE.items():
        if float(scaling.get(key, expected)) != expected:
            raise UnsupportedModelError(
                f"rope_scaling.{key}={scaling.get(key)} but megatron-core hard-codes {expected}; "
                f"converting would silently change the model")
    return float(theta), float(scaling["factor"])


def arch_from_hf_config(cfg: dict) -> ModelArch:
    """Validate an HF config dict and describe it; raise UnsupportedModelError otherwise."""
    model_type = cfg.get("model_type")
    if model_type not in _FAMILIES:
        raise UnsupportedModelError(
            f"model_type={model_type!r} is not supported; supported: {sorted(_FAMILIES)}")
    for key in ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size"):
        if cfg.get(key):
            raise UnsupportedModelError(f"{key}={cfg[key]}: mixture-of-experts is not supported")
    if cfg.get("use_sliding_window") or (model_type == "llama" and cfg.get("sliding_window")):
        raise UnsupportedModelError("use_sliding_window=true: sliding-window attention is not "
                                    "supported; use a config with full attention")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise UnsupportedModelError(f"layer_types={sorted(set(layer_types))}: only full attention "
                                    f"layers are supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act={act!r}: only SwiGLU (silu) MLPs are supported")
    if model_type == "llama" and (cfg.get("attention_bias") or cfg.get("mlp_bias")):
        raise UnsupportedModelError("Llama attention_bias/mlp_bias=true is not supported "
                                    "(megatron-core's qkv bias does not cover o_proj/MLP biases)")
    if model_type == "qwen3" and cfg.get("attention_bias"):
        raise UnsupportedModelError("Qwen3 attention_bias=true is not supported")
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    if heads % kv_heads:
        raise UnsupportedModelError(f"num_attention_heads={heads} is not a multiple of "
                                    f"num_key_value_heads={kv_heads}")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    theta, factor = _rope(cfg)
    vocab = int(cfg["vocab_size"])
    return ModelArch(
        family=_FAMILIES[model_type],
        hidden_size=hidden,
        num_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=int(cfg["intermediate_size"]),
        vocab_size=vocab,
        padded_vocab_size=pad_vocab(vocab),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        rope_theta=theta,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        rope_scaling_factor=factor,
        init_std=float(cfg.get("initializer_range", 0.02)),
    )


def load_arch(model_dir: str | Path) -> ModelArch:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: --model-dir must name an HF model folder "
                                f"with a config.json")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UnsupportedModelError(f"{path} is not valid JSON: {exc}") from exc
    return arch_from_hf_config(cfg)
