"""A tiny HF model folder with weights, for tests: the byte-level tokenizer and config of
``model.tiny_assets`` plus random-init weights saved by transformers."""

from __future__ import annotations

from pathlib import Path

from megatron_logra.model.tiny_assets import write_tiny_model_dir


def write_tiny_hf_checkpoint(out_dir: str | Path, family: str = "llama", *, seed: int = 0,
                             **arch) -> Path:
    """A complete HF folder (weights saved by transformers' ``save_pretrained``) of a tiny
    random-init model; norms and biases perturbed so their mapping matters in parity checks."""
    import torch
    import transformers

    out = write_tiny_model_dir(out_dir, family, **arch)
    config = transformers.AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return out
