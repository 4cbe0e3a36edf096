"""The docs cite results, never type them: every generated block of README.md and docs/*.md
equals what benchmarks/render_docs.py renders from the committed results JSON, every
results JSON records the code, command, machine and date that made it, and a result
without clean provenance is refused."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _render_docs():
    """benchmarks/render_docs.py, imported as the benchmarks import each other (by name)."""
    if str(REPO / "benchmarks") not in sys.path:
        sys.path.insert(0, str(REPO / "benchmarks"))
    return importlib.import_module("render_docs")


def test_committed_docs_equal_their_rendering(capsys):
    assert _render_docs().main(["--check"]) == 0, capsys.readouterr().err


def test_every_generated_block_is_used_and_every_used_block_exists():
    rd = _render_docs()
    used = {m["name"] for doc in rd.DOCS for m in rd._BLOCK.finditer(doc.read_text())}
    assert used == set(rd.BLOCKS), (sorted(set(rd.BLOCKS) - used), sorted(used - set(rd.BLOCKS)))


def test_every_results_json_records_its_provenance():
    missing = []
    for path in sorted((REPO / "benchmarks" / "results").rglob("*.json")):
        prov = json.loads(path.read_text()).get("provenance") or {}
        if not (prov.get("commit") and "clean" in prov and prov.get("command")
                and prov.get("machine") and prov.get("date")):
            missing.append(str(path.relative_to(REPO)))
    assert not missing, f"results without provenance (rerun their benchmarks): {missing}"


@pytest.mark.parametrize("provenance, words", [
    (None, "records no provenance"),
    ({"commit": "abc", "clean": False, "dirty_files": ["x.py"]}, "uncommitted changes"),
])
def test_a_result_without_clean_provenance_is_refused(tmp_path, provenance, words):
    rd = _render_docs()
    path = rd.RESULTS / "x.json"
    with pytest.raises(rd.UncitableResult, match=words):
        rd.source_line(path, {"provenance": provenance} if provenance else {})


def test_a_block_renders_its_benchmarks_markdown_and_source(tmp_path, monkeypatch):
    rd = _render_docs()
    from megatron_logra.runtime.provenance import provenance

    prov = {**provenance(["python", "benchmarks/x_bench.py"]), "clean": True}
    results = tmp_path / "results"
    results.mkdir()
    (results / "x.json").write_text(json.dumps({"value": 7, "provenance": prov}))
    (tmp_path / "x_bench.py").write_text(
        "def markdown(report):\n    return f'| value |\\n|---|\\n| {report[\"value\"]} |'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rd, "RESULTS", results)
    monkeypatch.setattr(rd, "REPO", tmp_path)
    monkeypatch.setitem(rd.BLOCKS, "x", rd.Block("x.json", "x_bench"))
    text = "before\n<!-- BEGIN GENERATED: x -->\nstale\n<!-- END GENERATED: x -->\nafter\n"
    out = rd.render_text(text, tmp_path / "docs" / "page.md")
    assert "| 7 |" in out and "stale" not in out and out.startswith("before\n")
    assert out.endswith("<!-- END GENERATED: x -->\nafter\n")
    assert f"commit {prov['commit'][:10]}" in out and "`python benchmarks/x_bench.py`" in out
    assert "](../results/x.json)" in out  # a page under docs/ links one folder up


def test_a_summary_block_renders_several_results_with_a_source_line_each(tmp_path, monkeypatch):
    rd = _render_docs()
    from megatron_logra.runtime.provenance import provenance

    results = tmp_path / "results"
    results.mkdir()
    for name, value, cmd in (("a.json", 3, "benchmarks/a.py"), ("b.json", 4, "benchmarks/b.py")):
        prov = {**provenance(["python", cmd]), "clean": True}
        (results / name).write_text(json.dumps({"value": value, "provenance": prov}))
    (tmp_path / "sum_bench.py").write_text(
        "def both(reports):\n"
        "    return f'| sum |\\n|---|\\n| {reports[\"a.json\"][\"value\"] + reports[\"b.json\"][\"value\"]} |'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(rd, "RESULTS", results)
    monkeypatch.setattr(rd, "REPO", tmp_path)
    monkeypatch.setitem(rd.BLOCKS, "s", rd.Block(("a.json", "b.json"), "sum_bench", "both"))
    out = rd.render_text("<!-- BEGIN GENERATED: s -->\n<!-- END GENERATED: s -->\n",
                         tmp_path / "README.md")
    assert "| 7 |" in out
    sources = [line for line in out.splitlines() if line.startswith("- <sub>Source:")]
    assert len(sources) == 2 and "](results/a.json)" in sources[0]
    assert "`python benchmarks/b.py`" in sources[1]
    # a file the summary names but that is not committed: the summary gets the others,
    # and one source line each; a file there without provenance is still refused
    (results / "b.json").unlink()
    (tmp_path / "sum_bench.py").write_text(
        "def both(reports):\n    return f'| files |\\n|---|\\n| {sorted(reports)} |'\n")
    monkeypatch.delitem(sys.modules, "sum_bench")
    out = rd.render_text("<!-- BEGIN GENERATED: s -->\n<!-- END GENERATED: s -->\n",
                         tmp_path / "README.md")
    assert "| ['a.json'] |" in out and out.count("<sub>Source:") == 1
    (results / "b.json").write_text(json.dumps({"value": 4}))
    with pytest.raises(rd.UncitableResult, match="b.json records no provenance"):
        rd.render_text("<!-- BEGIN GENERATED: s -->\n<!-- END GENERATED: s -->\n",
                       tmp_path / "README.md")


def test_a_block_whose_result_is_not_committed_says_so(tmp_path, monkeypatch):
    rd = _render_docs()
    monkeypatch.setattr(rd, "RESULTS", tmp_path)
    text = rd.BLOCKS["quality_runs"].render(REPO / "docs")
    assert text.startswith("*No committed result yet: `benchmarks/results/quality.json`")
    assert "`benchmarks/quality.py` writes it" in text and "Source:" not in text


def test_a_summary_row_whose_result_is_not_committed_says_so():
    _render_docs()  # puts benchmarks/ on the path
    summary = importlib.import_module("summary")
    rows = summary._rows({})  # no results at all: every row says which file it lacks
    assert len(rows) == len(summary.ROWS)
    assert all("no committed result yet" in figures for _, figures, _ in rows)
    assert any("faults.json not in the tree" in figures for _, figures, _ in rows)
    assert set(summary.SOURCES) == {f for needs, *_ in summary.ROWS for f in needs}


@pytest.mark.parametrize("load, words", [
    ([3.2, 2.5, 1.9], "made under load"),  # above half of 2 cores
    ([0.4, 0.6, 0.9], None),
    (None, "load not recorded"),
])
def test_the_source_line_says_how_loaded_the_machine_was(load, words):
    rd = _render_docs()
    from megatron_logra.runtime.provenance import provenance

    prov = {**provenance(["python", "benchmarks/x.py"]), "clean": True}
    prov["machine"] = {**prov["machine"], "cores": 2, "load_avg": load}
    line = rd.source_line(rd.RESULTS / "x.json", {"provenance": prov})
    if load is not None:
        assert f"load average {load[0]:g} / {load[1]:g} / {load[2]:g}" in line
    assert (words in line) if words else ("under load" not in line)


def test_provenance_records_the_load_when_it_is_taken():
    from megatron_logra.runtime.provenance import machine

    before = os.getloadavg()
    load = machine()["load_avg"]
    after = os.getloadavg()
    assert len(load) == 3
    # each average between its values just before and just after (rounded to 0.01)
    assert all(min(b, a) - 0.01 <= x <= max(b, a) + 0.01 for x, b, a in zip(load, before, after))


def test_provenance_names_the_files_that_make_a_tree_unclean(tmp_path, monkeypatch):
    """`git status --porcelain` lines are "XY path": a modified file's line starts with a
    space, which must not cost its name a letter."""
    import subprocess

    from megatron_logra.runtime import provenance as prov

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    git("init", "-q")
    for name in ("README.md", "b.py"):
        (tmp_path / name).write_text("x\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c")
    monkeypatch.setattr(prov, "REPO", tmp_path)
    assert prov.code_state()["clean"] and prov.code_state()["dirty_files"] == []
    (tmp_path / "README.md").write_text("y\n")
    (tmp_path / "new.py").write_text("z\n")
    state = prov.code_state()
    assert not state["clean"] and state["dirty_files"] == ["README.md", "new.py"]
