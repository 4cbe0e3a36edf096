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
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


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
    """This member's backend of the group (blocks until every member joined)."""
    store = store if store is not None else open_store(address, master=False)
    prefixed = dist.PrefixStore(address.prefix, store)
    timeout = timedelta(seconds=address.timeout_s)
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, address.size, timeout)
    if address.backend != "nccl":
        raise ValueError(f"direct weight channel: backend {address.backend!r} (gloo or nccl)")
    options = dist.ProcessGroupNCCL.Options()
    # the watchdog's limit is set past the bounded waits (``wait_all``), so a dead peer
    # surfaces as an error in the waiting rank (the engine-restart path), not as the
    # watchdog tearing the trainer process down first
    options._timeout = timeout * 2 + timedelta(seconds=60)
    group = dist.ProcessGroupNCCL(prefixed, rank, address.size, options)
    if device is not None:  # NCCL connects lazily: bind the communicator to this device
        group.eager_connect_single_device(device)
    return group


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
    not notice a dead peer by itself, and its wait with a timeout raises
    (``DistBackendError``, a RuntimeError) once the limit passes: either way the caller
    sees a RuntimeError and takes the engine-restart path, never an unbounded hang."""
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

