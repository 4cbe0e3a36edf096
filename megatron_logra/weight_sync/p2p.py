"""A torch.distributed group between the trainer ranks and the vLLM workers (direct channel).

Neither side's default group can hold the other: the trainer's world is its own ranks,
and every vLLM worker already sits in vLLM's world. So the group is a standalone backend
object (``ProcessGroupGloo`` on CPU, ``ProcessGroupNCCL`` on CUDA) over a ``TCPStore``
served by trainer rank 0, as vLLM's ``stateless_init_torch_distributed_process_group``
(used by NeMo-RL, OpenRLHF and TRL for the same purpose) builds it; it touches no global
state. Group ranks: trainer rank r is r, engine TP rank t is ``trainers + t``.

A message is (meta, tensors): a length, the pickled (meta, tensor specs), then each
tensor raw. Point-to-point only, in a fixed order per pair, so a receiver needs no
plan of its own.

A NCCL group on CUDA:

- before NCCL is asked, every member writes its GPU's UUID to the store and reads the
  others' (``exchange_gpu_ids``): NCCL refuses two members of one communicator on one GPU
  ("Duplicate GPU detected"), which is what a server at ``--rollout-engine-url`` on the
  trainer's own GPUs would give. Where two members share a GPU every member builds a
  gloo group instead (the same decision everywhere: each sees every UUID), and messages
  go through host memory (``message_device``);
- it is built with ``TORCH_NCCL_BLOCKING_WAIT=1`` (``NCCL_GROUP_ENV``, set only while
  torch reads it, in ``ProcessGroupNCCL``'s constructor): torch starts no watchdog thread
  for the group, so a dead peer makes the bounded wait (``wait_all``) abort the
  communicator and raise a ``DistBackendError`` in the waiting thread, which the channel
  handles (a restart), and nothing of torch's takes the process down for it. Without it
  the group's watchdog sees the failed work, sets the process-wide dump flag, and the
  default group's heartbeat monitor terminates the process (after
  ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``), whatever ``TORCH_NCCL_ASYNC_ERROR_HANDLING``
  (torchrun sets 1: tear down) says; the default group keeps torchrun's settings.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

NCCL_GROUP_ENV = {"TORCH_NCCL_BLOCKING_WAIT": "1"}
"""What the weight group's ``ProcessGroupNCCL`` is built under (read once, per group, by
its constructor; torch 2.6+: no watchdog thread, no queued work, a failed wait raises in
the caller; see the module doc)."""


@dataclass(frozen=True)
class GroupAddress:
    """Everything a member needs to join (JSON-able: it travels in vLLM's init info)."""

    host: str  # where trainer rank 0's store listens
    port: int
    prefix: str  # one per engine start: a restarted engine joins a fresh group
    trainers: int  # trainer ranks (group ranks 0..trainers-1)
    workers: int  # engine TP ranks (group ranks trainers..)
    backend: str  # gloo | nccl
    timeout_s: float = 300.0  # joining, and each message

    @property
    def size(self) -> int:
        return self.trainers + self.workers


def open_store(address: GroupAddress, master: bool) -> dist.TCPStore:
    """Trainer rank 0 serves the store (``master``); every other member connects."""
    return dist.TCPStore(address.host, address.port, None, master,
                         timedelta(seconds=address.timeout_s), wait_for_workers=False)


def join_group(address: GroupAddress, rank: int, store: dist.TCPStore | None = None,
               device: torch.device | None = None):
    """This member's backend of the group (blocks until every member joined). A NCCL group
    needs ``device``, this member's GPU; it becomes gloo where two members share a GPU
    (said once, by group rank 0), and is built under ``NCCL_GROUP_ENV`` otherwise."""
    store = store if store is not None else open_store(address, master=False)
    prefixed = dist.PrefixStore(address.prefix, store)
    timeout = timedelta(seconds=address.timeout_s)
    if address.backend not in ("gloo", "nccl"):
        raise ValueError(f"direct weight channel: backend {address.backend!r} (gloo or nccl)")
    backend = address.backend
    if backend == "nccl":
        if device is None:
            raise ValueError("a NCCL weight group needs this member's CUDA device")
        uuids = exchange_gpu_ids(prefixed, rank, address.size, gpu_uuid(device))
        shared = shared_gpus(uuids)
        if shared:
            backend = "gloo"
            if rank == 0:
                print(f"weight group: {shared_note(shared, address.trainers)}; NCCL refuses two "
                      f"members on one GPU, so pushes go through host memory (gloo)",
                      flush=True)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    # each bounded wait (``wait_all``) raises first; NCCL's own limit is past them
    options._timeout = timeout * 2 + timedelta(seconds=60)
    with environment(NCCL_GROUP_ENV):
        group = dist.ProcessGroupNCCL(prefixed, rank, address.size, options)
    group.eager_connect_single_device(device)  # NCCL connects lazily: bind it to this GPU
    return group


def gpu_uuid(device: torch.device) -> str:
    """The UUID of the GPU ``device`` is (the same GPU seen from any process)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def exchange_gpu_ids(store, rank: int, size: int, mine: str) -> list[str]:
    """Every member's GPU UUID, by group rank: each writes its own and reads the others'
    (``store``: the group's; each read waits, within the store's timeout, for its
    writer)."""
    gpus = dist.PrefixStore("gpus/", store)
    gpus.set(str(rank), mine)
    return [gpus.get(str(r)).decode() for r in range(size)]


def shared_gpus(uuids: list[str]) -> dict[str, list[int]]:
    """UUID -> the group ranks on it, for each GPU that holds more than one member."""
    ranks: dict[str, list[int]] = {}
    for r, uuid in enumerate(uuids):
        ranks.setdefault(uuid, []).append(r)
    return {uuid: on for uuid, on in ranks.items() if len(on) > 1}


def shared_note(shared: dict[str, list[int]], trainers: int) -> str:
    """"trainer rank 0 and engine worker 0 share GPU <uuid>; ..." (group ranks below
    ``trainers`` are trainer ranks, the others engine TP ranks)."""
    def who(r: int) -> str:
        return f"trainer rank {r}" if r < trainers else f"engine worker {r - trainers}"
    return "; ".join(f"{' and '.join(map(who, on))} share GPU {uuid}"
                     for uuid, on in shared.items())


def message_device(group, device: torch.device | None) -> torch.device:
    """Where the tensors of ``group``'s messages live: the host for gloo (a NCCL group
    that became gloo too), ``device`` for NCCL."""
    if device is None or group is None or isinstance(group, dist.ProcessGroupGloo):
        return torch.device("cpu")
    return device


@contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` inside the block; each variable's earlier value, or
    its absence, back after it (an exception included)."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def send_message(group, dst: int, meta, tensors: list[torch.Tensor],
                 device: torch.device) -> tuple[list, int]:
    """Post the sends of one message to group rank ``dst``: (works to wait on, bytes).
    ``tensors`` must be on ``device`` (NCCL: the CUDA device; gloo: cpu)."""
    specs = [(t.dtype, t.numel()) for t in tensors]
    header = torch.frombuffer(bytearray(pickle.dumps((meta, specs))), dtype=torch.uint8)
    parts = [torch.tensor([header.numel()], dtype=torch.int64, device=device),
             header.to(device)] + [t.contiguous().view(-1) for t in tensors if t.numel()]
    works = [group.send([p], dst, 0) for p in parts]
    return works, sum(p.numel() * p.element_size() for p in parts)


def wait_all(works: list, timeout_s: float) -> None:
    """Wait for posted sends or receives, each at most ``timeout_s``. gloo raises at once
    when the peer's sockets close (a dead engine: "connection closed by peer"); NCCL does
    not notice a dead peer by itself, and its wait with a timeout aborts the communicator
    and raises (``DistBackendError``, a RuntimeError) once the limit passes, in this
    thread (``NCCL_GROUP_ENV``: no watchdog of the group's to act on it as well): either
    way the caller sees a RuntimeError and takes the engine-restart path, never an
    unbounded hang nor a process teardown."""
    limit = timedelta(seconds=timeout_s)
    for work in works:
        work.wait(limit)


def abort_group(group) -> None:
    """Drop a group after a failure: NCCL's communicator is aborted (its kernels may be
    stuck on the dead peer); gloo's sockets close when the object goes."""
    abort = getattr(group, "abort", None)
    if group is not None and callable(abort) and not isinstance(group, dist.ProcessGroupGloo):
        abort()


def recv_message(group, src: int, device: torch.device,
                 timeout_s: float = GroupAddress.timeout_s):
    """One message from group rank ``src``: (meta, tensors on ``device``, bytes)."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    wait_all([group.recv([length], src, 0)], timeout_s)
    header = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    wait_all([group.recv([header], src, 0)], timeout_s)
    meta, specs = pickle.loads(header.cpu().numpy().tobytes())
    tensors = []
    for dtype, numel in specs:
        t = torch.empty(numel, dtype=dtype, device=device)
        if numel:
            wait_all([group.recv([t], src, 0)], timeout_s)
        tensors.append(t)
    size = 8 + header.numel() + sum(t.numel() * t.element_size() for t in tensors)
    return meta, tensors, size

