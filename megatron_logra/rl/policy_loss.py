"""Rollouts as trainer microbatches, and the policy-gradient loss over vocab-parallel logits.

A rollout sample is prompt + response. As in SFT, ``labels[t] = tokens[t + 1]``;
the response tokens are the labels at positions ``len(prompt) - 1 ...``, where
``loss_mask`` is 1 and ``rollout_logprobs`` holds the engine's log-probabilities.

Log-probs are computed per microbatch with megatron's vocab-parallel cross entropy
(each TP rank holds [b, s, V/TP] of one microbatch; the full batch x length x vocab
tensor never exists), at the sampling temperature: log softmax(z / T).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.rl.advantages import policy_gradient_loss_sum, truncated_importance_weights
from megatron_logra.training.loss import token_nll

# report layout: what the loss function sums per microbatch (the trainer adds them up)
REPORT_KEYS = ("loss_sum", "tokens", "abs_mismatch_sum", "tis_weight_sum", "tis_capped",
               "eos_mismatch_sum", "eos_tokens")
"""eos_*: sum of (rollout - trainer) logprob over the tokens of EOS-terminated responses
(not truncated), and their count: the KL controller's mismatch m."""


@dataclass(frozen=True)
class RolloutSample:
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # one per response token
    advantage: float
    truncated: bool = False  # the response hit --max-new-tokens (no EOS)
    reward: float = 0.0  # the verifier's score the advantage came from


def collate_rollouts(samples: list[RolloutSample], seq_length: int,
                     pad_id: int) -> dict[str, torch.Tensor]:
    """Microbatch tensors [b, s] (attention_mask [b, 1, s, s], advantages [b]). A sample longer
    than seq_length + 1 tokens is an error (the engine's max_model_len prevents it)."""
    b = len(samples)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, seq_length), dtype=torch.float32)
    rollout_lp = torch.zeros((b, seq_length), dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = s.prompt_ids + s.response_ids
        if len(ids) > seq_length + 1:
            raise ValueError(f"rollout of {len(ids)} tokens exceeds --seq-length {seq_length} + 1: "
                             "lower --max-new-tokens or raise --seq-length")
        if len(s.rollout_logprobs) != len(s.response_ids):
            raise ValueError("one rollout logprob per response token expected")
        n = len(ids) - 1
        tokens[i, :n] = torch.tensor(ids[:-1])
        labels[i, :n] = torch.tensor(ids[1:])
        start = len(s.prompt_ids) - 1
        loss_mask[i, start:n] = 1.0
        rollout_lp[i, start:n] = torch.tensor(s.rollout_logprobs, dtype=torch.float32)
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "rollout_logprobs": rollout_lp,
            "advantages": torch.tensor([s.advantage for s in samples], dtype=torch.float32),
            "eos_terminated": torch.tensor([not s.truncated for s in samples],
                                           dtype=torch.float32),
            "position_ids": torch.arange(seq_length).unsqueeze(0).expand(b, -1).contiguous(),
            "attention_mask": causal.expand(b, 1, seq_length, seq_length).contiguous()}


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int,
                   temperature: float) -> torch.Tensor:
    """log pi(labels) at temperature T from vocab-parallel logits [b, s, Vp/TP] -> [b, s] fp32."""
    return -token_nll(logits.float() / temperature, labels, vocab_size)


def policy_gradient_loss(vocab_size: int, temperature: float, tis_cap: float | None,
                         batch: dict[str, torch.Tensor], logits: torch.Tensor):
    """The trainer's loss function (``training.step.LossFn``): sum over response tokens of
    -w A log pi (w: truncated importance weight pi_train / pi_rollout, or 1), normalised by
    the global number of response tokens (megatron's per-token loss)."""
    mask = batch["loss_mask"]
    logp = token_logprobs(logits, batch["labels"], vocab_size, temperature)
    rollout = batch["rollout_logprobs"]
    weights = None if tis_cap is None else truncated_importance_weights(logp, rollout, tis_cap)
    loss_sum = policy_gradient_loss_sum(logp, batch["advantages"], mask, weights)
    diff = (logp.detach() - rollout).abs() * mask
    w = weights if weights is not None else torch.ones_like(mask)
    eos_mask = mask * batch["eos_terminated"][:, None]
    report = torch.stack([loss_sum.detach(), mask.sum(), diff.sum(), (w * mask).sum(),
                          ((w >= tis_cap) * mask).sum() if tis_cap else mask.new_zeros(()),
                          ((rollout - logp.detach()) * eos_mask).sum(), eos_mask.sum()])
    return loss_sum, mask.sum().to(torch.int), {"lm loss": report.float()}
