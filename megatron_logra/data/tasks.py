"""The task registry: task mixtures by name, and their items with reference answers.

``resolve_tasks("rg-hard")`` / ``resolve_tasks("basic_arithmetic,chain_sum:2")`` /
``resolve_tasks("math")`` name a mixture of reasoning-gym tasks (or the offline math
problems); ``generate_items`` makes its items deterministically (codeio, which runs code,
in a sandboxed subprocess: ``runtime.sandbox``; its broken items filtered). SFT trains on
an item's question and answer; RL scores responses against its ``entry``
(``rl.verifiers``).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import tempfile
from dataclasses import dataclass, field

from megatron_logra.runtime.processes import die_with_parent
from megatron_logra.runtime.sandbox import (SandboxLimits, TimeLimitExceeded, enter_sandbox,
                                             time_limit)

# The paper's Reasoning-Gym Hard mixture.
PRESETS = {"rg-hard": ("codeio", "emoji_mystery", "rectangle_count", "word_ladder",
                       "pool_matrix", "tsumego")}
MATH = "math"  # math-verify over problems shipped offline (champ-dataset)
EXCLUDED = {"game_of_life_halting": "its scorer gives any non-empty answer 1.0"}


@dataclass(frozen=True)
class TaskItem:
    task: str
    question: str
    answer: str  # the reference answer (SFT target; logs)
    index: int  # position within its task's generated dataset
    entry: dict = field(default_factory=dict, repr=False)  # what the task's scorer needs (JSON-able)


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


def mixture_counts(tasks: tuple[tuple[str, float], ...], total: int) -> list[int]:
    """Items per task, proportional to the weights, summing to ``total`` (largest remainder)."""
    weight_sum = sum(w for _, w in tasks)
    exact = [total * w / weight_sum for _, w in tasks]
    counts = [int(x) for x in exact]
    order = sorted(range(len(tasks)), key=lambda i: exact[i] - counts[i], reverse=True)
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


def _json_safe(entry: dict) -> dict:
    return json.loads(json.dumps(entry, default=str))


def _reasoning_gym_entries(name: str, count: int, seed: int) -> list[dict]:
    import reasoning_gym

    return [_json_safe(dict(e)) for e in reasoning_gym.create_dataset(name, size=count, seed=seed)]


def _generate_in_subprocess(name: str, count: int, seed: int) -> list[dict]:
    """codeio exec()s its samples while generating: do it in a sandboxed child process
    (``runtime.sandbox``: a scratch directory, capped memory, no writes outside it, a time
    limit per item; an item that breaks a limit is dropped)."""
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    with tempfile.TemporaryDirectory(prefix=f"{name}_gen_") as scratch, ProcessPoolExecutor(
            1, mp_context=mp.get_context("spawn")) as pool:
        try:
            entries, dropped = pool.submit(sandboxed_entries, name, count, seed, scratch,
                                           SandboxLimits(), ITEM_TIMEOUT_S).result()
        except BrokenProcessPool:
            raise RuntimeError(f"generating {name} items: the sandboxed generator process "
                               f"died (its output is above)") from None
    if dropped:
        print(f"{name}: {len(dropped)} of {count} items dropped ({'; '.join(dropped[:3])})",
              flush=True)
    return entries


ITEM_TIMEOUT_S = 10.0  # the longest one generated task item may take (codeio runs code)


def sandboxed_entries(name: str, count: int, seed: int, scratch: str, limits: SandboxLimits,
                      item_timeout_s: float) -> tuple[list[dict], list[str]]:
    """(entries, why each dropped item was dropped) of reasoning-gym task ``name``, made
    in this process after ``enter_sandbox``; entries keep their order."""
    die_with_parent()
    enter_sandbox(scratch, limits)
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(name, size=count, seed=seed)
    entries, dropped = [], []
    for i in range(count):
        try:
            with time_limit(item_timeout_s):
                entries.append(_json_safe(dict(dataset[i])))
        except (TimeLimitExceeded, MemoryError, OSError) as exc:
            dropped.append(f"item {i}: {type(exc).__name__}: {exc}")
    return entries, dropped


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


def generate_items(tasks: tuple[tuple[str, float], ...], total: int,
                   seed: int) -> list[TaskItem]:
    """``total`` items of the mixture (proportional counts), each task seeded from ``seed``."""
    items: list[TaskItem] = []
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
        items += [TaskItem(name, str(e["question"]), str(e["answer"]), i, e)
                  for i, e in enumerate(entries)]
    return items
