"""Which tasks give RL a learning signal on a model: its pass rates before any RL.

    python benchmarks/task_signal.py --model-dir models/smollm2-135m-instruct \
        --tasks basic_arithmetic,chain_sum,gcd,spell_backward,leg_counting

Samples ``--samples`` responses to each of ``--prompts`` prompts per task with a vLLM
engine (temperature 1, the RL rollouts' sampling) and scores them with the task's
verifier. A group-relative method (GRPO) learns only from prompts whose samples differ:
``prompts_with_a_correct`` is the fraction of prompts with at least one correct sample.
Prints one JSON object per task, then all of them.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", default="models/smollm2-135m-instruct", help="HF folder")
    p.add_argument("--tasks", required=True, help="comma list of reasoning-gym tasks")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    args = p.parse_args(argv)

    from megatron_logra.rollout.types import SampleRequest, ServerSpec
    from megatron_logra.data.tasks import generate_items
    from megatron_logra.data.tokenizer import load_tokenizer
    from megatron_logra.rl import prompts_and_scores
    from megatron_logra.rl.config import VerifierConfig
    from megatron_logra.rl.verifiers import Verifier
    from megatron_logra.rollout.vllm_server import VllmServer

    tokenizer = load_tokenizer(args.model_dir)
    engine = VllmServer.local(ServerSpec(args.model_dir, max_model_len=257, load_format="auto"),
                              Path("runs") / "task_signal_server.log", cuda=False)
    engine.assume_version(0)
    verifier = Verifier(VerifierConfig(reward="partial"))
    report = {}
    try:
        for task in args.tasks.split(","):
            items = generate_items(((task, 1.0),), args.prompts * 2, seed=7)
            prompts = prompts_and_scores.encode_prompts(items, tokenizer, 256 - args.max_new_tokens)
            prompts = prompts[:args.prompts]
            requests = [SampleRequest(pr.ids, seed=i * args.samples + j,
                                      max_new_tokens=args.max_new_tokens, temperature=1.0)
                        for i, pr in enumerate(prompts) for j in range(args.samples)]
            t0 = time.perf_counter()
            rewards = prompts_and_scores.score(verifier, tokenizer, prompts,
                                     engine.generate(requests, 0), args.samples)
            flat = [r for row in rewards for r in row]
            report[task] = {"correct": sum(r >= 1 for r in flat) / len(flat),
                            "partial_mean": sum(flat) / len(flat),
                            "prompts_with_a_correct": sum(any(r >= 1 for r in row)
                                                          for row in rewards) / len(rewards),
                            "seconds": time.perf_counter() - t0}
            print(json.dumps({task: report[task]}), flush=True)
    finally:
        engine.close()
        verifier.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
