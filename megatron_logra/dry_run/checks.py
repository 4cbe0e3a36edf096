"""What the dry run checks while it traces: every collective's tensors against the backend
its group uses in a real run, and every host read.

``TraceChecks`` is the dispatch mode under which the traced code runs (above
FakeTensorMode; it also hands every op's outputs to the memory tracker). It sees each
``c10d`` op (collectives and point-to-point) with its
tensors and group:

- the tensors of one call must be on one device type (NCCL and gloo both refuse a mix);
- the group must have a backend for that device type (``world.real_backends``: on a CUDA
  run the world and megatron-core's groups are ``cpu:gloo,cuda:nccl``; a group made
  NCCL-only has none for CPU tensors);
- each call is counted by phase and backend, with its bytes; a gloo call (CPU tensors)
  on a GPU run is legal but goes through host memory: its call site is listed.

A mismatch raises ``CollectiveMismatch`` naming the call site (the innermost frame of
the package or of megatron-core that made the call), as the real run would fail there.
Each send and receive is also logged with its peer, shape and dtype: once several ranks
are traced, ``run.pair_p2p`` checks that every send meets a receive of the same shape and
dtype on its peer (a mismatch hangs NCCL or corrupts the data).

Host reads: the package reads device values through ``runtime.host_read.host_value``,
which the dry run answers with the value it declares (``answer``; each site listed). A
value read any other way reaches torch as ``aten._local_scalar_dense``: from the
package's own code that is an error (``UnansweredHostRead``: route it through
``host_value``); from megatron-core or torch it is answered 1 (True for a flag, the
only kind megatron-core reads in an update: a token count > 0, a norm) and listed.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeWork
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron_logra.dry_run.call_sites import call_site
from megatron_logra.dry_run.world import real_backends

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_COALESCED = {getattr(torch.ops.c10d, name).default for name in (
    "allreduce_coalesced_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_")}  # in place on their outputs; return a Work
# c10d op -> the position of its input tensor(s) (the payload counted)
_INPUTS = {"allgather_": 1, "_allgather_base_": 1, "reduce_scatter_": 1,
           "_reduce_scatter_base_": 1, "gather_": 1, "scatter_": 1, "alltoall_": 1,
           "alltoall_base_": 1, "allgather_coalesced_": 1,
           "allgather_into_tensor_coalesced_": 1, "reduce_scatter_tensor_coalesced_": 1}


class CollectiveMismatch(RuntimeError):
    """A collective's tensors that the real run's backend refuses (message: the call site)."""


class UnansweredHostRead(RuntimeError):
    """The package read a device value without ``runtime.host_read.host_value``."""


def _in_package(site: str) -> bool:
    return site.startswith("megatron_logra" + os.sep)


@dataclass
class CallCount:
    calls: int = 0
    bytes: int = 0
    sites: set[str] = field(default_factory=set)

    def to_dict(self, with_sites: bool) -> dict:
        out = {"calls": self.calls, "bytes": self.bytes}
        if with_sites:
            out["sites"] = sorted(self.sites)
        return out


def _on_real_meta_only(args) -> bool:
    """Whether an op's tensors (top level and in lists) include a real (not fake) meta
    tensor and no fake one."""
    meta = False
    for a in args:
        for t in a if isinstance(a, (list, tuple)) else (a,):
            if isinstance(t, FakeTensor):
                return False
            if isinstance(t, torch.Tensor) and t.is_meta:
                meta = True
    return meta


class TraceChecks(TorchDispatchMode):
    """See the module doc. ``phase`` names what runs now (the counts are kept per phase)."""

    def __init__(self, memory=None) -> None:
        """``memory``: a ``memory.UpdateMemory`` given every op's outputs while it tracks."""
        super().__init__()
        self.memory = memory
        self.phase = "build"
        self.collectives: dict[tuple[str, str], CallCount] = defaultdict(CallCount)
        self.host_reads: dict[str, dict] = {}  # site -> {"reads", "assumed", "via"}
        self.p2p: list[dict] = []  # every send and recv, in order (``run.pair_p2p``)

    # --- host reads ------------------------------------------------------------------------
    def answer(self, tensor: torch.Tensor, assume):
        """``runtime.host_read``'s reader: the value the code declares (a real tensor's own,
        e.g. one made before the trace)."""
        if not isinstance(tensor, FakeTensor):
            return tensor.tolist()
        self._note_read(call_site(), assume, "host_value")
        return assume

    def _unanswered(self, tensor: torch.Tensor):
        site = call_site()
        if _in_package(site):
            raise UnansweredHostRead(
                f"{site}: reads a device value on the host without "
                f"runtime.host_read.host_value (a dry run has no values): route it through "
                f"host_value(tensor, assume=...)")
        value = True if tensor.dtype == torch.bool else 1 if not tensor.is_floating_point() \
            else 1.0
        self._note_read(site, value, "aten._local_scalar_dense")
        return value

    def _note_read(self, site: str, value, via: str) -> None:
        entry = self.host_reads.setdefault(site, {"reads": 0, "assumed": value, "via": via})
        entry["reads"] += 1

    # --- collectives -----------------------------------------------------------------------
    def _check(self, func, args, kwargs) -> None:
        name = func._schema.name.split("::")[-1]
        group = next((a for a in args if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type())), None)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if group is None or not tensors:
            return
        group = dist.ProcessGroup.unbox(group)
        site = call_site()
        devices = sorted({t.device.type for t in tensors})
        if len(devices) > 1:
            raise CollectiveMismatch(
                f"{site}: {name} on tensors of {' and '.join(devices)}: one collective's "
                f"tensors must all be on one device (NCCL and gloo refuse a mix)")
        backends = real_backends(group)
        backend = backends.get(devices[0])
        if backend is None:
            served = ", ".join(f"{d} tensors by {b}" for d, b in backends.items())
            raise CollectiveMismatch(
                f"{site}: {name} on {devices[0]} tensors in a group of {group.size()} ranks "
                f"that serves {served} only: a real run fails here (no backend for "
                f"{devices[0]}); move the tensors to {next(iter(backends))}")
        if name in ("send", "recv_"):
            t = tensors[0]
            self.p2p.append({"phase": self.phase, "op": name.rstrip("_"),
                             "peer": dist.get_global_rank(group, args[2]),
                             "shape": list(t.shape), "dtype": str(t.dtype).split(".")[-1],
                             "device": t.device.type, "site": site})
        position = _INPUTS.get(name)
        payload = tensors if position is None else [
            t for t in tree_leaves(args[position]) if isinstance(t, torch.Tensor)]
        count = self.collectives[(self.phase, backend)]
        count.calls += 1
        count.bytes += sum(t.numel() * t.element_size() for t in payload)
        count.sites.add(site)

    def summary(self) -> dict:
        """{phase: {backend: {"calls", "bytes"[, "sites"]}}}: gloo calls list their sites."""
        out: dict = {}
        for (phase, backend), count in sorted(self.collectives.items()):
            out.setdefault(phase, {})[backend] = count.to_dict(with_sites=backend == "gloo")
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _LOCAL_SCALAR:
            return self._unanswered(args[0])
        if _on_real_meta_only(args):  # shapes the code asked for: no memory (fake_cuda)
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        if func.namespace == "c10d":
            self._check(func, args, kwargs)
            if func in _COALESCED:  # no fake kernel in torch: what the fake backend does
                return FakeWork().boxed()
        out = func(*args, **kwargs)
        if self.memory is not None and self.memory.tracking:
            self.memory.track_outputs(out)
        return out
