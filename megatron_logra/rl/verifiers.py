"""Verifier rewards: every reasoning-gym task by name, presets, and math answers.

``resolve_tasks("rg-hard")`` / ``resolve_tasks("basic_arithmetic,chain_sum:2")`` /
``resolve_tasks("math")`` name a task mixture; ``generate_rl_items`` makes its
items (codeio in a scratch subprocess, broken items filtered); ``Verifier``
scores responses in a separate process with a timeout per answer, so a scorer
that hangs, crashes or raises costs one reward of 0 (logged), never the run.

Reward: binary correctness (``score == 1.0``, reasoning-gym's partial credit
does not count) by default, or the partial score with ``reward="partial"``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

# The paper's Reasoning-Gym Hard mixture.
PRESETS = {"rg-hard": ("codeio", "emoji_mystery", "rectangle_count", "word_ladder",
                       "pool_matrix", "tsumego")}
MATH = "math"  # math-verify over problems shipped offline (champ-dataset)
EXCLUDED = {"game_of_life_halting": "its scorer gives any non-empty answer 1.0"}
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class VerifierConfig:
    reward: str = "binary"  # binary (score == 1.0) | partial (the scorer's score in [0, 1])
    timeout_s: float = 10.0  # per answer; a timeout scores 0
    max_answer_chars: int = 4000  # longer answers are cut before scoring


@dataclass(frozen=True)
class RLItem:
    task: str
    question: str
    answer: str  # the reference answer (for logs and SFT warm starts)
    entry: dict = field(repr=False)  # what the task's scorer needs (JSON-able)
    index: int


def resolve_tasks(spec: str) -> tuple[tuple[str, float], ...]:
    """'rg-hard' | 'math' | 'name[:weight],...' -> ((task, weight), ...), names checked."""
    if spec in PRESETS:
        return tuple((name, 1.0) for name in PRESETS[spec])
    import reasoning_gym.factory

    known = set(reasoning_gym.factory.DATASETS)
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name in EXCLUDED:
            raise ValueError(f"task {name!r} is excluded: {EXCLUDED[name]}")
        if name != MATH and name not in known:
            close = sorted(k for k in known if name[:4] in k)[:5]
            raise ValueError(f"unknown task {name!r}"
                             + (f" (did you mean {', '.join(close)}?)" if close else "")
                             + f": use a reasoning-gym task name (reasoning_gym.factory.DATASETS,"
                             f" {len(known)} known), a preset ({', '.join(PRESETS)}) or {MATH!r}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"task weight {weight!r} of {name!r} is not a number") from None
        if w <= 0:
            raise ValueError(f"task weight of {name!r} must be > 0, got {w}")
        out.append((name, w))
    if not out:
        raise ValueError(f"no task in {spec!r}")
    return tuple(out)


def _json_safe(entry: dict) -> dict:
    return json.loads(json.dumps(entry, default=str))


def _reasoning_gym_entries(name: str, count: int, seed: int) -> list[dict]:
    import reasoning_gym

    return [_json_safe(dict(e)) for e in reasoning_gym.create_dataset(name, size=count, seed=seed)]


def _generate_in_subprocess(name: str, count: int, seed: int) -> list[dict]:
    """codeio exec()s its samples while generating: do it in a child process in a scratch dir."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=f"{name}_gen_") as scratch, ctx.Pool(1) as pool:
        return pool.apply(_entries_in_dir, (name, count, seed, scratch))


def _entries_in_dir(name: str, count: int, seed: int, scratch: str) -> list[dict]:
    os.chdir(scratch)
    return _reasoning_gym_entries(name, count, seed)


def _math_entries(count: int, seed: int) -> list[dict]:
    import importlib.util
    import random

    spec = importlib.util.find_spec("champ_dataset")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("task 'math' needs the champ-dataset package: run `make setup`")
    path = os.path.join(spec.submodule_search_locations[0], "dataset_files", "v0.json")
    with open(path) as f:
        problems = list(json.load(f)["problems"].values())
    random.Random(seed).shuffle(problems)
    return [{"question": p["_text"] + "\nPut the final answer in \\boxed{}.",
             "answer": p["_answer"]} for p in problems[:count]]


def generate_rl_items(tasks: tuple[tuple[str, float], ...], total: int,
                      seed: int) -> list[RLItem]:
    """``total`` items of the mixture (proportional counts), each task seeded from ``seed``."""
    from megatron_logra.data.tasks import mixture_counts

    items: list[RLItem] = []
    for (name, _), count in zip(tasks, mixture_counts(tasks, total)):
        if count == 0:
            continue
        if name == MATH:
            entries = _math_entries(count, seed)
        elif name == "codeio":  # ~1% of its items failed to run: their answer is "{}"
            entries = [e for e in _generate_in_subprocess(name, count, seed)
                       if str(e["answer"]).strip() != "{}"]
        else:
            entries = _reasoning_gym_entries(name, count, seed)
        items += [RLItem(name, str(e["question"]), str(e["answer"]), e, i)
                  for i, e in enumerate(entries)]
    return items


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


def _serve(conn, score_fn) -> None:
    """The scoring process: (task, answer, entry) -> ("ok", score) | ("error", message)."""
    os.chdir(tempfile.mkdtemp(prefix="verifier_"))
    while True:
        job = conn.recv()
        if job is None:
            return
        try:
            conn.send(("ok", score_fn(*job)))
        except Exception as exc:  # noqa: BLE001 - a scorer's failure scores 0
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


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
        if cfg.reward not in ("binary", "partial"):
            raise ValueError(f"--reward {cfg.reward!r}: choose binary or partial")
        if cfg.timeout_s <= 0:
            raise ValueError(f"--verifier-timeout {cfg.timeout_s}: must be > 0 seconds")
        self.cfg, self.score_fn = cfg, score_fn
        self._proc = None
        self._conn = None
        self.failures: list[str] = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, self.score_fn), daemon=True)
        self._proc.start()
        child.close()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.join(5)
        self._proc = self._conn = None

    def close(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            try:
                self._conn.send(None)
                self._proc.join(2)
            except (OSError, BrokenPipeError):
                pass
        self._kill()

    def score(self, item: RLItem, response: str) -> ScoreResult:
        answer = extract_answer(response)[: self.cfg.max_answer_chars]
        if self._proc is None or not self._proc.is_alive():
            self._start()
        try:
            self._conn.send((item.task, answer, item.entry))
            if not self._conn.poll(self.cfg.timeout_s):
                self._kill()
                return self._failed(item, "timeout")
            status, value = self._conn.recv()
        except (EOFError, OSError, BrokenPipeError) as exc:
            self._kill()
            return self._failed(item, f"error: scorer process died ({type(exc).__name__})")
        if status != "ok":
            return self._failed(item, f"error: {value}")
        score = min(max(float(value), 0.0), 1.0)
        reward = score if self.cfg.reward == "partial" else float(score >= 1.0)
        return ScoreResult(reward, score, "ok")

    def _failed(self, item: RLItem, status: str) -> ScoreResult:
        message = f"scorer of {item.task} item {item.index}: {status} (reward 0)"
        self.failures.append(message)
        print(f"[verifier] {message}", file=sys.stderr, flush=True)
        return ScoreResult(0.0, 0.0, status)
