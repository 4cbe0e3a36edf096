"""Forward-only logits of a (TP/PP-sharded) GPTModel, through megatron's pipeline schedule."""

from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from megatron_logra.runtime.device import current_device


def causal_inputs(tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """tokens [b, s] -> the model's inputs: positions [b, s], causal mask [b, 1, s, s] (True=masked)."""
    b, s = tokens.shape
    device = current_device()
    return {"tokens": tokens.to(device),
            "position_ids": torch.arange(s, device=device).unsqueeze(0).expand(b, -1),
            "attention_mask": torch.triu(torch.ones(s, s, dtype=torch.bool, device=device),
                                         1).expand(b, 1, s, s)}


def _collect(vocab_size: int, logits: torch.Tensor):
    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
    zero = logits.sum() * 0.0
    return zero, torch.tensor(1, device=logits.device), {"logits": full.detach().float().cpu()}


def _step(vocab_size: int, data_iterator, model):
    batch = next(data_iterator)
    out = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return out, partial(_collect, vocab_size)


@torch.no_grad()
def model_logits(model: list[torch.nn.Module], tokens: torch.Tensor,
                 vocab_size: int) -> torch.Tensor | None:
    """Full-vocab fp32 CPU logits [b, s, vocab_size] on the last pipeline stage, None elsewhere.

    model: this rank's model chunks (the list megatron's schedules take); tokens: [b, s].
    """
    for chunk in model:
        chunk.eval()
    b, s = tokens.shape
    out = get_forward_backward_func()(
        forward_step_func=partial(_step, vocab_size),
        data_iterator=iter([causal_inputs(tokens)]),
        model=model,
        num_microbatches=1,
        seq_length=s,
        micro_batch_size=b,
        forward_only=True,
    )
    if not parallel_state.is_pipeline_last_stage():
        return None
    return out[0]["logits"]
