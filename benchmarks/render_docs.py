"""The docs' result tables, rendered from the committed results JSON: never typed by hand.

    python benchmarks/render_docs.py           # rewrite every generated block in place
    python benchmarks/render_docs.py --check   # exit 1, naming each block that differs

A generated block in README.md or docs/*.md sits between the lines

    <!-- BEGIN GENERATED: NAME -->
    <!-- END GENERATED: NAME -->

and holds ``BLOCKS[NAME]``: the markdown its benchmark renders from its results JSON
(the benchmark's own ``markdown``-style function, the same that writes its .md table),
then one line naming the source: the file, the commit that made it, the command, the
machine and the date. A result whose provenance is missing, or says the tree had
uncommitted changes, is refused: the docs cite only results made by committed code.
tests/unit/test_docs_rendered.py fails when a committed doc differs from what this
script renders.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
_BLOCK = re.compile(r"(<!-- BEGIN GENERATED: (?P<name>[\w./-]+) -->\n)(?P<body>.*?)"
                    r"(<!-- END GENERATED: (?P=name) -->)", re.S)


class UncitableResult(ValueError):
    """A results file the docs may not cite (no provenance, or not from a clean commit)."""


@dataclass(frozen=True)
class Block:
    """One generated block: ``render(report) -> markdown`` of ``results/source``."""

    source: str  # path under benchmarks/results/
    module: str  # the benchmark module (benchmarks/MODULE.py) that renders it
    function: str = "markdown"

    def render(self, doc_dir: Path) -> str:
        """The block for a doc in ``doc_dir`` (its source link is relative to it)."""
        path = RESULTS / self.source
        if not path.is_file():
            raise UncitableResult(f"{path.relative_to(REPO)} does not exist: run its "
                                  f"benchmark (benchmarks/{self.module}.py) and commit it")
        report = json.loads(path.read_text())
        body: Callable[[dict], str] = getattr(_module(self.module), self.function)
        return f"{body(report).rstrip()}\n\n{source_line(path, report, doc_dir)}\n"


def _module(name: str):
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # the benchmarks import their siblings by name
    return importlib.import_module(name)


def source_line(path: Path, report: dict, doc_dir: Path | None = None) -> str:
    """"Source: FILE (linked from ``doc_dir``), commit C, `COMMAND`, MACHINE, DATE."; refused
    without clean provenance."""
    prov = report.get("provenance")
    rel = path.relative_to(REPO)
    if not prov or not prov.get("commit"):
        raise UncitableResult(f"{rel} records no provenance: rerun its benchmark at a "
                              f"clean commit (benchmarks/_results.py records it)")
    if not prov.get("clean"):
        raise UncitableResult(f"{rel} was made from a tree with uncommitted changes "
                              f"({', '.join(prov.get('dirty_files', [])[:3])}): commit, "
                              f"rerun, and commit the result")
    m = prov["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    where = m["gpu"] or f"{m['cores']} CPU cores ({m['cpu']})"
    link = os.path.relpath(path, doc_dir or REPO)
    return (f"<sub>Source: [{rel.name}]({link}), commit {prov['commit'][:10]}, "
            f"`{prov['command']}`, {where}, {versions}, {prov['date'][:10]}.</sub>")


# name -> the block: every table the docs show from a benchmark's results
BLOCKS: dict[str, Block] = {
    "quality": Block("quality.json", "quality_report"),
    "quality_rank": Block("quality.json", "quality_report", "markdown_rank"),
    "quality_controls": Block("quality.json", "quality_report", "markdown_controls"),
    "quality_runs": Block("quality.json", "quality_report", "markdown_runs"),
    "dry_run": Block("dry_run.json", "dry_run"),
}


def render_text(text: str, doc: Path) -> str:
    """``text`` with every generated block rendered again (an unknown name is an error)."""

    def replace(match: re.Match) -> str:
        name = match["name"]
        if name not in BLOCKS:
            raise KeyError(f"{doc.name}: no block named {name!r} (benchmarks/render_docs.py "
                           f"BLOCKS has {', '.join(BLOCKS)})")
        return match[1] + BLOCKS[name].render(doc.parent) + match[4]

    return _BLOCK.sub(replace, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="change nothing; exit 1 if any doc differs from its rendering")
    args = p.parse_args(argv)
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        rendered = render_text(text, doc)
        if rendered != text:
            stale.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(rendered)
    if stale and args.check:
        print(f"out of date (run python benchmarks/render_docs.py): "
              f"{', '.join(map(str, stale))}", file=sys.stderr)
        return 1
    print(f"{'checked' if args.check else 'rendered'} {len(DOCS)} docs; "
          f"{'stale' if args.check else 'rewritten'}: {len(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
