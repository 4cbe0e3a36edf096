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

megatron-core's groups are made without their gloo twins (``create_gloo_process_groups``:
the fake store cannot hold a gloo rendezvous); a real run uses those only to save and
load the distributed optimizer's state, which the dry run does not trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

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
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            create_gloo_process_groups=False)
        yield coordinates()
    finally:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        adopt_runtime(None)
        dist.destroy_process_group()
