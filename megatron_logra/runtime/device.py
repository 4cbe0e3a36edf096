"""The one place that decides device and collective backend.

CUDA with NCCL when a GPU is visible, else CPU with gloo. Everything else asks
``current_device()``; nothing in the package hard-codes a device. On CPU the
megatron-core shims (``megatron_shims.apply_cpu_shims``) are applied here, once.

On CUDA the default group is ``cpu:gloo,cuda:nccl`` (``collective_backend``): each
collective runs on the backend of its tensors' device, so a control flag built on the
CPU, an object broadcast (torch sends those over the group's CPU backend) or a CPU relay
of weights goes over gloo, and the model's tensors over NCCL. A NCCL-only group refuses
CPU tensors ("No backend type associated with device type cpu"). megatron-core's groups
are created without a backend and so inherit both.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Runtime:
    """Where this process computes and how it talks to the others."""

    device: torch.device
    backend: str  # "gloo", or "cpu:gloo,cuda:nccl" on CUDA (``collective_backend``)
    rank: int
    world_size: int
    local_rank: int
    timeout_minutes: float = 10.0  # the default group's (--distributed-timeout-minutes)

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


_RUNTIME: Runtime | None = None


def collective_backend(device: torch.device) -> str:
    """The default group's backend for ``device``: gloo on CPU; on CUDA NCCL for CUDA
    tensors and gloo for CPU ones (control flags, object collectives, CPU relays)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def select_device(force: str | None = None) -> torch.device:
    """cuda:LOCAL_RANK when CUDA is available (or forced), else cpu."""
    choice = force or os.environ.get("MEGATRON_LOGRA_DEVICE")
    if choice not in (None, "", "auto", "cpu", "cuda"):
        raise ValueError(f"MEGATRON_LOGRA_DEVICE={choice!r}: use 'cpu', 'cuda' or 'auto'")
    if choice == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but torch sees no CUDA device; "
                           "drop the request to run on CPU with gloo")
    if choice == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def _restart_store(timeout: datetime.timedelta) -> dict:
    """store/rank/world_size for a job torchrun restarted (--max-restarts): its store
    still holds the dead attempt's keys, and gloo subgroups created under the same names
    would read the dead processes' addresses, so this attempt gets a key prefix of its own."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=not agent_store and rank == 0, timeout=timeout,
                          multi_tenant=not agent_store)
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    return {"store": dist.PrefixStore(f"megatron_logra/attempt_{attempt}/", store),
            "rank": rank, "world_size": world}


def init_runtime(timeout_minutes: float = 10.0) -> Runtime:
    """Initialise torch.distributed from torchrun's environment (or a single process), its
    collectives bounded by ``timeout_minutes`` (``--distributed-timeout-minutes`` in a
    run; 10, torch's default, for tools and benchmarks).

    Idempotent: later calls return the first Runtime. A process started without
    torchrun becomes a one-process group, so the same code path runs everywhere.
    """
    global _RUNTIME
    if _RUNTIME is not None:
        return _RUNTIME
    device = select_device()
    backend = collective_backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        from megatron_logra.runtime.megatron_shims import apply_cpu_shims

        apply_cpu_shims()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            dist.init_process_group(backend=backend, timeout=timeout,
                                    **_restart_store(timeout))
        elif "WORLD_SIZE" in os.environ:  # torchrun (or a caller that set env:// variables)
            dist.init_process_group(backend=backend, timeout=timeout)
        else:  # one process; nothing written to os.environ, so child processes inherit no port
            dist.init_process_group(backend=backend, timeout=timeout, rank=0, world_size=1,
                                    init_method=f"tcp://127.0.0.1:{free_port()}")
        atexit.register(shutdown_runtime)
    _RUNTIME = Runtime(device=device, backend=backend, rank=dist.get_rank(),
                       world_size=dist.get_world_size(),
                       local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                       timeout_minutes=timeout_minutes)
    return _RUNTIME


def adopt_runtime(runtime: Runtime | None) -> None:
    """Make ``runtime`` this process's, for a caller that set torch.distributed up itself
    (the dry run's fake world: ``dry_run.world``); None forgets it."""
    global _RUNTIME
    _RUNTIME = runtime


def collective_timeout_minutes() -> float | None:
    """The default group's timeout in minutes (None before ``init_runtime``)."""
    return None if _RUNTIME is None else _RUNTIME.timeout_minutes


def shutdown_runtime() -> None:
    """Free megatron-core's groups and the default process group (run at exit).

    A process group left alive until interpreter teardown lets gloo's C++ threads be
    destroyed while still joinable, and the process then dies in ``std::terminate``
    ("terminate called without an active exception") after its work is done.
    """
    global _RUNTIME
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is not None and parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _RUNTIME = None


def current_device() -> torch.device:
    """The device of this process (initialises nothing; cpu before init_runtime)."""
    return _RUNTIME.device if _RUNTIME is not None else select_device()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def peak_memory_bytes() -> int:
    """CUDA max allocated on GPU; the process's peak RSS on CPU."""
    if current_device().type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def synchronize() -> None:
    if current_device().type == "cuda":
        torch.cuda.synchronize()


def release_cached_memory() -> None:
    """Hand the allocator's cached, unused blocks back to the device (CUDA; nothing on
    CPU): a colocated rollout engine is about to take its turn on the same GPU."""
    if current_device().type == "cuda":
        torch.cuda.empty_cache()


def node_devices() -> list[int]:
    """What this node can give a dedicated rollout engine: its visible GPUs (indices)
    on CUDA, the cores this process may run on on CPU."""
    if current_device().type == "cuda":
        return list(range(torch.cuda.device_count()))
    return sorted(os.sched_getaffinity(0))
