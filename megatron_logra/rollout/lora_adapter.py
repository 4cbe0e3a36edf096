"""The LoRA adapter a vLLM server serves (``--weight-sync lora-adapter``): vLLM's LoRA support.

The server holds the frozen base weights (pushed in full, unmerged); each push writes
the adapter in PEFT's format (``convert.lora_export.peft_tensors``) as a folder the
server reads, loads it at runtime (``/v1/load_lora_adapter``, with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``) under a new name, serves every generation and
score from it, and unloads the one before. A server on another node must see the
folder (a shared file system: the run's output directory).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# vLLM's accepted LoRA ranks (``vllm.config.lora.MaxLoRARanks``)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def lora_server_args(rank: int) -> list[str]:
    """vLLM server flags for the base plus one adapter of ``rank`` (0: none)."""
    if not rank:
        return []
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {_VLLM_LORA_RANKS[-1]}, not {rank}")
    return ["--enable-lora", "--max-lora-rank", str(fits[0]), "--max-loras", "1"]


def write_adapter(root: Path, tensors: dict, config: dict, version: int) -> Path:
    """The adapter of ``version`` as a PEFT folder under ``root``."""
    from safetensors.torch import save_file

    folder = Path(root) / f"v{version}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder
