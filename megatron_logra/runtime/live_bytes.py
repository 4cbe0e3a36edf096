"""Peak bytes of live tensor storage on any device: CPU's stand-in for CUDA max_memory_allocated.

On CPU the process RSS mixes allocator caching, freed-but-resident heap and
library buffers with the tensors a step really holds, so it cannot check an
analytic memory model. ``LiveTensorBytes`` is a dispatch mode that sees every
tensor an op returns (autograd's backward included: the mode travels with the
engine's thread-local state), counts each new storage once, and uncounts it
when the storage is freed (weak references on storages: torch keeps one Python
object per storage). Tensors alive before the mode was entered are not counted;
add them yourself (e.g. the enumerated model state).

    with LiveTensorBytes() as live:
        step()
    live.peak_bytes   # max over the step of the bytes allocated inside it and alive
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary


class LiveTensorBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def __enter__(self):
        self.live_bytes = self.peak_bytes = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor) and _has_storage(t)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and _has_storage(t):
                self._count(t.untyped_storage(), inputs)
        return out

    def _count(self, storage: torch.UntypedStorage, inputs: set[int]) -> None:
        if storage in self._sizes or id(storage) in inputs:
            return  # seen, or an in-place / view output of an input (not a new allocation)
        nbytes = storage.nbytes()
        self._sizes[storage] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live_bytes -= nbytes


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True
