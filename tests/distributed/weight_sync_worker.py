"""torchrun worker of tests/distributed/test_weight_sync.py: the three sync transports, checked.

    torchrun --nproc-per-node N tests/distributed/weight_sync_worker.py OUT.json RUN_DIR

For the trainer layout of the launch (``LAYOUTS``: bf16 weights, LoGRA in SR mode,
every sketch target, a bf16 engine of vLLM TP1 (norms trained by Adam) or, from
TP2 x PP2, TP2 (norms frozen)): four RL updates, pushed as
sparse-delta, sketch-delta, sketch-delta, full (``TRANSPORTS``; the start-up push is full). After
every push rank 0 compares the server's weights with the trainer's (gathered to HF
tensors) by vLLM's own checksums of every parameter of every worker; at the end the
logprobs; it checks that a delta on the wrong base version is refused with the server
still serving. The engine is vLLM's server, which trainer rank 0 starts and which is
killed once on the way; PP2 goes into the server the test started
(``WEIGHT_SYNC_ENGINE_URL``, standing for another node), instead.
"""

from __future__ import annotations

import faulthandler
import os
import sys

import torch
import torch.distributed as dist

BASE = ["--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", "4",
        "--responses-per-prompt", "4", "--micro-batch-size", "4", "--seq-length", "96",
        "--max-new-tokens", "16", "--dataset-size", "60", "--eval-prompts", "4",
        "--bf16", "--rollout-dtype", "bfloat16", "--optimizer", "logra", "--logra-rank", "16",
        "--logra-targets", "qkv,proj,fc1,fc2,embedding", "--logra-update-ratio", "2e-2",
        "--logra-master-weights", "none", "--weight-sync", "sketch-delta", "--lr", "3e-3"]
TP2, PP2, ENGINE_TP2 = (["--tensor-model-parallel-size", "2"],
                        ["--pipeline-model-parallel-size", "2"],
                        ["--rollout-tensor-parallel-size", "2"])
# TP1 and PP2 into a vLLM TP1 engine, with the norms trained by Adam (sent in full with
# each sketch delta); TP2 x PP2 into a vLLM TP2 engine with them frozen (the paper's: not
# sent), which covers both splits at once. Left out, as each layout costs the suite a
# server start and four updates: TP2 alone, and TP2 x PP2 into a TP1 engine (a TP2
# trainer's sketch deltas into TP1 engines, checked by checksums after every push:
# tests/distributed/test_async_rollouts.py).
ADAM = ["--logra-untargeted", "adam"]
LAYOUTS = {1: {"tp1": [*ADAM]}, 2: {"pp2": [*PP2, *ADAM]},
           4: {"tp2pp2_engine_tp2": [*TP2, *PP2, *ENGINE_TP2]}}
# the server is killed before update 3's rollouts: a fresh one starts on dummy weights,
# joins a fresh group and is resynced in full
KILL_BEFORE_UPDATE = 2
# the layouts whose server (rank 0 started it) is killed once: a TP1 and a TP2 server
# (each restart is a fresh server on dummy weights, joined and resynced in full)
KILLED = ("tp1", "tp2pp2_engine_tp2")
REMOTE = "pp2"  # into the test's server when the launch names one
TRANSPORTS = ["sparse-delta", "sketch-delta", "sketch-delta", "full"]


def _trainer_hf(run) -> dict[str, torch.Tensor]:
    from megatron_logra.weight_sync.gathered_weights import gathered_buckets

    return {n: t for bucket in gathered_buckets(run.objs.model, run.objs.arch, run.sync.plan,
                                                dtype=torch.bfloat16) for n, t in bucket}


def _differing(run) -> list[str] | None:
    """The HF tensors the server holds differently from the trainer (rank 0): vLLM's
    checksums against the ones the trainer's weights make."""
    names, failed = run.sync.full.mismatches(run.engine)
    assert not failed, failed
    return names if dist.get_rank() == 0 else None


def _refused(run) -> bool:
    """A delta on a base the server does not serve is refused, nothing applied (rank 0)."""
    from megatron_logra.weight_sync.contract import PushRefused

    try:
        run.engine.expect("sketch-delta", base_version=run.version + 5,
                          version=run.version + 6)
        return False
    except PushRefused as exc:
        return "push full weights" in str(exc)


def _check_layout(argv: list[str], kill_engine: bool = False) -> dict:
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage
    from rl_worker import engine_logprobs, plus_minus_advantages, trainer_logprobs

    run = RLStage(parse_run_config(argv))
    out = {"transports": [], "bytes": [], "differing": []}
    try:
        run.sync.track_changes()  # the sparse-delta base: recorded by the next full push
        with run.sync.forcing("full"):
            run.push_weights()
        for update, transport in enumerate(TRANSPORTS):
            if kill_engine and update == KILL_BEFORE_UPDATE and dist.get_rank() == 0:
                run.engine.owner.kill()  # the server dies at once, as in a crash
            with run.sync.forcing(transport):  # this update's push
                record = run.step(update, adjust_samples=plus_minus_advantages)
            out["transports"].append(record["sync_transport"])
            out["bytes"].append(record["sync_bytes"])
            out["differing"].append(_differing(run))
        rows = torch.randint(0, run.objs.arch.vocab_size, (3, 24),
                             generator=torch.Generator().manual_seed(5))
        trainer = trainer_logprobs(run, rows)
        engine = engine_logprobs(run, rows)
        full = _trainer_hf(run)
        if dist.get_rank() == 0:
            out["logprob_diff"] = float((trainer - engine).abs().max())
            out["full_bytes"] = sum(t.numel() * t.element_size() for t in full.values())
            out["refused"] = _refused(run)
            out["serving_after_refusal"] = run.engine.version == run.version
        out["checksum_mismatches"] = run.sync_stats.checksum_mismatches
        out["restarts"] = run.engine_restarts
    finally:
        run.close()
    return out


def main() -> None:
    from megatron_logra.runtime.device import init_runtime
    from rl_worker import write_result

    faulthandler.dump_traceback_later(900, exit=True)  # a hang prints every thread's stack

    out_path, run_dir = sys.argv[1], sys.argv[2]
    rt = init_runtime()
    result = {}
    for name, flags in LAYOUTS[rt.world_size].items():
        remote = os.environ.get("WEIGHT_SYNC_ENGINE_URL", "") if name == REMOTE else ""
        if remote:  # the test's server ("another node"), serving the test's model folder
            flags = [*flags, "--rollout-engine-url", remote,
                     "--model-dir", os.environ["WEIGHT_SYNC_MODEL_DIR"]]
        result[name] = _check_layout([*BASE, *flags, "--output-dir", f"{run_dir}/{name}"],
                                     kill_engine=name in KILLED)
        result[name]["remote_engine"] = bool(remote)
        if rt.rank == 0:
            print(f"[weight sync] {name}: {result[name]}", flush=True)
    write_result(result, out_path)


if __name__ == "__main__":
    main()
