"""Progress lines: live on a terminal, quiet in logs for short phases, one line per
interval for long ones (``runtime.progress``)."""

from __future__ import annotations

import io

from megatron_logra.runtime.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream, steps=5, **kw):
    with Progress("rollouts", steps, "samples", stream=stream, **kw) as p:
        for k in range(1, steps + 1):
            p.update(k, "120 tokens/s out")
    return stream.getvalue()


def test_short_phase_writes_nothing_to_a_log(monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGRA_PROGRESS_INTERVAL", "30")
    assert _run(io.StringIO()) == ""


def test_long_phase_writes_lines_to_a_log(monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGRA_PROGRESS_INTERVAL", "0")  # every update is "long"
    lines = _run(io.StringIO()).splitlines()
    assert len(lines) == 6  # one per update, and the final one
    assert lines[-1].startswith("[rollouts] 5/5 samples, ") and "| 120 tokens/s out" in lines[-1]
    assert "\r" not in "".join(lines)


def test_terminal_line_is_rewritten_then_cleared(monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGRA_PROGRESS_INTERVAL", "30")
    out = _run(_Terminal())
    assert "\n" not in out and out.endswith("\r\033[K")  # a short phase leaves no line


def test_disabled_rank_writes_nothing(monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGRA_PROGRESS_INTERVAL", "0")
    assert _run(io.StringIO(), enabled=False) == ""
