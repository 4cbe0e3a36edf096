"""One update: megatron's pipeline schedule over the microbatches, then the optimizer step."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_logra.runtime.device import current_device
from megatron_logra.training.loss import token_nll


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean NLL per loss token over the global batch
    tokens: int  # loss tokens in the global batch
    grad_norm: float | None
    update_successful: bool


def _loss_func(vocab_size: int, labels: torch.Tensor, loss_mask: torch.Tensor,
               logits: torch.Tensor):
    nll = token_nll(logits, labels, vocab_size)
    loss_sum = (nll * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().float(), loss_mask.sum().detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(vocab_size: int, data_iterator, model):
    batch = next(data_iterator)
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return logits, partial(_loss_func, vocab_size, batch["labels"], batch["loss_mask"])


def _to_device(microbatches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    device = current_device()
    return [{k: v.to(device, non_blocking=True) for k, v in mb.items()} for mb in microbatches]


def global_loss(reports: list[dict]) -> tuple[float, int]:
    """(mean loss, tokens) over the whole global batch, from each last-stage rank's reports.

    Every rank takes part; TP peers of the last stage hold equal sums, so the ratio is exact.
    """
    total = torch.zeros(2, dtype=torch.float64, device=current_device())
    for report in reports:
        total += report["lm loss"].to(total)
    dist.all_reduce(total)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    loss_sum, count = total[0].item(), total[1].item()
    return (loss_sum / count if count else float("nan")), int(round(count / tp))


def forward_backward(model, microbatches, *, seq_length: int, micro_batch_size: int,
                     vocab_size: int, forward_only: bool = False) -> list[dict]:
    for chunk in model:
        chunk.zero_grad_buffer()
    batches = _to_device(microbatches)
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, vocab_size),
        data_iterator=iter(batches),
        model=model,
        num_microbatches=len(batches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def train_step(objs, microbatches, *, seq_length: int, micro_batch_size: int) -> StepResult:
    objs.optimizer.zero_grad()
    reports = forward_backward(objs.model, microbatches, seq_length=seq_length,
                               micro_batch_size=micro_batch_size,
                               vocab_size=objs.arch.vocab_size)
    ok, grad_norm, _ = objs.optimizer.step()
    if ok:
        objs.scheduler.step(increment=1)
    loss, tokens = global_loss(reports)
    return StepResult(loss, tokens, None if grad_norm is None else float(grad_norm), bool(ok))
