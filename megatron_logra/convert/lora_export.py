"""A LoRA-trained checkpoint, exported: merged weights, and the adapter in PEFT's format.

A checkpoint saved by a ``--peft lora`` run holds the frozen base weights and, per
adapted linear, ``lora_a`` [r, in] and ``lora_b`` [out, r] (full TP=1 tensors once read).

- ``merged_param``: W + (alpha / r) B A, what the HF export of such a checkpoint holds.
- ``write_peft_adapter``: ``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT
  saves them, loadable with ``peft.PeftModel.from_pretrained(base, folder)``. Megatron's
  fused linears become PEFT's per-module adapters without approximation: q, k and v (and
  gate and up) share the fused layer's A, and each takes its own rows of B (the rows of
  the fused weight that become that HF tensor, ``hf_mapping.hf_from_megatron``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_logra.lora.config import LoraConfig
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import hf_from_megatron, megatron_param_names

_PREFIX = "base_model.model."


def lora_of_checkpoint(meta) -> LoraConfig | None:
    """The LoRA settings a checkpoint was trained with (its ``CheckpointMeta``), or None."""
    opt = (meta.config or {}).get("optimizer") or {}
    if opt.get("peft") != "lora":
        return None
    cfg = dict(opt["lora"])
    cfg["targets"] = tuple(cfg["targets"])
    return LoraConfig(**cfg)


def adapter_of(name: str) -> tuple[str, str]:
    """Canonical weight name -> the canonical names of its A and B."""
    module = name.removesuffix(".weight")
    return f"{module}.lora_a", f"{module}.lora_b"


def merged_param(read, name: str, lora: LoraConfig, adapted: set[str]) -> torch.Tensor:
    """``read(name)`` (a full tensor), with its adapter merged when it has one."""
    weight = read(name)
    if name not in adapted:
        return weight
    a_name, b_name = adapter_of(name)
    delta = read(b_name).float() @ read(a_name).float()
    return (weight.float() + (lora.alpha / lora.rank) * delta).to(weight.dtype)


def adapted_weights(params: list[str]) -> set[str]:
    """The weights among ``params`` (a layout's canonical names) that carry an adapter."""
    have = set(params)
    return {f"{p.removesuffix('.lora_a')}.weight" for p in params
            if p.endswith(".lora_a") and p.replace(".lora_a", ".lora_b") in have}


def peft_tensors(arch: ModelArch, read, adapted: set[str]) -> dict[str, torch.Tensor]:
    """PEFT's state dict of the adapter: ``base_model.model.<hf module>.lora_A/B.weight``."""
    out = {}
    for name in megatron_param_names(arch):
        if name not in adapted:
            continue
        a_name, b_name = adapter_of(name)
        a, b = read(a_name), read(b_name)
        for hf_name, b_rows in hf_from_megatron(arch, name, b):
            module = hf_name.removesuffix(".weight")
            out[f"{_PREFIX}{module}.lora_A.weight"] = a.clone()  # one copy per module
            out[f"{_PREFIX}{module}.lora_B.weight"] = b_rows.contiguous()
    return out


def peft_config(lora: LoraConfig, tensors: dict[str, torch.Tensor], base_model: str) -> dict:
    """PEFT's ``adapter_config.json`` for the adapter ``tensors`` (``peft_tensors``)."""
    targets = sorted({k.split(".")[-3] for k in tensors})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
            "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base_model}


def write_peft_adapter(out: Path, arch: ModelArch, read, adapted: set[str], lora: LoraConfig,
                       base_model: str, dtype: torch.dtype) -> list[str]:
    """Write the adapter folder; returns PEFT's target module names."""
    from safetensors.torch import save_file

    tensors = {k: v.to(dtype) for k, v in peft_tensors(arch, read, adapted).items()}
    config = peft_config(lora, tensors, base_model)
    targets = config["target_modules"]
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return targets
