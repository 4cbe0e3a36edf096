"""One server's checks, run inside a torchrun worker (``engine_urls_worker.py``, for
tests/distributed/test_engine_urls.py): an RL run whose engine is a vLLM server the test
started (``--rollout-engine-url URL``), checked from inside (``single_server_checks``).

After the start-up push (full), after each of two RL updates (sketch-delta pushes),
after a push whose delta base the server no longer serves (its version set behind the
trainer's back: the push goes full) and after a forced full push, rank 0 records: the
server's version, the HF tensors whose vLLM checksums differ from the trainer's
(``engine_mismatches``), the largest difference between the trainer's and the server's
logprobs on fixed token rows, the bytes and transport of the push; around each update's
rollouts, the server's generated-token counter (``/metrics``) against the tokens the
trainer received.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from rl_worker import engine_logprobs, plus_minus_advantages, trainer_logprobs


def generated_tokens(url: str, counter: str = "generation_tokens") -> float:
    """The server's ``vllm:{counter}_total`` (Prometheus text; ``prompt_tokens``: the
    prompt tokens it was sent)."""
    import requests

    text = requests.get(f"{url}/metrics", timeout=30).text
    return sum(float(m) for m in re.findall(rf"^vllm:{counter}_total\{{[^}}]*\}} (\S+)$",
                                            text, re.M))


def single_server_checks(argv: list[str]) -> dict:
    """The RL run of launcher flags ``argv`` (one ``--rollout-engine-url``), checked as the
    module doc says; rank 0's result: {"checks": [...], "rollouts": [...], "moved": ...}."""
    from megatron_logra.cli import parse_run_config
    from megatron_logra.rl.stage import RLStage

    cfg = parse_run_config(argv)
    url = cfg.rl.rollout.engine_url
    run = RLStage(cfg)
    rows = torch.randint(0, run.objs.arch.vocab_size, (3, 24),
                         generator=torch.Generator().manual_seed(5))
    result = {"checks": [], "rollouts": []}
    sent = [0]

    def check(label: str) -> None:
        mismatches = run.sync.engine_mismatches(run.engine)
        mine = trainer_logprobs(run, rows)
        theirs = engine_logprobs(run, rows)
        if dist.get_rank() == 0:
            result["checks"].append({
                "label": label, "mismatches": mismatches, "version": run.version,
                "server_version": run.engine.version, "transport": run.sync_stats.last_transport,
                "bytes": run.sync_stats.bytes - sent[0],
                "logprob_diff": float((mine - theirs).abs().max())})
        sent[0] = run.sync_stats.bytes

    check("start")
    first = trainer_logprobs(run, rows)
    for update in range(2):
        before = generated_tokens(url) if dist.get_rank() == 0 else 0.0
        sample_tokens = []

        def forced(samples):
            sample_tokens.append(sum(len(s.response_ids) for s in samples))
            return plus_minus_advantages(samples)
        run.step(update, adjust_samples=forced)  # a push generates nothing
        if dist.get_rank() == 0:
            result["rollouts"].append({"server_tokens": generated_tokens(url) - before,
                                       "sample_tokens": sample_tokens[0]})
        check(f"update {update + 1}")
    if dist.get_rank() == 0:  # behind the trainer's back: the next delta has no base
        run.engine.assume_version(7)
    run.version = 3
    run.push_weights()
    check("version changed")
    with run.sync.forcing("full"):
        run.push_weights()
    check("forced full")
    result["moved"] = float((trainer_logprobs(run, rows) - first).abs().max())
    run.close()
    return result
