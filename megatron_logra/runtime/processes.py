"""Helper processes that end with the process that started them.

A trainer rank killed by a fault (or by torchrun tearing a failed job down) runs no
cleanup, so a helper process it started would live on as an orphan: the rollout
engine, the scoring process, megatron-core's checkpoint-writer queue server. Each of
them calls ``die_with_parent()`` first thing.
"""

from __future__ import annotations

import ctypes
import os
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Linux: have the kernel SIGKILL this process when its parent (the thread that
    started it) dies (``PR_SET_PDEATHSIG``); a no-op elsewhere. A parent already gone
    (re-parented to init) ends this process at once."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux
        return
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)
