"""Is a gain real? Differences of means with their standard errors (pure Python).

Used by the learning test, the demo's check and ``benchmarks/quality.py``: a claimed gain
is compared with its standard error, never with a bare threshold.
"""

from __future__ import annotations

import math


def _mean_var(xs: list[float]) -> tuple[float, float]:
    """Mean and unbiased sample variance (0 for a single value)."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else 0.0
    return mean, var


def paired_gain(before: list[float], after: list[float]) -> tuple[float, float]:
    """Mean of ``after[i] - before[i]`` and its standard error.

    For one evaluation set scored twice (the same prompts and sampling seeds, e.g. the
    per-prompt pass rates ``eval_prompt_pass`` before and after training): pairing
    removes the prompts' own difficulty from the noise.
    """
    if len(before) != len(after) or not before:
        raise ValueError(f"paired_gain needs two equal, non-empty lists (got {len(before)} "
                         f"and {len(after)} values): score the same prompts both times")
    mean, var = _mean_var([a - b for a, b in zip(after, before)])
    return mean, math.sqrt(var / len(before))


def mean_gain(first: list[float], last: list[float]) -> tuple[float, float]:
    """``mean(last) - mean(first)`` and its standard error (independent samples, Welch).

    For two windows of a training curve, e.g. the first and last quarter of per-update
    train rewards.
    """
    if len(first) < 2 or len(last) < 2:
        raise ValueError(f"mean_gain needs at least two values per window (got {len(first)} "
                         f"and {len(last)}): train for more updates")
    m1, v1 = _mean_var(first)
    m2, v2 = _mean_var(last)
    return m2 - m1, math.sqrt(v1 / len(first) + v2 / len(last))
