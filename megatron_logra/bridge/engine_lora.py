"""The engine process's LoRA adapter (``--weight-sync lora-adapter``): vLLM's LoRA support.

The engine holds the frozen base weights; each push sends the adapter in PEFT's format
(``convert.lora_export.peft_tensors``), written here as a folder and served through a
new ``LoRARequest`` on every ``generate`` and ``prompt_logprobs`` from then on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# vLLM's accepted LoRA ranks (``vllm.config.lora.MaxLoRARanks``)
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_options(rank: int) -> dict:
    """vLLM's ``LLM`` settings for an engine serving the base plus one adapter of ``rank``
    (0: none)."""
    if not rank:
        return {}
    fits = [r for r in _VLLM_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {_VLLM_LORA_RANKS[-1]}, "
                         f"not {rank}")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 1}


class ServedAdapter:
    """The LoRA adapter the engine serves: each push is written as a PEFT folder and
    becomes a new ``LoRARequest`` (a new id: vLLM caches adapters by id)."""

    def __init__(self, root: str):
        self.root, self.request = Path(root), None

    def load(self, llm, payload) -> int:
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        tensors, config, version = payload
        folder = self.root / f"v{version}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(config))
        previous = self.request
        self.request = LoRARequest(f"v{version}", (previous.lora_int_id + 1) if previous else 1,
                                   str(folder))
        if previous is not None:  # free vLLM's copy of the old adapter, and its folder
            llm.llm_engine.remove_lora(previous.lora_int_id)
            if Path(previous.lora_path) != folder:
                shutil.rmtree(previous.lora_path, ignore_errors=True)
        return sum(t.numel() * t.element_size() for t in tensors.values())
