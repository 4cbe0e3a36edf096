"""Small collectives the package's control flow shares.

Object collectives travel over the default group's CPU backend (gloo, also on CUDA:
``device.collective_backend``), so nothing here puts a tensor on a device.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

T = TypeVar("T")


def from_rank0(compute: Callable[[], T], errors: tuple[type[Exception], ...] = (ValueError,)
               ) -> T:
    """``compute()`` run on rank 0, its (picklable) value returned on every rank. An error
    of one of the ``errors`` types raised there is raised on every rank, with its type and
    message, so that no rank waits in a later collective for a rank that gave up."""
    out: list = [None, None]
    if dist.get_rank() == 0:
        try:
            out[0] = compute()
        except errors as exc:
            out[1] = (type(exc), str(exc))
    dist.broadcast_object_list(out, src=0)
    if out[1] is not None:
        kind, message = out[1]
        raise kind(message)
    return out[0]
