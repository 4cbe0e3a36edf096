"""Scorers that misbehave, for the verifier's process-isolation tests (imported by the
scoring child process by module name)."""

import os
import time


def misbehaving(task: str, answer: str, entry: dict) -> float:
    if answer == "hang":
        time.sleep(60)
    if answer == "crash":
        os._exit(3)  # the scoring process dies without a reply
    if answer == "raise":
        raise ZeroDivisionError("scorer bug")
    return float(answer)  # "1.0", "0.5": that score
