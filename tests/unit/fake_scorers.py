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
    if answer == "flood":  # stdout without end: the sandbox caps the file it goes to
        while True:
            print("x" * 4096)
    if answer.startswith("write:"):  # a file outside the scratch directory
        with open(answer.removeprefix("write:"), "w") as f:
            f.write("escaped")
    if answer == "memory":  # past the sandbox's memory cap
        return float(len(bytearray(64 * 2**30)))
    if answer == "garbage":
        return "very good"
    if answer == "nan":
        return float("nan")
    return float(answer)  # "1.0", "0.5": that score
