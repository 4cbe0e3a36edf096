"""The plot command draws the panels that have data, overlays runs, and refuses bad input."""

import json

import pytest

from megatron_logra.plot import main, plot_runs


def _run(path, rewards, mem):
    path.mkdir()
    rows = [{"step": 0, "eval_pass@1": 0.1, "eval_pass@4": 0.3}]
    rows += [{"step": i + 1, "reward_mean": r, "peak_mem_bytes": mem, "loss": -r}
             for i, r in enumerate(rewards)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_two_runs_on_one_png(tmp_path):
    a = _run(tmp_path / "dense", [0.1, 0.2, 0.4], 3 * 2**30)
    b = _run(tmp_path / "logra", [0.1, 0.3, 0.3], 2**30)
    out = tmp_path / "curves.png"
    titles = plot_runs([a, b], out, ["dense", "logra"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert titles == ["train reward (mean)", "held-out pass@1 / pass@k", "peak memory (GiB)",
                      "loss"]  # no KL / timing data in these runs: no such panels


def test_bad_input_names_the_problem(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    a = _run(tmp_path / "a", [0.1], 1)
    assert main([str(a), "--labels", "x,y"]) == 2
    assert "--labels has 2 names for 1 runs" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="no plottable metrics"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
