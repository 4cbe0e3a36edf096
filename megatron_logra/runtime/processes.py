"""Helper processes that end with the process that started them.

A trainer rank killed by a fault (or by torchrun tearing a failed job down) runs no
cleanup, so a helper process it started would live on as an orphan: the rollout
engine, the scoring process, megatron-core's checkpoint-writer queue server. Each of
them calls ``die_with_parent()`` first thing. ``own_resource_tracker`` gives a process
its own multiprocessing resource tracker, so what it leaves in /dev/shm goes with it.
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


def own_resource_tracker() -> None:
    """Give this (spawned) process a multiprocessing resource tracker of its own, for it
    and the processes it starts, instead of its parent's.

    A tracker unlinks the shared memory and semaphores its processes leave behind once
    all of them have exited. vLLM's TP workers talk over shared-memory queues; in a
    rollout engine sharing its trainer rank's tracker, those segments would stay in
    /dev/shm until the trainer itself exits, two per engine (re)start. With its own
    tracker they go when the engine does, however it ends. (multiprocessing keeps the
    tracker in ``resource_tracker._resource_tracker`` and binds the module's functions
    to it; both are replaced.)"""
    from multiprocessing import resource_tracker

    tracker = resource_tracker.ResourceTracker()
    resource_tracker._resource_tracker = tracker
    for name in ("ensure_running", "register", "unregister", "getfd"):
        setattr(resource_tracker, name, getattr(tracker, name))
