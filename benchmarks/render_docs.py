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
    """One generated block: ``render(report) -> markdown`` of ``results/source``; with several
    sources, ``render({source: report}) -> markdown`` (a summary of several benchmarks),
    then one source line per file, in a list.

    A results file that is not in the tree is no error: its block says that no result is
    committed yet and which benchmark writes it (a summary passes the files it has, and
    its rows say which are missing). A file that is there but has no clean provenance is
    refused (``UncitableResult``)."""

    source: str | tuple[str, ...]  # path(s) under benchmarks/results/
    module: str  # the benchmark module (benchmarks/MODULE.py) that renders it
    function: str = "markdown"
    made_by: str = ""  # the script that writes the file, when it is not benchmarks/MODULE.py

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source,) if isinstance(self.source, str) else tuple(self.source)

    def render(self, doc_dir: Path) -> str:
        """The block for a doc in ``doc_dir`` (its source links are relative to it)."""
        reports = {s: json.loads((RESULTS / s).read_text()) for s in self.sources
                   if (RESULTS / s).is_file()}
        if isinstance(self.source, str) and not reports:
            return no_result(self.source, self.made_by or f"benchmarks/{self.module}.py")
        lines = [source_line(RESULTS / s, r, doc_dir) for s, r in reports.items()]
        body: Callable[[dict], str] = getattr(_module(self.module), self.function)
        if isinstance(self.source, str):
            return f"{body(reports[self.source]).rstrip()}\n\n{lines[0]}\n"
        return body(reports).rstrip() + "\n\n" + "".join(f"- {line}\n" for line in lines)


def no_result(source: str, made_by: str) -> str:
    """What a block shows while its results file is not committed."""
    return (f"*No committed result yet: `benchmarks/results/{source}` is not in the tree "
            f"(`{made_by}` writes it, with its provenance, from a clean commit). Nothing is "
            f"cited here until it is.*\n")


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
            f"`{prov['command']}`, {where}, {load_note(m)}, {versions}, "
            f"{prov['date'][:10]}.</sub>")


def load_note(machine: dict) -> str:
    """The machine's load when the result was saved: a timing made while other work shared
    the cores is an upper bound, and the source line says so."""
    loaded = _module("_results").under_load(machine)
    if loaded is None:
        return "load not recorded (made on shared cores: its timings are not a quiet machine's)"
    load = machine["load_avg"]
    note = f"load average {load[0]:g} / {load[1]:g} / {load[2]:g} (1 / 5 / 15 min) at its end"
    return note + (f" on {machine['cores']} cores: **made under load, its timings are not a "
                   f"quiet machine's**" if loaded else "")


# the results files the summary tables read (benchmarks/summary.py names them)
SUMMARY_SOURCES: tuple[str, ...] = _module("summary").SOURCES
# name -> the block: every table the docs show from a benchmark's results
BLOCKS: dict[str, Block] = {
    "quality": Block("quality.json", "quality_report", made_by="benchmarks/quality.py"),
    "quality_account": Block("quality.json", "quality_report", "markdown_account",
                             "benchmarks/quality.py"),
    "quality_replay": Block("quality_replay.json", "quality_replay"),
    "quality_rank": Block("quality.json", "quality_report", "markdown_rank",
                          "benchmarks/quality.py"),
    "quality_controls": Block("quality.json", "quality_report", "markdown_controls",
                              "benchmarks/quality.py"),
    "quality_runs": Block("quality.json", "quality_report", "markdown_runs",
                          "benchmarks/quality.py"),
    # docs/results.md's Summary and the README's Results: rows from several benchmarks
    "summary": Block(SUMMARY_SOURCES, "summary", "docs_summary"),
    "readme_results": Block(SUMMARY_SOURCES, "summary", "readme_results"),
    "convert": Block("convert.json", "convert"),
    "memory": Block("memory.json", "memory"),
    "memory_plan_validation": Block("memory_plan.json", "memory_plan", "validation_summary"),
    "memory_plan_27b": Block("memory_plan.json", "memory_plan", "projection_table"),
    "step_time": Block("step_time.json", "step_time"),
    "step_time_embedding_adam": Block("step_time_embedding_adam.json", "step_time"),
    "sync": Block("sync.json", "sync"),
    "weight_push": Block("weight_push.json", "weight_push"),
    "learning": Block("learning.json", "learning"),
    "faults": Block("faults.json", "faults"),
    "async_rollouts": Block("async_rollouts.json", "async_rollouts"),
    "throughput_model": Block("throughput_model.json", "throughput_model", "modes_table"),
    "task_signal": Block("task_signal.json", "task_signal"),
    "sketch_cosines": Block("figures/sketch_cosines.json", "figures", "sketch_table"),
    "update_cosine": Block("figures/sketch_cosines.json", "figures", "update_cosine_table"),
    "dry_run": Block("dry_run.json", "dry_run", made_by="benchmarks/dry_run.py"),
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
