"""Fault injection for the fault-tolerance tests and benchmark (off unless the variable is set).

``MEGATRON_LOGRA_FAULT="POINT@UPDATE[:RANK]"`` makes RANK (default 0) die at POINT of
update UPDATE (1-based, as ``metrics.jsonl``'s ``step``), in the first attempt of the job
only (``TORCHELASTIC_RESTART_COUNT`` 0), so a run under ``torchrun --max-restarts N``
dies once and then recovers. Points:

- ``rollout``, ``backward``, ``optimizer``, ``sync``: the process exits at once
  (``os._exit``: no cleanup, as a killed process);
- ``save``: the process exits in the middle of writing that update's checkpoint;
- ``save-enospc``: finishing that update's checkpoint (rank 0 writes its metadata file)
  raises ``OSError(ENOSPC)``, as a disk that filled up during the save would (the
  process lives). Give RANK 0.
"""

from __future__ import annotations

import errno
import os

ENV = "MEGATRON_LOGRA_FAULT"
POINTS = ("rollout", "backward", "optimizer", "sync", "save", "save-enospc")
EXIT_CODE = 17


def _planned() -> tuple[str, int, int] | None:
    spec = os.environ.get(ENV, "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return None
    point, _, rest = spec.partition("@")
    update, _, rank = rest.partition(":")
    if point not in POINTS or not update.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected POINT@UPDATE[:RANK] with POINT one of "
                         f"{', '.join(POINTS)}")
    return point, int(update), int(rank or 0)


def maybe_fail(point: str, update: int) -> None:
    """Die (or raise, for ``save-enospc``) if the plan says so for this rank."""
    plan = _planned()
    if plan is None or plan[:2] != (point, update):
        return
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank != plan[2]:
        return
    if point == "save-enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})")
    print(f"[fault] rank {rank} dies at {point} of update {update} ({ENV})", flush=True)
    os._exit(EXIT_CODE)
