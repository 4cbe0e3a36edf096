"""The batches a dry run trains on: the recipe's worst case, not generated.

RL: --prompts-per-step x --responses-per-prompt samples whose prompt and response both
sit at their length limits (the prompt at --seq-length - --max-new-tokens, the response
at --max-new-tokens, truncated: no EOS), so every microbatch is as long as the run
allows and every response token is trained. SFT: the global batch at --seq-length, every
token in the loss. Token values do not matter: the tensors are fake.
"""

from __future__ import annotations

from megatron_logra.config import RunConfig
from megatron_logra.rl.policy_loss import RolloutSample


def rl_samples(cfg: RunConfig) -> list[RolloutSample]:
    rl, seq = cfg.rl, cfg.training.seq_length
    prompt, response = [0] * (seq - rl.max_new_tokens), [0] * rl.max_new_tokens
    logprobs = [0.0] * rl.max_new_tokens
    return [RolloutSample(prompt, response, logprobs, advantage=1.0, truncated=True)
            for _ in range(rl.prompts_per_step * rl.responses_per_prompt)]


def sft_microbatches(cfg: RunConfig, dp_size: int) -> list[dict]:
    """This rank's microbatches of one SFT step, as ``data`` makes them: tokens,
    position_ids, attention_mask (``model.logits.causal_inputs``), labels [mbs, seq] and
    an fp32 loss_mask [mbs, seq] of ones."""
    import torch

    from megatron_logra.model.logits import causal_inputs

    t = cfg.training
    out = []
    for _ in range(t.global_batch_size // (dp_size * t.micro_batch_size)):
        tokens = torch.zeros(t.micro_batch_size, t.seq_length, dtype=torch.long)
        mb = causal_inputs(tokens)
        mb["labels"] = tokens
        mb["loss_mask"] = torch.ones(t.micro_batch_size, t.seq_length)
        out.append(mb)
    return out
