"""Faults injected into short real RL jobs, and what each cost: the reliability table.

    .venv/bin/python benchmarks/faults.py [--only CASE,...] [--out DIR]

Every case is one torchrun job (DP2 on gloo, the tiny model, a real vLLM engine, with
the RL settings of ``tests/distributed/test_rl_faults.py``, ``testing.fault_launch.RL_FLAGS``:
LoGRA, sketch-delta sync, bf16, predicted-KL control, 4 updates, a checkpoint every 2)
under ``--max-restarts 1``, meeting one fault (``runtime.faults``, or a checkpoint damaged
before the job starts; the engine is vLLM's own server, which trainer rank 0 starts; an
engine death is that server's process dying), with a tag in its environment that every
process it starts inherits (``megatron_logra/testing/fault_launch.py``). An
uninterrupted job is the reference. Per case:

- ``completed``: the job exited 0 with its final checkpoint;
- ``updates_lost``: updates done and then thrown away (done before the crash, after the
  checkpoint the job resumed from); the target is at most the checkpoint interval;
- ``checkpoints_refused``: checkpoints auto-resume passed over as damaged;
- ``saves_dropped``: saves that failed cleanly (the previous checkpoint kept selected);
- ``mismatches``: updates whose metrics differ from the reference's, plus 1 if the
  final weights differ, plus the engine's tensors that differ from the trainer's at the
  end (fingerprints; a vLLM server: its checksums); the target is 0;
- ``orphans`` and ``leaked_shm``: processes and /dev/shm entries left once the job ended;
- ``engine_restarts``, ``resumes`` (from a checkpoint, after torchrun restarted the job
  or by ``--auto-resume``) and the job's wall time.

Last stdout line: the JSON (also written to benchmarks/results/faults.json, and the
table to faults.md). CPU figures, from this machine.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from _results import save

from megatron_logra.testing.fault_launch import (RL_FLAGS, Launch, checkpoint_model, compared,
                                                 launch, records)

SAVE_INTERVAL = 2
# case -> (MEGATRON_LOGRA_FAULT, what it does)
INJECTED = {
    "rank0-dies-mid-rollout": ("rollout@3", "trainer rank 0 dies as update 3's rollouts start"),
    "rank1-dies-mid-backward": ("backward@3:1", "trainer rank 1 dies in update 3's backward"),
    "rank1-dies-mid-optimizer": ("optimizer@3:1", "trainer rank 1 dies in update 3's "
                                 "optimizer step"),
    "rank0-dies-mid-sync": ("sync@3", "trainer rank 0 dies as update 3's weight push starts"),
    "rank0-dies-mid-save": ("save@4", "trainer rank 0 dies writing the final checkpoint"),
    "disk-full-on-save": ("save-enospc@2", "the disk fills up during update 2's save"),
    "engine-dies-mid-rollout": ("engine-generate@2", "vLLM's server dies in update 2's "
                                "rollouts"),
    "engine-dies-mid-delta-push": ("engine-delta-push@2", "vLLM's server dies in update 2's "
                                   "sketch-delta push (received, not finished)"),
    "engine-dies-mid-full-push": ("engine-full-push@3", "vLLM's server dies in update 3's full "
                                  "(anchor) push, its first round received, not finished"),
    "rank1-dies-mid-sync": ("sync@3:1", "trainer rank 1 dies as update 3's weight push "
                            "starts"),
}
# case -> (MEGATRON_LOGRA_FAULT, what it does): jobs with --async-rollouts, measured against
# an uninterrupted asynchronous job
INJECTED_ASYNC = {
    "async-engine-dies-mid-rollout": ("engine-generate@2", "--async-rollouts: vLLM's server "
                                      "dies generating update 2's rollouts beside update 1's "
                                      "training"),
}
ASYNC = ("--async-rollouts",)
# case -> (how the newest checkpoint of a finished reference job is damaged, description)
DAMAGED = {
    "truncated-shard": ("truncate", "a shard of the newest checkpoint is truncated"),
    "missing-shard": ("delete", "a shard of the newest checkpoint is missing"),
    "corrupt-metadata": ("corrupt", "the newest checkpoint's metadata file is corrupt"),
}


def _argv(run: Path, *extra: str) -> list[str]:
    return [*RL_FLAGS, "--output-dir", str(run), "--save", str(run / "ckpt"), *extra]


def _damage(ckpt: Path, how: str) -> str:
    """Damage ``ckpt`` (a checkpoint folder) as ``how`` says; returns the file's name."""
    if how == "corrupt":
        meta = ckpt / "megatron_logra.json"
        meta.write_text(meta.read_text()[:-20] + "#garbage")
        return meta.name
    shard = sorted(ckpt.glob("*.distcp"))[0]
    if how == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    else:
        shard.unlink()
    return shard.name


def _updates_lost(log: str, finished_before: int) -> int:
    """Updates completed and thrown away: done before the resume, past its checkpoint."""
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    if resumed is None:
        return 0
    head = log[: resumed.start()]
    done = [int(n) for n in re.findall(r"^step (\d+)/\d+ \|", head, re.M)]
    return max(done + [finished_before]) - int(resumed.group(1))


def _measure(name: str, job: Launch, run: Path, reference: Path,
             finished_before: int = 0) -> dict:
    """The case's figures (see the module doc). An asynchronous job whose engine died
    generates the lost batch again at the weights of the moment, one version newer than
    the uninterrupted job's: its updates from that one on differ by design, so only the
    updates before it are compared, and ``samples_lost`` (samples that never trained:
    dropped, or updates that trained nothing) must be 0."""
    final = run / "ckpt" / "iter_0000004"
    out = {"case": name, "completed": job.returncode == 0 and final.is_dir(),
           "updates_lost": _updates_lost(job.log, finished_before),
           "checkpoints_refused": job.log.count("passing over a damaged checkpoint"),
           "saves_dropped": len(re.findall(r"iter_\d+ not saved", job.log)),
           "orphans": len(job.orphans), "leaked_shm": len(job.leaked_shm),
           "resumes": job.log.count("resumed from"), "seconds": round(job.seconds, 1)}
    if not out["completed"]:
        out.update(mismatches=None, engine_restarts=None, error=job.log[-2000:])
        return out
    mine, theirs = records(run), records(reference)
    regenerated = [r["step"] for r in mine if r.get("rollouts_regenerated")]
    if name in INJECTED_ASYNC:
        out["samples_lost"] = sum(r.get("stale_dropped_kl", 0) + r.get("stale_dropped_versions", 0)
                                  for r in mine) + sum(not r.get("tokens") for r in mine
                                                       if r["step"] > 0)
        out["regenerated"] = len(regenerated)
        mine = [r for r in mine if r["step"] < min(regenerated, default=99)]
        theirs = [r for r in theirs if r["step"] < min(regenerated, default=99)]
    by_step = {r["step"]: r for r in theirs}
    differing = sum(compared(r) != compared(by_step.get(r["step"], {})) for r in mine)
    differing += len({r["step"] for r in theirs} ^ {r["step"] for r in mine})
    a, b = checkpoint_model(final), checkpoint_model(reference / "ckpt" / "iter_0000004")
    weights_differ = a.keys() != b.keys() or any(not torch.equal(a[k], b[k]) for k in a)
    weights_differ = weights_differ and name not in INJECTED_ASYNC
    out["mismatches"] = differing + int(weights_differ) + records(run)[-1].get(
        "engine_weight_mismatches", 0)
    out["engine_restarts"] = job.log.count("; restarting the engine")
    return out


def markdown(report: dict) -> str:
    head = ("| case | fault | completed | updates lost | checkpoints refused | saves dropped "
            "| mismatches | resumes | engine restarts | orphans | leaked shm | wall s |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
    rows = "".join(
        f"| {c['case']} | {c['what']} | {'yes' if c['completed'] else '**no**'} | "
        f"{c['updates_lost']} | {c['checkpoints_refused']} | {c['saves_dropped']} | "
        f"{c['mismatches']} | {c['resumes']} | {c['engine_restarts']} | {c['orphans']} | "
        f"{c['leaked_shm']} | "
        f"{c['seconds']} |\n" for c in report["cases"])
    s = report["summary"]
    return (f"{head}{rows}\n"
            f"**{s['faults_injected']} faults, {s['runs_completed']} jobs completed, at most "
            f"{s['max_updates_lost']} updates lost (checkpoint interval {report['save_interval']}), "
            f"{s['mismatches']} mismatches, {s['orphans']} orphans, {s['leaked_shm']} leaked "
            f"shm entries, {s['samples_lost']} samples lost; targets "
            f"met: {s['targets_met']}.** DP2 on gloo, tiny model, vLLM's own server, LoGRA "
            f"with sketch-delta sync, bf16, predicted-KL control, 4 updates, a checkpoint every "
            f"{report['save_interval']}, `torchrun --max-restarts 1`.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="", help="comma-separated case names")
    parser.add_argument("--out", default=None, help="results folder (default "
                        "benchmarks/results)")
    args = parser.parse_args()
    cases = list(INJECTED) + list(INJECTED_ASYNC) + list(DAMAGED)
    if args.only:
        unknown = set(args.only.split(",")) - set(cases)
        if unknown:
            parser.error(f"unknown cases {sorted(unknown)}; choose from {', '.join(cases)}")
        cases = [c for c in cases if c in args.only.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="faults_"))
    results = []

    print(f"[faults] reference job (logs in {tmp})", flush=True)
    reference = tmp / "reference"
    job = launch(tmp, "reference", _argv(reference))
    if job.returncode != 0:
        sys.exit(f"the reference job failed:\n{job.log[-3000:]}")
    reference_async = tmp / "reference-async"
    if any(c in INJECTED_ASYNC for c in cases):
        print("[faults] asynchronous reference job", flush=True)
        job = launch(tmp, "reference-async", _argv(reference_async, *ASYNC))
        if job.returncode != 0:
            sys.exit(f"the asynchronous reference job failed:\n{job.log[-3000:]}")
    for i, name in enumerate(cases, 1):
        run = tmp / name
        if name in INJECTED:
            fault, what = INJECTED[name]
            job = launch(tmp, name, _argv(run), fault=fault)
            got = _measure(name, job, run, reference)
        elif name in INJECTED_ASYNC:
            fault, what = INJECTED_ASYNC[name]
            job = launch(tmp, name, _argv(run, *ASYNC), fault=fault)
            got = _measure(name, job, run, reference_async)
        else:
            how, what = DAMAGED[name]
            shutil.copytree(reference, run)
            damaged_file = _damage(run / "ckpt" / "iter_0000004", how)
            what = f"{what} ({damaged_file})"
            job = launch(tmp, name, _argv(run, "--auto-resume"))
            got = _measure(name, job, run, reference, finished_before=4)
        got["what"] = what
        results.append(got)
        print(f"[faults] {i}/{len(cases)} {name}: " + json.dumps(
            {k: v for k, v in got.items() if k not in ("what", "error")}), flush=True)
    done = [c for c in results if c["completed"]]
    summary = {"faults_injected": len(results), "runs_completed": len(done),
               "max_updates_lost": max((c["updates_lost"] for c in results), default=0),
               "checkpoints_refused": sum(c["checkpoints_refused"] for c in results),
               "mismatches": sum(c["mismatches"] or 0 for c in done),
               "orphans": sum(c["orphans"] for c in results),
               "samples_lost": sum(c.get("samples_lost") or 0 for c in results),
               "leaked_shm": sum(c["leaked_shm"] for c in results)}
    summary["targets_met"] = (len(done) == len(results)
                              and summary["max_updates_lost"] <= SAVE_INTERVAL
                              and summary["mismatches"] == summary["orphans"]
                              == summary["leaked_shm"] == summary["samples_lost"] == 0)
    report = {"benchmark": "faults", "save_interval": SAVE_INTERVAL,
              "cases": results, "summary": summary,
              "torch": torch.__version__, "device": "cpu"}
    print(f"[faults] table: {save('faults', report, markdown(report), args.out)}", flush=True)
    print(json.dumps(report))
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
