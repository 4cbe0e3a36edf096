"""Named model shapes: the HF config.json of each model the memory model projects and the
benchmarks measure (random init; only the config is needed)."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

ASSETS = Path(__file__).resolve().parent.parent / "assets"
SHAPES = {  # HF config fields of the shapes built by ``model.tiny_assets.tiny_hf_config``
    "tiny": dict(family="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=384, vocab_size=384),
    "small": dict(family="llama", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                  intermediate_size=768, vocab_size=4096),  # tests: still quick, less tiny
    "smollm2-135m": dict(family="llama", hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, intermediate_size=1536, vocab_size=49152,
                         max_position_embeddings=8192),
    "llama-160m": dict(family="llama", hidden_size=1024, num_layers=8, num_heads=8,
                       num_kv_heads=4, intermediate_size=2816, vocab_size=32000,
                       tie_word_embeddings=False),  # benchmarks/weight_push.py
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, intermediate_size=8960, vocab_size=151936,
                         max_position_embeddings=4096),  # Qwen2.5-Math-1.5B's
    "qwen2.5-7b": dict(family="qwen2", hidden_size=3584, num_layers=28, num_heads=28,
                       num_kv_heads=4, intermediate_size=18944, vocab_size=152064,
                       tie_word_embeddings=False, max_position_embeddings=32768),
}
CONFIG_SHAPES = ("qwen3-27b",)  # shapes given as a whole config.json: assets/NAME/
PAPER_SHAPES = {"1.5B": "qwen2.5-1.5b", "7B": "qwen2.5-7b", "27B": "qwen3-27b"}
"""The paper's Table 1 sizes (Qwen2.5-Math-1.5B, Qwen2.5-Math-7B, a Qwen3 27B) by shape."""


def hf_config(shape: str, **overrides) -> dict:
    """The HF config.json of a shape: ``SHAPES`` above, or ``assets/NAME/config.json``;
    ``overrides``: config.json fields set otherwise (``max_position_embeddings=...``)."""
    if shape in CONFIG_SHAPES:
        return {**json.loads((ASSETS / shape / "config.json").read_text()), **overrides}
    from megatron_logra.model.tiny_assets import tiny_hf_config

    kw = dict(SHAPES[shape])
    return {**tiny_hf_config(kw.pop("family"), **kw), **overrides}


def shape_arch(shape: str):
    """The shape's ``model.arch.ModelArch`` (its HF config, validated)."""
    from megatron_logra.model.arch import arch_from_hf_config

    return arch_from_hf_config(hf_config(shape))


def shape_dir(shape: str) -> str:
    """A model folder holding only the shape's config.json (one per shape and user under
    the temp dir, rewritten atomically, so repeated probes leave no new folders)."""
    out = Path(tempfile.gettempdir()) / f"megatron_logra-shape-{shape}-{os.getuid()}"
    out.mkdir(exist_ok=True)
    tmp = out / f"config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(hf_config(shape)))
    tmp.replace(out / "config.json")
    return str(out)
