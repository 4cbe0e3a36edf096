"""torchrun worker of tests/distributed/test_rl_loop.py: RL runs, checked from inside,
one after another in one launch (one process start for every layout of a world size).

    torchrun --nproc-per-node N tests/distributed/rl_worker.py OUT.json SPEC.json

SPEC.json: ``{"layouts": {name: [launcher flags]}, "kill_engine": [names]}``. For each
layout in order: after the start-up push, after two RL updates (each followed by a full
push) and, for a layout in ``kill_engine``, after the engine is killed (the next rollout
restarts and resyncs it), the trainer's logprobs and the engine's on the same fixed
token rows are compared. The update records (with predicted-KL control's kl_pred /
kl_realized / alpha when the flags ask for it) go to the result too. Rank 0 writes
{name: {"diffs": {...}, "moved": ..., "restarts": ..., "versions": [...],
"records": [...], ...}}. A layout that pins the trainer's cores
(``--rollout-placement dedicated``) must come last: the pinning outlives its run.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist


def trainer_logprobs(run, rows: torch.Tensor) -> torch.Tensor:
    """log p(row[t] | row[:t]) [b, s-1] from the trainer's model, fp64, on every rank."""
    from megatron_logra.model.logits import model_logits

    logits = model_logits(run.objs.model, rows, run.objs.arch.vocab_size)
    mine = None if logits is None else torch.log_softmax(logits.double(), -1)[:, :-1].gather(
        -1, rows[:, 1:, None]).squeeze(-1)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next(t for t in everyone if t is not None)


def engine_logprobs(run, rows: torch.Tensor) -> torch.Tensor | None:
    if dist.get_rank() != 0:
        return None
    return torch.tensor(run.engine.prompt_logprobs(rows.tolist()), dtype=torch.float64)


def plus_minus_advantages(samples: list) -> list:
    """An untrained model earns no reward (zero advantages, no update): +-1 advantages make
    the weights move, so a push has something to carry."""
    return [replace(s, advantage=1.0 if k % 2 else -1.0) for k, s in enumerate(samples)]


def batch_tokens(samples: list) -> dict:
    """The batch's own token counts (what the update's record must report)."""
    return {"batch_response_tokens": sum(len(s.response_ids) for s in samples),
            "batch_tokens": sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)}


def check_layout(argv: list[str], kill_engine: bool) -> dict:
    """One RL run with launcher flags ``argv``, checked as the module doc says."""
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage

    run = RLStage(parse_run_config(argv))
    rows = torch.randint(0, run.objs.arch.vocab_size, (3, 24),
                         generator=torch.Generator().manual_seed(5))
    result = {"diffs": {}, "versions": [], "records": []}
    first = trainer_logprobs(run, rows)

    def check(label: str) -> torch.Tensor:
        mine = trainer_logprobs(run, rows)
        theirs = engine_logprobs(run, rows)
        if theirs is not None:
            result["diffs"][label] = float((mine - theirs).abs().max())
            result["versions"].append([run.version, run.engine.version])
        return mine

    check("start")
    for update in range(2):
        rolled: dict = {}

        def forced(samples):
            rolled.update(advantages=[s.advantage for s in samples],
                          rewards=[s.reward for s in samples], **batch_tokens(samples))
            return plus_minus_advantages(samples)
        t0 = time.perf_counter()
        record = run.step(update, adjust_samples=forced)
        result["records"].append({**record, **rolled, "wall_s": time.perf_counter() - t0})
    after = check("after_2_updates")
    result["moved"] = float((after - first).abs().max())
    if kill_engine:
        if dist.get_rank() == 0:
            run.engine.owner.kill()  # the server dies at once, as in a crash
        run.rollout_batch(2)  # the dead engine is restarted and resynced before it generates
        check("after_restart")
    result["restarts"] = run.engine_restarts
    cores = [None] * dist.get_world_size()  # each trainer rank's CPU affinity
    dist.all_gather_object(cores, sorted(os.sched_getaffinity(0)))
    result["trainer_cores"] = cores
    if dist.get_rank() == 0:
        result["engine_cores"] = sorted(os.sched_getaffinity(run.engine.pid))
    result["optimizer_steps"] = getattr(run.objs.optimizer, "steps", None)
    run.close()
    return result


def main() -> None:
    from megatron_logra.runtime.device import init_runtime

    out_path, spec = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
    rt = init_runtime()
    result = {}
    for name, argv in spec["layouts"].items():
        result[name] = check_layout(argv, kill_engine=name in spec["kill_engine"])
        if rt.rank == 0:
            print(f"[rl worker] {name} done: {json.dumps(result[name]['diffs'])}", flush=True)
    write_result(result, out_path)


def write_result(result: dict, out_path: str) -> None:
    """Rank 0 writes ``result`` to ``out_path`` as JSON, then every rank waits (a worker's
    last step: the test reads the file once torchrun has returned)."""
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(result))
    dist.barrier()


def close_and_write(run, result: dict, out_path: str) -> None:
    """Close the run, then ``write_result``."""
    run.close()
    write_result(result, out_path)


if __name__ == "__main__":
    main()
