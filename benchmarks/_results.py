"""Write a benchmark's report to ``benchmarks/results/``: NAME.json and NAME.md (a table).

Every report carries ``provenance`` (megatron_logra.runtime.provenance: the commit and
whether the tree was clean, the exact command, the machine, the date); the docs cite only
results whose provenance says the tree was clean (benchmarks/render_docs.py)."""

from __future__ import annotations

import json
from pathlib import Path

from megatron_logra.runtime.provenance import provenance

RESULTS = Path(__file__).resolve().parent / "results"


def write_json(path: Path, report: dict) -> None:
    """Atomically write ``report`` with this process's provenance (replacing any it had)."""
    write_text(path, json.dumps({**report, "provenance": provenance()}, indent=1) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def save(name: str, report: dict, table: str, directory: str | Path | None = None) -> Path:
    """Atomically write NAME.json (the report and its provenance) and NAME.md (``table``);
    returns the .md."""
    out = Path(directory) if directory else RESULTS
    write_json(out / f"{name}.json", report)
    write_text(out / f"{name}.md", table)
    return out / f"{name}.md"


def under_load(machine: dict) -> bool | None:
    """Whether the machine was loaded when a result was saved (any 1/5/15-minute load
    average above half its cores: other work shared them, so a timing in it is an upper
    bound); None when the result records no load (made before provenance recorded it)."""
    load = machine.get("load_avg")
    return None if load is None else max(load) > 0.5 * machine["cores"]


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"
