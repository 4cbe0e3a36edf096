"""One progress line per phase of long work (rollouts, evaluation, weight sync, conversion).

On a terminal the line is rewritten in place (``\\r``) at most every 0.2 s and cleared when
the phase ends, unless the phase ran longer than ``PROGRESS_INTERVAL_S``, whose final line
stays. When the output is a file or a pipe (torchrun logs, CI) nothing is written for a
phase that ends within that interval; a longer one writes a line each interval and a final
one, so logs show long work without a line per second. The interval is 30 s
(``MEGATRON_LOGRA_PROGRESS_INTERVAL`` overrides it; 0 writes every line, for tests).
Create it on the logging rank only (``enabled``).
"""

from __future__ import annotations

import os
import sys
import time
from typing import TextIO

PROGRESS_INTERVAL_S = 30.0
_TTY_REFRESH_S = 0.2


def _interval() -> float:
    return float(os.environ.get("MEGATRON_LOGRA_PROGRESS_INTERVAL", PROGRESS_INTERVAL_S))


class Progress:
    """``update(done, note)`` as work completes; ``close(note)`` at the end (or use
    ``with``). ``total`` may be None (unknown)."""

    def __init__(self, phase: str, total: int | None, unit: str, *, enabled: bool = True,
                 stream: TextIO | None = None):
        self.phase, self.total, self.unit, self.enabled = phase, total, unit, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = _interval()
        self.start = self._last = time.perf_counter()
        self.done, self.note, self.lines = 0, "", 0

    def text(self) -> str:
        elapsed = time.perf_counter() - self.start
        count = f"{self.done}/{self.total}" if self.total is not None else f"{self.done}"
        rate = f", {self.done / elapsed:.1f} {self.unit}/s" if elapsed > 0 and self.done else ""
        note = f" | {self.note}" if self.note else ""
        return f"[{self.phase}] {count} {self.unit}{rate}{note} ({elapsed:.0f}s)"

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = done, note or self.note
        if not self.enabled:
            return
        now = time.perf_counter()
        if self.tty and now - self._last >= _TTY_REFRESH_S:
            self.stream.write("\r\033[K" + self.text())
            self.stream.flush()
            self._last = now
        elif not self.tty and now - self._last >= self.interval:
            self._line()
            self._last = now

    def _line(self) -> None:
        print(self.text(), file=self.stream, flush=True)
        self.lines += 1

    def close(self, note: str = "") -> None:
        if not self.enabled:
            return
        self.note = note or self.note
        long = time.perf_counter() - self.start >= self.interval
        if self.tty:
            self.stream.write("\r\033[K" + (self.text() + "\n" if long else ""))
            self.stream.flush()
        elif long or self.lines:
            self._line()
        self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
