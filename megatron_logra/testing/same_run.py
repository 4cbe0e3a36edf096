"""Does a change keep a run's results bit for bit? The faults benchmark's RL job, kept and
compared.

    python -m megatron_logra.testing.same_run run DIR              # the job, kept in DIR
    python -m megatron_logra.testing.same_run run DIR --load CKPT   # resumed from CKPT
    python -m megatron_logra.testing.same_run compare BEFORE AFTER  # exit 1 on a difference

``run`` launches the uninterrupted RL job of ``fault_launch.RL_FLAGS`` (torchrun, DP2 on
gloo, the embedded tiny model, a vLLM server, LoGRA with sketch-delta pushes and
predicted-KL control, 4 updates, a checkpoint every 2; what
``tests/distributed/test_rl_faults.py`` and ``benchmarks/faults.py`` fault) and copies
its run folder (metrics.jsonl, the checkpoints, the logs) to DIR. Run it at the commit
before a change and at the commit after it, then ``compare``: every metric of every
record but the clocks (``*_s``, and rates over them: ``*_per_s*``) and the peak memory
must be equal (rewards, losses, alpha, the logprob mismatch, bytes pushed, the transport...), and every checkpoint the
same: every tensor of its sharded state (model, LoGRA's optimizer state) ``torch.equal``,
its common state (optimizer steps, the resumable parts: scheduler, reward baseline, KL
controller) equal, its meta equal but for the run's config (which records the config's
layout). ``run --load BEFORE/ckpt/iter_0000002`` resumes the job from a checkpoint
another commit wrote (the on-disk format read back): its records from step 3 on and its
last checkpoint must equal BEFORE's (``compare`` compares the steps both have).
It prints what differs, or what was compared.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from megatron_logra.testing.fault_launch import RL_FLAGS, is_clock, launch, ok, records

UNCOMPARED = {"peak_mem_bytes"}  # besides every ``*_s`` clock and ``*_per_s*`` rate


def run_job(dest: Path, load: Path | None = None) -> Path:
    """The uninterrupted RL job (resumed from checkpoint ``load``, when given), its run
    folder copied to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="same_run-") as tmp:
        run = Path(tmp) / "reference"
        resume = ["--load", str(load)] if load is not None else []
        log = ok(launch(Path(tmp), "reference", [*RL_FLAGS, *resume, "--output-dir", str(run),
                                                 "--save", str(run / "ckpt")]))
        shutil.copytree(run, dest, dirs_exist_ok=True)
        (dest / "job.log").write_text(log)
    return dest


def _metrics(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in UNCOMPARED and not is_clock(k)}


def checkpoint_state(ckpt: Path) -> dict[str, object]:
    """Everything a checkpoint folder holds, by key: its sharded state (torch's DCP
    reader, one process), its common state (``common/...``) and its meta (``meta/...``,
    less the run's config)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from megatron_logra.checkpoint.layout import META

    with tempfile.TemporaryDirectory(prefix="same_run-") as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(ckpt), str(out))
        state = torch.load(out, weights_only=False)
    state.update({f"common/{k}": v for k, v in
                  torch.load(ckpt / "common.pt", weights_only=False).items()})
    meta = json.loads((ckpt / META).read_text())
    state.update({f"meta/{k}": v for k, v in meta.items() if k != "config"})
    return state


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def compare(before: Path, after: Path) -> tuple[list[str], dict]:
    """(what differs between the two kept runs, what was compared)."""
    problems = []
    mine, theirs = records(before), records(after)
    if theirs[0]["step"] > mine[0]["step"]:  # a resumed run: the steps it redid
        mine = [r for r in mine if r["step"] >= theirs[0]["step"]]
    if [r["step"] for r in mine] != [r["step"] for r in theirs]:
        problems.append(f"steps {[r['step'] for r in mine]} != {[r['step'] for r in theirs]}")
    for a, b in zip(mine, theirs):
        a, b = _metrics(a), _metrics(b)
        for key in sorted(a.keys() | b.keys()):
            if a.get(key, "<missing>") != b.get(key, "<missing>"):
                problems.append(f"step {a.get('step')}: {key} {a.get(key, '<missing>')!r} != "
                                f"{b.get(key, '<missing>')!r}")
    mine_steps = {r["step"] for r in mine} & {r["step"] for r in theirs}
    folders = sorted(p.name for p in (before / "ckpt").glob("iter_*")
                     if (after / "ckpt" / p.name).is_dir() and int(p.name[5:]) in mine_steps)
    if not folders:
        problems.append("no checkpoint of the same step in both")
    tensors = 0
    for name in folders:
        a = checkpoint_state(before / "ckpt" / name)
        b = checkpoint_state(after / "ckpt" / name)
        if a.keys() != b.keys():
            problems.append(f"{name}: keys {sorted(a.keys() ^ b.keys())[:5]} in one only")
        for key in sorted(a.keys() & b.keys()):
            tensors += isinstance(a[key], torch.Tensor)
            if not _same(a[key], b[key]):
                problems.append(f"{name}: {key} differs")
    compared = {"records": len(mine), "metrics": sum(len(_metrics(r)) for r in mine),
                "checkpoints": folders, "tensors": tensors}
    return problems, compared


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    one = sub.add_parser("run", help="run the job, keep its folder")
    one.add_argument("dir", type=Path)
    one.add_argument("--load", type=Path, help="resume from this checkpoint folder")
    both = sub.add_parser("compare", help="compare two kept runs")
    both.add_argument("before", type=Path)
    both.add_argument("after", type=Path)
    args = p.parse_args(argv)
    if args.command == "run":
        print(f"kept in {run_job(args.dir, args.load)}")
        return 0
    problems, compared = compare(args.before, args.after)
    for line in problems:
        print(line)
    print(f"{'DIFFERENT' if problems else 'identical'}: {compared}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
