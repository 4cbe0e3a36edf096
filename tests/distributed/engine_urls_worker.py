"""torchrun worker of tests/distributed/test_engine_urls.py: RL runs pointed at the vLLM
servers the test started, one after another in one launch, checked from inside.

    torchrun --nproc-per-node 2 tests/distributed/engine_urls_worker.py OUT.json RUN_DIR \
        SPEC.json

SPEC.json: ``{"single": [trainer flags], "urls": [trainer flags]}``. First "single", the
docs' single-server trainer pointed at the second server alone (``--rollout-engine-url
URL_B``), checked by ``server_worker.single_server_checks``. Then "urls", the docs'
trainer pointed at both (``--rollout-engine-url URL_A,URL_B``), at TP2 and at DP2. For
each of these two layouts, around each of ``UPDATES`` updates, rank 0 records each server's
generated- and prompt-token counters (``/metrics``) and each sample's response and
prompt lengths (in the order of the requests, which are split over the servers in
order), the update's push
transport and, per server, the HF tensors whose vLLM checksums differ from the trainer's.
In the last layout the test's second server is killed (its process group,
``ENGINE_URLS_KILL_PGID``) before one more update: rank 0 records the error the run
stopped with and how long it took.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist

from rl_worker import plus_minus_advantages, write_result
from server_worker import generated_tokens, single_server_checks

UPDATES = 2
KILL_PGID = "ENGINE_URLS_KILL_PGID"
WAIT_S = "5"  # --rollout-engine-url-wait-s: the killed server is waited for this long


def _layouts(flags: list[str]) -> dict[str, list[str]]:
    """The docs' command (TP2) and the same at DP2 (TP1 over the two processes)."""
    k = flags.index("--tensor-model-parallel-size")
    assert flags[k + 1] == "2", flags
    return {"tp2": flags, "dp2": [*flags[:k], *flags[k + 2:]]}


def _per_server_mismatches(run) -> list[int | None]:
    """Each server's HF tensors held differently from the trainer (collective)."""
    out = []
    for replica in range(run.engines.replicas):
        run.sync.use(replica)
        out.append(run.sync.engine_mismatches(run.engines.engines.servers[replica]))
    return out


def _check_layout(argv: list[str], kill: bool) -> dict:
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage

    cfg = parse_run_config(argv)
    urls, rank0 = cfg.rl.rollout.engine_urls, dist.get_rank() == 0
    run = RLStage(cfg)
    out = {"urls": list(urls), "start_mismatches": _per_server_mismatches(run), "updates": [],
           "server_tp": [s.world_size for s in run.engines.engines.servers] if rank0 else []}
    try:
        for update in range(UPDATES):
            before = [(generated_tokens(u), generated_tokens(u, "prompt_tokens"))
                      for u in urls] if rank0 else []
            tokens = []

            def record(samples):
                tokens.append(([len(s.response_ids) for s in samples],
                               [len(s.prompt_ids) for s in samples]))
                return plus_minus_advantages(samples)
            rec = run.step(update, adjust_samples=record)
            mismatches = _per_server_mismatches(run)
            if rank0:
                out["updates"].append({
                    "server_tokens": [generated_tokens(u) - b for u, (b, _) in zip(urls, before)],
                    "server_prompt_tokens": [generated_tokens(u, "prompt_tokens") - b
                                             for u, (_, b) in zip(urls, before)],
                    "sample_tokens": tokens[0][0], "prompt_tokens": tokens[0][1],
                    "transport": rec["sync_transport"],
                    "mismatches": mismatches, "checksum_mismatches": rec["checksum_mismatches"],
                    "restarts": rec["engine_restarts"]})
        if kill:
            if rank0:
                os.killpg(int(os.environ[KILL_PGID]), signal.SIGKILL)  # a crash, mid-run
            t0 = time.monotonic()
            try:
                run.step(UPDATES, adjust_samples=plus_minus_advantages)
                out["after_kill"] = "the run went on"
            except RuntimeError as exc:
                out["after_kill"] = str(exc)
            out["stop_s"] = time.monotonic() - t0
    finally:
        run.close()
    return out


def main() -> None:
    from megatron_logra.runtime.device import init_runtime

    faulthandler.dump_traceback_later(1200, exit=True)  # a hang prints every thread's stack
    out_path, run_dir, spec = sys.argv[1], sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
    rt = init_runtime()
    result = {"single": single_server_checks([*spec["single"], "--output-dir",
                                              f"{run_dir}/single"])}
    if rt.rank == 0:
        print(f"[engine urls] single: {json.dumps(result['single'])}", flush=True)
    layouts = _layouts(spec["urls"])
    for name, layout in layouts.items():
        argv = [*layout, "--rollout-engine-url-wait-s", WAIT_S,
                "--output-dir", f"{run_dir}/{name}"]
        result[name] = _check_layout(argv, kill=name == list(layouts)[-1])
        if rt.rank == 0:
            print(f"[engine urls] {name}: {json.dumps(result[name])}", flush=True)
    write_result(result, out_path)


if __name__ == "__main__":
    main()
