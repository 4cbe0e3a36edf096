"""Fault injection for the fault-tolerance tests and benchmark (off unless the variable is set).

``MEGATRON_LOGRA_FAULT="POINT@UPDATE[:RANK][,POINT@UPDATE...]"`` plans one or more faults
at update UPDATE (1-based, as ``metrics.jsonl``'s ``step``), in the first attempt of the
job only (``TORCHELASTIC_RESTART_COUNT`` 0), so a run under ``torchrun --max-restarts N``
dies once and then recovers. Trainer points (RANK, default 0, is the one that fails):

- ``rollout``, ``backward``, ``optimizer``, ``sync``: the process exits at once
  (``os._exit``: no cleanup, as a killed process);
- ``save``: the process exits in the middle of writing that update's checkpoint;
- ``save-enospc``: finishing that update's checkpoint (rank 0 writes its metadata file)
  raises ``OSError(ENOSPC)``, as a disk that filled up during the save would (the
  process lives). Give RANK 0.

Engine points (the rollout engine process exits at once, ``os._exit``). The k-th engine
fault of the plan is injected into the k-th engine the trainer starts, so each restart
recovers and the next planned engine fault can still happen:

- ``engine-generate``: during update UPDATE's rollouts, once the first sample is done;
- ``engine-full-push``: during the full push of UPDATE's weights, after the first bucket
  was loaded into vLLM, before the commit;
- ``engine-delta-push``: during the delta push of UPDATE's weights, after the workers
  applied it and before it was committed.
"""

from __future__ import annotations

import errno
import os

ENV = "MEGATRON_LOGRA_FAULT"
TRAINER_POINTS = ("rollout", "backward", "optimizer", "sync", "save", "save-enospc")
ENGINE_POINTS = ("engine-generate", "engine-full-push", "engine-delta-push")
POINTS = TRAINER_POINTS + ENGINE_POINTS
EXIT_CODE = 17


def planned() -> list[tuple[str, int, int]]:
    """The faults planned for this attempt of the job: [(point, update, rank)]."""
    spec = os.environ.get(ENV, "")
    if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return []
    out = []
    for one in spec.split(","):
        point, _, rest = one.strip().partition("@")
        update, _, rank = rest.partition(":")
        if point not in POINTS or not update.isdigit() or not (rank or "0").isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected POINT@UPDATE[:RANK][,...] with POINT "
                             f"one of {', '.join(POINTS)}")
        out.append((point, int(update), int(rank or 0)))
    return out


def maybe_fail(point: str, update: int) -> None:
    """Die (or raise, for ``save-enospc``) if the plan says so for this rank."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    if (point, update, rank) not in planned():
        return
    if point == "save-enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {ENV})")
    _die(f"rank {rank}", point, update)


def engine_fault_due(point: str, update: int, engine_start: int) -> bool:
    """Whether the plan has the ``engine_start``-th engine (1 for the first engine the
    trainer started, 2 for the one after its first restart, ...) die at ``point`` of
    ``update``."""
    mine = [(p, u) for p, u, _ in planned() if p in ENGINE_POINTS]
    return engine_start <= len(mine) and mine[engine_start - 1] == (point, update)


def engine_fault(point: str, update: int, engine_start: int) -> None:
    """In the engine process: die if the plan says so (``engine_fault_due``)."""
    if engine_fault_due(point, update, engine_start):
        _die(f"the rollout engine (start {engine_start})", point, update)


def _die(who: str, point: str, update: int) -> None:
    print(f"[fault] {who} dies at {point} of update {update} ({ENV})", flush=True)
    os._exit(EXIT_CODE)
