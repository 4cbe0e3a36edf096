"""The CPU shims for megatron-core (``runtime/megatron_shims.py``), skipped when CUDA exists.

On CPU, megatron's ``device="cuda"`` requests (tensors, ``pin_memory``, ``.cuda()``)
land on CPU while ``torch.cuda.is_available()`` stays False, so megatron keeps its CPU
branches; tensors report CUDA type names only inside the patched megatron calls; the
CUDA RNG tracker forks and restores the CPU generator state, drawing from the tracked
seed as ``torch.manual_seed`` would.
"""

import pytest
import torch

from megatron_logra.runtime import megatron_shims

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only shims")


def test_cuda_requests_are_served_on_cpu():
    megatron_shims.apply_cpu_shims()
    t = torch.zeros(3, device="cuda")
    assert t.device.type == "cpu"
    assert torch.tensor([1.0], device="cuda", pin_memory=True).device.type == "cpu"
    assert t.cuda() is t
    assert torch.cuda.current_device() == "cpu"
    assert not torch.cuda.is_available()  # megatron still takes its CPU branches


def test_type_names_are_reported_only_inside_the_patched_calls():
    megatron_shims.apply_cpu_shims()
    seen = []
    wrapped = megatron_shims._report_cuda_type_names(lambda x: seen.append(x.type()))
    x = torch.zeros(2, dtype=torch.bfloat16)
    wrapped(x)
    assert seen == ["torch.cuda.BFloat16Tensor"]
    assert x.type() == "torch.BFloat16Tensor"
    assert x.type(torch.float32).dtype == torch.float32


def test_rng_tracker_forks_cpu_state():
    megatron_shims.apply_cpu_shims()
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.add("a", 123)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    with tracker.fork("a"):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # restored
    torch.manual_seed(123)
    assert torch.equal(inside, torch.rand(3))  # drew from the tracked seed
