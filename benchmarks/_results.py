"""Write a benchmark's report to ``benchmarks/results/``: NAME.json and NAME.md (a table)."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def save(name: str, report: dict, table: str, directory: str | Path | None = None) -> Path:
    """Atomically write NAME.json (the report) and NAME.md (``table``); returns the .md."""
    out = Path(directory) if directory else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    for suffix, text in ((".json", json.dumps(report, indent=1) + "\n"), (".md", table)):
        path = out / f"{name}{suffix}"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return out / f"{name}.md"


def mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"
