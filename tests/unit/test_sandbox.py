"""The sandbox task code runs in (``runtime.sandbox``): in a real child process, each
limit stops what it guards against and leaves the process working; codeio's items made
in the sandbox are the ones reasoning-gym makes without it."""

import multiprocessing as mp
import os

from megatron_logra.data.tasks import generate_items
from megatron_logra.runtime.sandbox import (SandboxLimits, TimeLimitExceeded, enter_sandbox,
                                            time_limit)


def _outcome(action) -> str:
    try:
        action()
        return "done"
    except (PermissionError, MemoryError, OSError, TimeLimitExceeded) as exc:
        return f"{type(exc).__name__}: {exc}"


def _spin() -> None:
    with time_limit(0.3):
        while True:
            pass


def _probe(scratch: str, outside: str, queue) -> None:
    """Runs in the child: each action's outcome, by name."""
    enter_sandbox(scratch, SandboxLimits(memory_gib=2.0, file_mb=1.0))

    def write(path: str, size: int = 10) -> None:
        with open(path, "w") as f:
            f.write("x" * size)

    queue.put({
        "write_outside": _outcome(lambda: write(os.path.join(outside, "a.txt"))),
        "os_open_outside": _outcome(lambda: os.open(os.path.join(outside, "b"),
                                                    os.O_WRONLY | os.O_CREAT)),
        "remove_outside": _outcome(lambda: os.remove(os.path.join(outside, "keep.txt"))),
        "rename_into_outside": _outcome(lambda: (write("moved.txt"),
                                                 os.rename("moved.txt",
                                                           os.path.join(outside, "m.txt")))),
        "escape_by_dotdot": _outcome(lambda: write("../escaped.txt")),
        "read_outside": _outcome(lambda: open(os.path.join(outside, "keep.txt")).read()),
        "write_inside": _outcome(lambda: write("inside.txt")),
        "write_home": _outcome(lambda: write(os.path.expanduser("~/rc"))),
        "big_file_inside": _outcome(lambda: write("big.txt", 2 * 2**20)),
        "memory": _outcome(lambda: bytearray(4 * 2**30)),
        "time": _outcome(_spin),
        "after_all_that": _outcome(lambda: sum(range(1000))),
    })


def test_each_limit_stops_its_fault_and_the_process_goes_on(tmp_path):
    scratch, outside = tmp_path / "scratch", tmp_path / "outside"
    scratch.mkdir()
    outside.mkdir()
    (outside / "keep.txt").write_text("precious")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_probe, args=(str(scratch), str(outside), queue))
    child.start()
    got = queue.get(timeout=120)
    child.join(30)
    assert child.exitcode == 0
    refused = "PermissionError: task code may not write outside its scratch directory"
    for action in ("write_outside", "os_open_outside", "remove_outside", "rename_into_outside",
                   "escape_by_dotdot"):
        assert got[action].startswith(refused), (action, got[action])
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == "precious"
    assert not (tmp_path / "escaped.txt").exists()
    for action in ("read_outside", "write_inside", "write_home", "after_all_that"):
        assert got[action] == "done", (action, got[action])
    assert (scratch / "inside.txt").read_text() == "x" * 10 and (scratch / "rc").exists()
    assert "File too large" in got["big_file_inside"], got["big_file_inside"]
    assert got["memory"].startswith("MemoryError"), got["memory"]
    assert got["time"] == "TimeLimitExceeded: over its time limit of 0.3 s"


def test_codeio_items_made_in_the_sandbox_equal_reasoning_gyms_own(tmp_path, monkeypatch):
    import reasoning_gym

    monkeypatch.chdir(tmp_path)  # codeio execs its snippets here, in this process
    reference = [e for e in reasoning_gym.create_dataset("codeio", size=12, seed=3)
                 if str(e["answer"]).strip() != "{}"]
    items = generate_items((("codeio", 1.0),), 12, seed=3)
    assert len(items) == len(reference) >= 10
    for item, entry in zip(items, reference):
        assert (item.question, item.answer) == (entry["question"], entry["answer"])
    assert list(tmp_path.iterdir()) == []  # the sandboxed child wrote nothing here
