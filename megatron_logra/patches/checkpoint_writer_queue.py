"""Patch: ``dist_checkpointing.strategies.filesystem_async._get_write_results_queue``
(megatron-core 0.16.x).

What it replaces: the first torch_dist save of a process starts a
``multiprocessing.Manager`` server (a spawned Python process, ~270 MB resident) for
the writers' results queue, and shuts it down only when the process exits normally.
A rank that dies (a fault, or torchrun tearing down a failed job) leaves that server
running as an orphan, one per dead rank and restart.

Fix: the same spawned Manager and queue, with the server process calling
``runtime.processes.die_with_parent`` first, so the kernel ends it with its rank.
Results are identical: the queue object and its use are unchanged.

Supported: megatron-core 0.16.x (checked against 0.16.1); another version is refused
(``runtime.versions``).
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing.managers import SyncManager

from megatron_logra.runtime import versions
from megatron_logra.runtime.processes import die_with_parent

@versions.patch_once("megatron_logra.patches.checkpoint_writer_queue")
def apply() -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def results_queue():
        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=mp.get_context("spawn"))
            manager.start(initializer=die_with_parent)
            filesystem_async._results_queue = manager.Queue()
        return filesystem_async._results_queue

    filesystem_async._get_write_results_queue = results_queue
