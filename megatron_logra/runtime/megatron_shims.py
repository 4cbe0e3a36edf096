"""megatron-core 0.16.x on a machine without CUDA: every shim, in one place.

Applied once by ``runtime.device.init_runtime`` when torch sees no CUDA device,
and never on CUDA (there each patched call already works). All shims only turn
calls that would raise "Torch not compiled with CUDA" into their CPU meaning, so
code that ran before runs unchanged. Supported: megatron-core 0.16.x (checked
against 0.16.1); another version is refused (``runtime.versions``).

Sites covered (paths under ``megatron/core``):

* ``torch.cuda.current_device()`` used as an allocation device:
  ``distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer.__init__``),
  ``pipeline_parallel/p2p_communication.py`` (``create_tensor_recv_*``),
  ``models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb``),
  ``utils.py`` (``GlobalMemoryBuffer.get_tensor``) and many more -> returns "cpu".
* literal ``device="cuda"`` in tensor factories: ``pipeline_parallel/schedules.py``
  (``total_num_tokens``), ``optimizer/optimizer.py`` (``MixedPrecisionOptimizer``,
  ``FP32Optimizer``), ``optimizer/clip_grads.py``, ``optimizer/grad_scaler.py``,
  ``utils.py`` (``local_multi_tensor_l2_norm``),
  ``dist_checkpointing/strategies/state_dict_saver.py`` -> the factories map a
  cuda device to cpu (and drop ``pin_memory``).
* ``Tensor.cuda()``: ``models/common/language_module/language_module.py``
  (``setup_embeddings_and_output_layer``), ``optimizer/optimizer.py`` (state
  load), ``optimizer/distrib_optimizer.py`` -> identity.
* ``torch.cuda.synchronize()`` (``dist_checkpointing``) -> no-op.
* ``param.type() in ['torch.cuda.FloatTensor', ...]`` checks in
  ``DistributedOptimizer._build_model_and_main_param_groups``,
  ``Float16OptimizerWithFloat16Params.__init__`` and
  ``clip_grads.clip_grad_by_total_norm_fp32`` -> while those three run, a CPU
  tensor's ``type()`` reports the matching ``torch.cuda.*`` name.
* ``with torch.device("meta")`` keeps working through the wrapped factories.
* The CUDA RNG tracker (``tensor_parallel/random.py``): ``_get_cuda_rng_state``,
  ``_set_cuda_rng_state`` and ``CudaRNGStatesTracker.add`` use the CPU default
  generator, so ``fork()`` (always taken by ``DotProductAttention``) and
  activation recompute work; ``model_parallel_cuda_manual_seed`` then also seeds
  the CPU generator. ``torch.cuda.manual_seed_all`` is left alone
  (``torch.manual_seed`` calls it).
"""

from __future__ import annotations

import functools
import importlib

import torch

from megatron_logra.runtime import versions


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
              "randint", "empty_strided", "as_tensor", "linspace", "eye")


def _is_cuda_device(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int)


def _redirect_device(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
            kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    wrapper.__megatron_logra_shim__ = True
    return wrapper


def _report_cuda_type_names(fn):
    """Run ``fn`` while CPU tensors answer ``type()`` with their torch.cuda name."""
    original_type = torch.Tensor.type

    def cuda_named_type(self, *args, **kwargs):
        if args or kwargs or self.device.type != "cpu":
            return original_type(self, *args, **kwargs)
        return original_type(self).replace("torch.", "torch.cuda.", 1)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        torch.Tensor.type = cuda_named_type
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original_type

    return wrapper


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mcore_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        original = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(original)

    original_seed_fn = mcore_random.model_parallel_cuda_manual_seed

    @functools.wraps(original_seed_fn)
    def model_parallel_manual_seed(seed, *args, **kwargs):
        original_seed_fn(seed, *args, **kwargs)
        torch.manual_seed(seed)  # the "default (data-parallel) state" on CPU

    mcore_random._get_cuda_rng_state = get_state
    mcore_random._set_cuda_rng_state = set_state
    mcore_random.CudaRNGStatesTracker.add = add
    mcore_random.model_parallel_cuda_manual_seed = model_parallel_manual_seed
    import megatron.core.tensor_parallel as tp

    tp.model_parallel_cuda_manual_seed = model_parallel_manual_seed


def apply_cpu_shims() -> None:
    """Apply all shims once; a no-op when CUDA is available or already applied."""
    if not torch.cuda.is_available():
        _apply_cpu_shims()


@versions.patch_once("megatron_logra.runtime.megatron_shims")
def _apply_cpu_shims() -> None:
    # torch's ``with torch.device(...)`` mode recognises factories by identity, from a
    # cache it fills on first use: fill it with the originals before wrapping them, or
    # meta-device construction (build_meta_model) silently allocates on CPU instead.
    from torch.utils import _device as torch_device_mode

    torch_device_mode._device_constructors()
    # forward-mode AD scripts its decompositions on first use, and TorchScript cannot
    # compile the wrapped factories: load them now, with the originals in place
    importlib.import_module("torch._decomp.decompositions_for_jvp")
    for name in _FACTORIES:
        setattr(torch, name, _redirect_device(getattr(torch, name)))
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self

    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    dist_opt._build_model_and_main_param_groups = staticmethod(
        _report_cuda_type_names(dist_opt._build_model_and_main_param_groups))
    f16 = optimizer.Float16OptimizerWithFloat16Params
    f16.__init__ = _report_cuda_type_names(f16.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = _report_cuda_type_names(
        clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32
    _patch_rng_tracker()
