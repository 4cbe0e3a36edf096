"""Verifier rewards for the task items of ``data.tasks`` (reasoning-gym scorers, math-verify).

``Verifier`` scores responses in a separate, sandboxed process (``runtime.sandbox``) with
a timeout per answer, so a scorer that hangs, crashes, raises, runs out of its memory
cap, floods its output, writes outside its scratch directory or returns something other
than a finite number costs one reward of 0 (logged), never the run.

Reward: binary correctness (``score == 1.0``, reasoning-gym's partial credit
does not count) by default, or the partial score with ``reward="partial"``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import numbers
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

from megatron_logra.data.tasks import MATH, TaskItem
from megatron_logra.rl.config import VerifierConfig
from megatron_logra.runtime.processes import die_with_parent
from megatron_logra.runtime.sandbox import SandboxLimits, enter_sandbox

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(response: str) -> str:
    """The last <answer>...</answer> of a response, else the whole response, stripped."""
    tagged = _ANSWER_TAG.findall(response)
    return (tagged[-1] if tagged else response).strip()


def score_one(task: str, answer: str, entry: dict) -> float:
    """The task's own score of ``answer`` in [0, 1] (raises what the scorer raises)."""
    if task == MATH:
        from math_verify import parse, verify

        gold = parse(f"${entry['answer']}$", parsing_timeout=None)
        return float(verify(gold, parse(answer, parsing_timeout=None), timeout_seconds=None))
    import reasoning_gym

    dataset = _SCORERS.get(task) or _SCORERS.setdefault(
        task, reasoning_gym.create_dataset(task, size=1, seed=0))
    return float(dataset.score_answer(answer, entry))


_SCORERS: dict = {}


def _serve(conn, score_fn, scratch: str, limits: SandboxLimits) -> None:
    """The scoring process: (task, answer, entry) -> ("ok", score) | ("error", message).
    It runs sandboxed (``runtime.sandbox``), its output goes to ``scratch``/output.log
    (a flood of it fails that answer once the file reaches ``limits.file_mb``), and a
    score must be a finite number."""
    die_with_parent()
    log = os.open(os.path.join(scratch, OUTPUT_LOG), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    enter_sandbox(scratch, limits)
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(("ok", _finite_score(score_fn(*job))))
        except Exception as exc:  # noqa: BLE001 - a scorer's failure scores 0
            conn.send(("error", f"{type(exc).__name__}: {exc}"[:500]))


OUTPUT_LOG = "output.log"


def _finite_score(value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value):
        raise TypeError(f"the scorer returned {value!r:.80}, not a finite number")
    return float(value)


@dataclass
class ScoreResult:
    reward: float
    score: float  # the scorer's own score (0 on failure)
    status: str  # ok | timeout | error: ...


class Verifier:
    """Scores responses in a child process; restarts it after a timeout or a crash."""

    def __init__(self, cfg: VerifierConfig, score_fn: Callable[[str, str, dict], float] = score_one):
        """``score_fn(task, answer, entry) -> score``: a module-level function (the child
        process imports it by name); tests pass scorers that hang, crash or raise."""
        self.cfg, self.score_fn = cfg, score_fn
        self._proc = self._conn = self._scratch = None
        self.failures: list[str] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._scratch = tempfile.mkdtemp(prefix="verifier_")
        self._proc = ctx.Process(target=_serve, daemon=True,
                                 args=(child, self.score_fn, self._scratch, self.cfg.limits))
        self._proc.start()
        child.close()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
        self._proc = self._conn = self._scratch = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(2)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def score(self, item: TaskItem, response: str) -> ScoreResult:
        answer = extract_answer(response)[: self.cfg.max_answer_chars]
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((item.task, answer, item.entry))
            if not self._conn.poll(self.cfg.timeout):
                self._kill()
                return self._failed(item, "timeout")
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            last_words = self._output_tail()
            self._kill()
            return self._failed(item, f"error: scorer process died ({type(exc).__name__})"
                                + (f"; its last output: {last_words}" if last_words else ""))
        if status != "ok":
            return self._failed(item, f"error: {value}")
        score = min(max(float(value), 0.0), 1.0)
        reward = score if self.cfg.reward == "partial" else float(score >= 1.0)
        return ScoreResult(reward, score, "ok")

    def _output_tail(self, chars: int = 300) -> str:
        try:
            with open(os.path.join(self._scratch, OUTPUT_LOG), "rb") as f:
                f.seek(max(os.fstat(f.fileno()).st_size - chars, 0))
                return f.read().decode(errors="replace").strip()
        except (OSError, TypeError):
            return ""

    def _failed(self, item: TaskItem, status: str) -> ScoreResult:
        message = f"scorer of {item.task} item {item.index}: {status} (reward 0)"
        self.failures.append(message)
        print(f"[verifier] {message}", file=sys.stderr, flush=True)
        return ScoreResult(0.0, 0.0, status)
