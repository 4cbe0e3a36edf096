"""torchrun worker of tests/distributed/test_async_rollouts.py: one asynchronous RL run
into two engine replicas, checked from inside.

    torchrun --nproc-per-node 2 tests/distributed/async_worker.py OUT.json [launcher flags]

Eight updates (the flags ask for --async-rollouts --rollout-replicas 2 --train-iters 8):

- updates 1-2: one step off (batch 0 generated at start, batch 1 beside update 1);
- engine 0 is killed after update 2, while nothing runs: batch 3, generated beside
  update 3, fails on it, update 3's push restarts and resyncs it alone, and batch 3 is
  generated again (``rollouts_regenerated``);
- update 5 under a KL bound of 1e-12 (the run's own is set back after it): its batch,
  one version old, moved more than that, so every sample is dropped and nothing trains;
- batch 8 is started by hand two versions early: at update 8 it is two versions old,
  beyond --max-staleness 1, and dropped.
After every update both engines' weights are checked against the trainer's (vLLM's
checksums) and against each other. Rank 0 writes {"steps": [...], "restarts": ...}.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import torch.distributed as dist

from rl_worker import batch_tokens, close_and_write, plus_minus_advantages


def main() -> None:
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage

    out_path, argv = sys.argv[1], sys.argv[2:]
    run = RLStage(parse_run_config(argv))
    link, weights = run.engines.engines, run.sync
    result = {"steps": [], "start": _engines(run, link, weights)}
    own_bound = run.bound
    for update in range(run.cfg.training.train_iters):
        if update == 2 and dist.get_rank() == 0:
            link.servers[0].owner.kill()  # as in a crash
        if update == 4:
            run.bound = replace(own_bound, max_staleness_kl=1e-12)
        seen: dict = {}

        def forced(samples):
            seen.update(versions=[s.version for s in samples],
                        weights=[s.weight for s in samples], **batch_tokens(samples))
            return plus_minus_advantages(samples)
        version_before = run.version
        t0 = time.perf_counter()
        record = run.step(update, adjust_samples=forced)
        seen["wall_s"] = time.perf_counter() - t0
        run.bound = own_bound
        if update == 4:  # batch 7 (update 8) generated now, two versions before it trains
            run.ahead.start(7, run.version)
        result["steps"].append({"record": record, "version_before": version_before,
                                "version_after": run.version, **seen,
                                "engines": _engines(run, link, weights)})
    result["restarts"] = run.engine_restarts
    close_and_write(run, result, out_path)


def _engines(run, link, weights) -> dict:
    """Each engine's version and mismatching tensors against the trainer, and whether the
    engines' checksums agree (collective; rank 0's figures)."""
    mismatches = []
    for replica in range(link.replicas):
        weights.use(replica)
        mismatches.append(weights.engine_mismatches(link.servers[replica]))
    if dist.get_rank() != 0:
        return {}
    sums = [engine.checksums() for engine in link.servers]
    return {"versions": [e.version for e in link.servers], "mismatches": mismatches,
            "checksums_equal": all(s == sums[0] for s in sums), "trainer": run.version}


if __name__ == "__main__":
    main()
