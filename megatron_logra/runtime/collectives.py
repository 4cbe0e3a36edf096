"""Rank 0 decides, every rank learns it: the package's one "compute on rank 0, then
broadcast".

``from_rank0(fn)``: rank ``src`` calls ``fn()``; its value, or the exception it raised,
reaches every rank of the group, so no rank waits in a later collective for a rank that
gave up. ``rank0_value(value)``: rank 0's ``value`` on every rank, for a decision rank 0
made in place (a failure message beside a result only rank 0 keeps).

A collective that waits past the default group's timeout (gloo: "Timed out waiting
...") raises ``CollectiveTimeout``, naming ``--distributed-timeout-minutes``: the usual
cause is rank 0 alone in a long phase (an engine start, an evaluation) while the others
wait here.

Where the objects travel is torch's choice (``broadcast_object_list`` without
``device``): over the group's CPU backend when it has one, else over its CUDA backend on
``torch.cuda.current_device()``, which ``device.init_runtime`` sets to this process's GPU
(a NCCL-only group refuses CPU tensors). The default group on CUDA is
``cpu:gloo,cuda:nccl`` (``device.collective_backend``) and megatron-core's groups inherit
both, so a decision never meets NCCL and never waits behind the model's CUDA work.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


class CollectiveTimeout(RuntimeError):
    """A collective waited past the default group's timeout; the message names the flag."""


def _bounded(collective: Callable[[], T]) -> T:
    """``collective()``, its timeout re-raised as ``CollectiveTimeout`` with the fix."""
    try:
        return collective()
    except RuntimeError as exc:
        text = str(exc).lower()
        if "timed out" not in text and "timeout" not in text:
            raise
        from megatron_logra.runtime.device import collective_timeout_minutes

        minutes = collective_timeout_minutes()
        now = f" (now {minutes:g} min)" if minutes is not None else ""
        raise CollectiveTimeout(
            f"{exc}: a collective waited longer than the default process group's "
            f"timeout{now}, most likely for rank 0 alone in a long phase (a rollout engine "
            f"start, an evaluation); raise --distributed-timeout-minutes") from exc


class Rank0Error(RuntimeError):
    """Raised on the other ranks for an exception of rank ``src`` that cannot be re-created
    there (its class cannot be pickled, or takes other arguments than its ``args``):
    ``kind`` is its type's name, ``message`` its ``str``."""

    def __init__(self, kind: str, message: str, src: int = 0):
        super().__init__(f"{kind} on rank {src}: {message}")
        self.kind, self.message, self.src = kind, message, src


def from_rank0(fn: Callable[[], T], *, group: dist.ProcessGroup | None = None,
               src: int = 0) -> T:
    """Collective over ``group`` (the default group when None). Rank ``src`` (a global
    rank) calls ``fn()``, no other rank does; every rank returns its value, which must be
    picklable (``src`` returns the object itself, the others an unpickled copy). An
    ``Exception`` raised by ``fn`` (or by pickling its value) is raised on every rank: on
    ``src`` the exception itself, elsewhere a copy of the same type and message, or a
    ``Rank0Error`` where it cannot be re-created. Without torch.distributed, or in a group
    of one, it is ``fn()``."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return fn()
    here = dist.get_rank()
    message: list = [None]  # src: (True, the pickled value) or (False, _describe(exc))
    value, error = None, None
    if here == src:
        try:
            value = fn()
            message[0] = (True, pickle.dumps(value))
        except Exception as exc:  # noqa: BLE001 - every rank raises it, below
            error = exc
            message[0] = (False, _describe(exc))
    _bounded(lambda: dist.broadcast_object_list(message, src=src, group=group))
    ok, body = message[0]
    if here == src:
        if error is not None:
            raise error
        return value
    if ok:
        return pickle.loads(body)
    raise _rebuild(*body, src=src)


def rank0_value(value: T, *, group: dist.ProcessGroup | None = None, src: int = 0) -> T:
    """Collective: rank ``src``'s ``value`` on every rank (what the others pass is
    ignored)."""
    return from_rank0(lambda: value, group=group, src=src)


def every_rank(value: T, *, group: dist.ProcessGroup | None = None) -> list[T]:
    """Collective: every rank's ``value`` (picklable), in rank order; ``[value]`` without
    torch.distributed."""
    if not dist.is_initialized():
        return [value]
    values: list = [None] * dist.get_world_size(group)
    _bounded(lambda: dist.all_gather_object(values, value, group=group))
    return values


def rank_and_world() -> tuple[int, int]:
    """(this process's global rank, the world size); (0, 1) without torch.distributed."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def barrier() -> None:
    """``dist.barrier()`` where torch.distributed is up (a no-op in one plain process)."""
    if dist.is_initialized():
        _bounded(dist.barrier)


def _describe(exc: Exception) -> tuple[bytes | None, str, str]:
    """(the pickled exception, or None where it would not come back the same; its type's
    name; its message)."""
    try:
        blob = pickle.dumps(exc)
        back = pickle.loads(blob)
        if type(back) is not type(exc) or str(back) != str(exc):
            blob = None
    except Exception:  # noqa: BLE001 - whatever fails, the other ranks get a Rank0Error
        blob = None
    return blob, type(exc).__name__, str(exc)


def _rebuild(blob: bytes | None, kind: str, message: str, *, src: int) -> Exception:
    if blob is None:
        return Rank0Error(kind, message, src)
    try:
        return pickle.loads(blob)
    except Exception:  # noqa: BLE001 - a class this rank cannot import
        return Rank0Error(kind, message, src)
