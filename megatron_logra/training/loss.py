"""Token losses over vocab-parallel logits, with the padded vocab rows masked out.

Padded vocab entries (rows >= the true vocab size) must not take probability
mass: HF and vLLM slice them off, so the trainer's softmax must ignore them too.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state, tensor_parallel


def mask_padded_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """logits: [..., Vp/TP] this rank's vocab shard -> same, padded entries set to -inf."""
    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    n_pad = start + shard - vocab_size
    if n_pad <= 0:
        return logits
    valid = torch.arange(start, start + shard, device=logits.device) < vocab_size
    return logits.masked_fill(~valid, float("-inf"))


def token_nll(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Per-token negative log-likelihood. logits [b, s, Vp/TP], labels [b, s] -> [b, s] fp32."""
    logits = mask_padded_vocab(logits.float(), vocab_size)
    return tensor_parallel.vocab_parallel_cross_entropy(logits.contiguous(), labels)
