"""One process as rank r of a world of N GPUs, on torch's fake process-group backend.

The fake backend (``torch.testing._internal.distributed.fake_pg``) lets one process be
any rank of any world: collectives return at once and touch nothing. It is registered
here twice, under the name of each real backend it stands for (``dryrun_nccl`` for
CUDA tensors, ``dryrun_gloo`` for CPU ones), and the world is made with the backend
string a real CUDA run uses (``runtime.device.collective_backend``: ``cpu:gloo,cuda:nccl``)
with those names in: so every group, megatron-core's included (they inherit the world's),
knows which real backend serves each device, as in the real run, and a CPU tensor in a
group that NCCL alone serves finds no backend, as it would not. ``real_backends(group)``
reads that back (``dry_run.checks``).

A group made with a backend named (megatron-core's gloo twins of its groups, the weight
channel's group) gets that backend's fake twin (``new_group`` is wrapped while the world
lives), so it too is served as in the real run.

Object collectives carry Python objects that only the other ranks have. Inside the world
``all_gather_object`` answers every rank's object with this rank's (megatron-core's
optimizer aligns its param groups that way: alike on every rank of a uniform model), and
so does ``gather_object``; a ``broadcast_object_list`` from another rank cannot be
answered and raises, naming it. Each answer is listed (``object_collectives``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_logra.dry_run.call_sites import call_site
from megatron_logra.runtime.device import Runtime, adopt_runtime, collective_backend
from megatron_logra.runtime.parallel import ParallelConfig

CUDA = torch.device("cuda", 0)
FAKE_NAMES = {"gloo": "dryrun_gloo", "nccl": "dryrun_nccl"}  # real backend -> its fake twin
REAL_NAMES = {fake: real for real, fake in FAKE_NAMES.items()}


def _register_backends() -> None:
    from torch.testing._internal.distributed.fake_pg import _create_fake_pg

    for real, fake in FAKE_NAMES.items():
        if not hasattr(dist.Backend, fake.upper()):
            dist.Backend.register_backend(fake, _create_fake_pg, extended_api=True,
                                          devices=["cuda"] if real == "nccl" else ["cpu"])


def fake_backend_string(real: str) -> str:
    """``real`` ("cpu:gloo,cuda:nccl", "nccl", ...) with each backend named by its fake
    twin."""
    parts = []
    for part in real.split(","):
        device, _, backend = part.rpartition(":")
        parts.append(f"{device}:{FAKE_NAMES[backend]}" if device else FAKE_NAMES[backend])
    return ",".join(parts)


def real_backends(group) -> dict[str, str]:
    """{device type: real backend} of a process group of the fake world."""
    config = str(dist.get_backend_config(group))
    out = {}
    for part in config.split(","):
        device, _, backend = part.strip().rpartition(":")
        out[device] = REAL_NAMES.get(backend, backend)
    return out


@dataclass(frozen=True)
class Coordinates:
    """Where a rank sits in the layout (megatron-core's ranks in its groups)."""

    rank: int
    tp: int
    pp: int
    dp: int

    def to_dict(self) -> dict:
        return {"rank": self.rank, "tp": self.tp, "pp": self.pp, "dp": self.dp}


def coordinates() -> Coordinates:
    from megatron.core import parallel_state

    return Coordinates(dist.get_rank(), parallel_state.get_tensor_model_parallel_rank(),
                       parallel_state.get_pipeline_model_parallel_rank(),
                       parallel_state.get_data_parallel_rank())


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, parallel: ParallelConfig,
               gpus_per_node: int = 8) -> Iterator[Coordinates]:
    """This process as global ``rank`` of ``world_size`` CUDA ranks (``gpus_per_node`` to a
    node: its local rank), megatron-core's groups for ``parallel`` made; undone on exit."""
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("torch.distributed is initialised in this process already: the "
                           "dry run makes its own fake world")
    parallel.validate(world_size)
    _register_backends()
    backend = collective_backend(CUDA)
    dist.init_process_group(fake_backend_string(backend), store=FakeStore(), rank=rank,
                            world_size=world_size)
    adopt_runtime(Runtime(device=CUDA, backend=backend, rank=rank, world_size=world_size,
                          local_rank=rank % gpus_per_node))
    real_new_group = dist.new_group

    def new_group(*args, backend=None, **kwargs):
        if isinstance(backend, str) and backend not in REAL_NAMES:
            backend = fake_backend_string(backend)
        return real_new_group(*args, backend=backend, **kwargs)

    dist.new_group = new_group
    object_collectives.clear()
    saved = {name: getattr(dist, name) for name in _OBJECT_COLLECTIVES}
    for name, fn in _OBJECT_COLLECTIVES.items():
        setattr(dist, name, fn)
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size)
        yield coordinates()
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        dist.new_group = real_new_group
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        adopt_runtime(None)
        dist.destroy_process_group()


object_collectives: list[dict] = []  # what the world answered: {"call", "site"}


def _note(call: str) -> None:
    object_collectives.append({"call": call, "site": call_site()})


def _all_gather_object(object_list, obj, group=None):
    _note("all_gather_object: every rank's object taken as this rank's")
    object_list[:] = [copy.deepcopy(obj) for _ in object_list]


def _gather_object(obj, object_gather_list=None, dst=None, group=None, group_dst=None):
    _note("gather_object: every rank's object taken as this rank's")
    if object_gather_list is not None:
        object_gather_list[:] = [copy.deepcopy(obj) for _ in object_gather_list]


def _broadcast_object_list(object_list, src=None, group=None, device=None, group_src=None):
    source = src if src is not None else dist.get_global_rank(group, group_src or 0)
    if source != dist.get_rank():
        raise RuntimeError(f"{call_site()}: broadcast_object_list from rank {source}: the "
                           f"dry run traces one rank and has not rank {source}'s objects")
    _note("broadcast_object_list from this rank")


_OBJECT_COLLECTIVES = {"all_gather_object": _all_gather_object,
                       "gather_object": _gather_object,
                       "broadcast_object_list": _broadcast_object_list}
