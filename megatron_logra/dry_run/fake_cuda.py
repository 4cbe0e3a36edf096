"""Fake CUDA on a CPU-only torch: every shim the dry run needs, in one place.

The dry run traces the real code on ``FakeTensorMode`` tensors (shapes, dtypes and
devices, no storage). A fake ``cuda`` tensor already exists on a CPU-only torch, and
mixing it with a CPU tensor raises as CUDA does; what has no fake counterpart is
provided here, and only inside ``fake_cuda()`` (undone on exit; a process whose CPU shims,
``runtime.megatron_shims``, are applied is refused: they turn CUDA into CPU). Checked
against torch 2.13.0 and megatron-core 0.16.1; another version is refused
(``runtime.versions``).

torch (C++ parts a CPU-only build lacks):

* A CUDA device guard. Python bindings that index or move a tensor
  (``Tensor.__getitem__``/``__setitem__``, ``Tensor.to("cuda")``) enter a device guard
  for its device, and a CPU-only build registers none for CUDA ("PyTorch is not linked
  with support for cuda devices"). One no-op guard reporting ``cuda:0`` is registered
  in c10's guard registry (``c10::impl::registerDeviceGuard``, through ctypes: torch's
  Python API registers a Python guard only for PrivateUse1, so it is registered there
  and its pointer moved to the CUDA slot).
* What C++ sees of a fake CUDA tensor: ``meta``. The autograd engine keeps CUDA tensors
  on the accelerator's streams, and a CPU-only build has no CUDA accelerator ("Cannot
  access accelerator device when none is available" in ``InputBuffer::add``). So a fake
  CUDA tensor is made without FakeTensorMode's ``dispatch_device`` (``_make_subclass``):
  C++ reads its device from its meta storage, as FakeTensorMode's kernels see it anyway
  (and need not call back into Python for it: half the ops of a traced update were that
  question), while Python code sees ``cuda:0`` (``FakeTensor.device``, ``is_cuda``,
  ``is_meta``, ``type()``, ``get_device()``); a tensor C++ creates on ``meta`` becomes a
  fake ``cuda:0`` one, and ``Tensor.to`` / ``Tensor.cuda`` to the device a tensor is on
  return it, as on CUDA (C++ would compare against ``meta`` and copy).
* Meta tensors the code asks for (shapes without memory, e.g. ``hf_mapping``): torch's
  factories called with ``device="meta"`` (``torch.empty``, ``zeros``, ... as the CPU
  shims list them), and ``Tensor.to("meta")``, make real meta tensors outside the fake
  mode, and the ops on real meta tensors alone run outside it too
  (``checks.TraceChecks``): fake, they would be counted as CUDA memory. (A meta tensor
  made under ``with torch.device("meta")`` is not told apart: nothing traced uses one.)

torch.cuda (functions that would initialise CUDA):

* ``current_device()`` -> ``"cuda:0"`` (megatron-core allocates on it: a string, as the
  CPU shims answer ``"cpu"``); ``set_device``, ``synchronize`` -> no-ops;
  ``get_device_capability()`` -> (9, 0) (torch.distributed asks it of CUDA tensors).

megatron-core:

* ``tensor_parallel/random.py``: the CUDA RNG tracker reads and sets CUDA generator
  states. Dropout draws nothing from a fake tensor, so the tracker keeps one real CPU
  state per name (``_get_cuda_rng_state``, ``CudaRNGStatesTracker.add``), setting a state
  is a no-op, and ``fork()`` only checks the name: megatron's own ``fork`` compares CPU
  RNG states as tensors on exit, a value a fake tensor has not.
* ``optimizer/clip_grads.py``'s ``l2_norm_impl`` (the grad norm): without Transformer
  Engine or apex, megatron-core falls back to ``utils.local_multi_tensor_l2_norm``, which
  builds a CPU tensor from every per-tensor norm (a host read each); a GPU job has TE's
  fused kernel. The same norm is taken on the device instead: a 1-element fp32 tensor,
  as both return.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import os
from collections.abc import Iterator

import torch
from torch._subclasses import fake_tensor

from megatron_logra.runtime import versions

META, CUDA0 = torch.device("meta"), torch.device("cuda", 0)
_FAKE = fake_tensor.FakeTensor
_LIBC10 = "libc10.so"
_REGISTRY = "_ZN3c104impl26device_guard_impl_registryE"  # c10::impl::device_guard_impl_registry
_REGISTER = ("_ZN3c104impl19registerDeviceGuardENS_10DeviceTypeEPKNS0_24DeviceGuardImplInterface"
             "E")  # c10::impl::registerDeviceGuard(DeviceType, const DeviceGuardImplInterface*)
_CUDA = int(torch._C._autograd.DeviceType.CUDA)
_PRIVATE_USE1 = int(torch._C._autograd.DeviceType.PrivateUse1)


class _CudaGuard(torch._C._acc.DeviceGuard):
    """torch's Python device guard (no-op device and stream calls on device index 0),
    answering for CUDA."""

    def type_(self):
        return torch._C._autograd.DeviceType.CUDA


class _GuardRegistry:
    """c10's device guard registry, through ctypes."""

    def __init__(self):
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", _LIBC10))
        self.slots = (ctypes.c_void_p * 64).in_dll(lib, _REGISTRY)
        self.register = getattr(lib, _REGISTER)
        self.register.argtypes = [ctypes.c_int8, ctypes.c_void_p]
        self.guard: _CudaGuard | None = None

    def install(self) -> None:
        if self.slots[_CUDA] is not None:
            raise RuntimeError("a CUDA device guard is registered already: the dry run fakes "
                               "CUDA on a CPU-only torch; on a GPU machine run the job itself")
        if self.slots[_PRIVATE_USE1] is not None:
            raise RuntimeError("a PrivateUse1 device guard is registered: the dry run needs "
                               "that slot free for a moment to build its CUDA guard")
        self.guard = _CudaGuard()
        if not torch._C._acc.register_python_privateuseone_device_guard(self.guard):
            raise RuntimeError("torch refused the dry run's device guard")
        self.register(_CUDA, self.slots[_PRIVATE_USE1])
        self.register(_PRIVATE_USE1, None)

    def uninstall(self) -> None:
        self.register(_CUDA, None)  # the guard object stays alive: C++ may hold it still


def _on_cuda(t) -> bool:
    return t.fake_device.type == "cuda"


def _make_fake_cuda_meta_to_cpp(make_subclass):
    """``Tensor._make_subclass`` making a fake CUDA tensor whose device C++ reads from its
    storage (``meta``) instead of asking Python (FakeTensorMode's ``dispatch_device``):
    what C++ sees is meta, and it need not call back into Python for it (half the ops of
    a traced update were that question)."""
    def wrapper(cls, data, *args, **kwargs):
        device = kwargs.get("device_for_backend_keys")
        if (kwargs.get("dispatch_device") and issubclass(cls, _FAKE) and device is not None
                and torch.device(device).type == "cuda"):
            kwargs["dispatch_device"] = False
        return make_subclass(cls, data, *args, **kwargs)
    return staticmethod(wrapper)


def _fake_tensor_as_cuda() -> dict:
    """The replacements of FakeTensor's device answers (see the module doc): {name: new}."""
    normalize = _FAKE.__dict__["_normalize_fake_device"].__func__

    def normalize_device(device: torch.device) -> torch.device:
        return normalize(CUDA0 if device.type == "meta" else device)

    def to(self, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and torch.device(device).type == "meta":  # a real meta copy
            with fake_tensor.unset_fake_temporarily():
                return torch.empty_strided(self.shape, self.stride(), dtype=dtype or self.dtype,
                                           device="meta")
        if (not kwargs.get("copy", False) and memory_format in (None, torch.preserve_format)
                and dtype in (None, self.dtype)
                and (device is None or normalize_device(torch.device(device)) == self.device)):
            return self
        return torch.Tensor.to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        target = torch.device("cuda", device) if isinstance(device, int) \
            else torch.device(device or "cuda")
        return self.to(target, non_blocking=non_blocking, memory_format=memory_format)

    def tensor_type(self, *args, **kwargs):
        out = torch.Tensor.type(self, *args, **kwargs)
        if args or kwargs or not _on_cuda(self):
            return out
        return out.replace("torch.meta.", "torch.cuda.", 1)  # "torch.meta.BFloat16Tensor"

    return {"_normalize_fake_device": staticmethod(normalize_device),
            "to": to, "cuda": cuda, "type": tensor_type,
            "is_cuda": property(_on_cuda), "is_meta": property(lambda self: False),
            "get_device": lambda self: self.fake_device.index if _on_cuda(self) else -1}


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn",
              "randint", "empty_strided", "as_tensor", "linspace", "eye")  # as the CPU shims'


def is_meta(device) -> bool:
    return (isinstance(device, torch.device) and device.type == "meta") or device == "meta"


def _real_meta_factories() -> dict:
    """torch's factories making real meta tensors (outside the fake mode) when asked for
    ``device="meta"``: {name: wrapper}."""
    def real_meta(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if is_meta(kwargs.get("device")):
                with fake_tensor.unset_fake_temporarily():
                    return fn(*args, **kwargs)
            return fn(*args, **kwargs)
        return wrapper
    return {name: real_meta(getattr(torch, name)) for name in _FACTORIES}


def _rng_tracker() -> dict:
    """megatron-core's CUDA RNG tracker, for fake tensors: {name: new}."""
    from megatron.core.tensor_parallel import random as mcore_random

    def get_state(device="cuda", clone=False, graph_safe=False):
        with fake_tensor.unset_fake_temporarily():
            return torch.get_rng_state()

    def set_state(new_state, device=-1, graph_safe=False):
        pass

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        self.seeds_.add(seed)
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.states_[name] = get_state()

    @contextlib.contextmanager
    def fork(self, name=mcore_random._MODEL_PARALLEL_RNG_TRACKER_NAME):
        if name not in self.states_:
            raise Exception(f"cuda rng state {name} is not added")
        yield

    return {"_get_cuda_rng_state": get_state, "_set_cuda_rng_state": set_state,
            "add": add, "fork": fork}


def _l2_norm_on_device(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``utils.local_multi_tensor_l2_norm``'s result ([total norm] fp32, None) without
    reading any norm on the host."""
    norms = torch.stack([torch.norm(t) for tensors in tensor_lists for t in tensors])
    return torch.norm(norms).float().reshape(1), None


@contextlib.contextmanager
def _replaced(owner, names: dict) -> Iterator[None]:
    """``owner``'s attributes replaced by ``names`` while inside (restored after)."""
    missing = object()
    saved = {name: owner.__dict__.get(name, missing) if isinstance(owner, type)
             else getattr(owner, name, missing) for name in names}
    for name, value in names.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


def cpu_shims_applied() -> bool:
    """Whether ``runtime.megatron_shims`` turned CUDA into CPU in this process."""
    return bool(getattr(torch.empty, "__megatron_logra_shim__", False))


@contextlib.contextmanager
def fake_cuda() -> Iterator[None]:
    """Every shim above, applied while inside."""
    versions.require("torch", "megatron_logra.dry_run.fake_cuda")
    versions.require("megatron-core", "megatron_logra.dry_run.fake_cuda")
    if cpu_shims_applied():
        raise RuntimeError("the CPU shims (runtime.megatron_shims) are applied in this "
                           "process: they map CUDA to CPU; run the dry run in a process of "
                           "its own (launch/pretrain_rl.py --dry-run)")
    from megatron.core.optimizer import clip_grads
    from megatron.core.tensor_parallel import random as mcore_random
    from torch.utils import _device as torch_device_mode

    # torch's ``with torch.device(...)`` mode recognises factories by identity from a cache
    # it fills on first use: fill it with the originals before wrapping them
    torch_device_mode._device_constructors()
    # forward-mode AD scripts its decompositions on first use, and TorchScript cannot
    # compile the wrapped factories: load them now, with the originals in place
    importlib.import_module("torch._decomp.decompositions_for_jvp")
    as_cuda = _fake_tensor_as_cuda()
    rng = _rng_tracker()
    registry = _GuardRegistry()
    registry.install()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replaced(_FAKE, as_cuda))
            stack.enter_context(_replaced(torch.Tensor, {"_make_subclass":
                                _make_fake_cuda_meta_to_cpp(torch.Tensor._make_subclass)}))
            stack.enter_context(_replaced(torch, _real_meta_factories()))
            stack.enter_context(_replaced(torch.cuda, {
                "current_device": lambda: "cuda:0",
                "set_device": lambda *args, **kwargs: None,
                "synchronize": lambda *args, **kwargs: None,
                "get_device_capability": lambda *args, **kwargs: (9, 0)}))
            stack.enter_context(_replaced(mcore_random, {
                "_get_cuda_rng_state": rng.pop("_get_cuda_rng_state"),
                "_set_cuda_rng_state": rng.pop("_set_cuda_rng_state")}))
            stack.enter_context(_replaced(mcore_random.CudaRNGStatesTracker, rng))
            stack.enter_context(_replaced(clip_grads, {"l2_norm_impl": _l2_norm_on_device}))
            yield
    finally:
        registry.uninstall()

