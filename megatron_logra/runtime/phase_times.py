"""Wall time per phase of a train step, for benchmarks/step_time.py (off by default).

    from megatron_logra.runtime.phase_times import PHASES
    with PHASES("forward_backward"):
        ...

Disabled (the default) a phase costs one attribute check. Enabled, each phase is
bracketed by device synchronisation (CUDA kernels are asynchronous) and its seconds
are added to ``PHASES.seconds[name]``; nested phases are counted in both.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class PhaseTimes:
    def __init__(self) -> None:
        self.enabled = False
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        from megatron_logra.runtime.device import synchronize

        synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize()
            self.seconds[name] += time.perf_counter() - start

    def take(self) -> dict[str, float]:
        """The seconds per phase since the last take, and a fresh count."""
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


PHASES = PhaseTimes()
