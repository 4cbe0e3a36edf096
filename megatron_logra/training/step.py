"""One update: megatron's pipeline schedule over the microbatches, then the optimizer step.

The learning-rate schedule is advanced *before* the step, so update i (0-based) uses
megatron's schedule at step i + 1: linear warm-up (i + 1) / W from the first update
(never a zero-lr first step), then the decay, as the paper's dense baseline
(warm-up (i+1)/9, cosine to 0.1 x lr over 300 updates: ``--lr-warmup-iters 9
--lr-decay-iters 300 --lr-decay-style cosine --min-lr 0.1*LR``). A skipped step
(non-finite grads) takes the schedule back.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_logra.runtime.device import current_device
from megatron_logra.runtime.faults import maybe_fail
from megatron_logra.runtime.host_read import host_value
from megatron_logra.runtime.phase_times import PHASES
from megatron_logra.training.loss import token_nll


@dataclass(frozen=True)
class StepResult:
    loss: float  # mean NLL per loss token over the global batch
    tokens: int  # loss tokens in the global batch
    grad_norm: float | None
    update_successful: bool
    lr: float  # the learning rate this update used


LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple]
"""(microbatch, vocab-parallel logits [b, s, Vp/TP]) -> (loss_sum, num_tokens, {"lm loss":
tensor([loss_sum, tokens, ...])}): megatron's per-token-loss contract."""


def nll_loss(vocab_size: int, batch: dict[str, torch.Tensor], logits: torch.Tensor):
    """Supervised loss: summed NLL of the loss-masked tokens."""
    loss_mask = batch["loss_mask"]
    nll = token_nll(logits, batch["labels"], vocab_size)
    loss_sum = (nll * loss_mask).sum()
    num_tokens = loss_mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach().float(), loss_mask.sum().detach().float()])
    return loss_sum, num_tokens, {"lm loss": report}


def _forward_step(loss_fn: LossFn, data_iterator, model):
    batch = next(data_iterator)
    logits = model(batch["tokens"], batch["position_ids"], batch["attention_mask"])
    return logits, partial(loss_fn, batch)


def _to_device(microbatch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    device = current_device()
    return {k: v.to(device, non_blocking=True) for k, v in microbatch.items()}


def global_report_sums(reports: list[dict], width: int) -> list[float]:
    """The first ``width`` numbers of the loss reports summed over the global batch. Every
    rank takes part (ranks off the last stage contribute zeros); the last stage's TP peers
    hold equal sums, so the total is divided by TP."""
    total = torch.zeros(width, dtype=torch.float64, device=current_device())
    for report in reports:
        total += report["lm loss"][:width].to(total)
    dist.all_reduce(total)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    return host_value(total / tp, assume=[1.0] * width)


def forward_backward(model, microbatches, *, seq_length: int, micro_batch_size: int,
                     vocab_size: int, forward_only: bool = False,
                     loss_fn: LossFn | None = None) -> list[dict]:
    """megatron's schedule over the microbatches; ``loss_fn`` defaults to ``nll_loss``. Each
    microbatch reaches the device when the schedule takes it (the pipeline holds only those
    in flight, not the whole update's batch: 16 MiB of attention mask alone per 4096-token
    sequence)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    return get_forward_backward_func()(
        forward_step_func=partial(_forward_step, loss_fn or partial(nll_loss, vocab_size)),
        data_iterator=map(_to_device, microbatches),
        model=model,
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )


def _finite_update(objs, loss_sum: float) -> bool:
    """False when the global loss sum, any rank's gradients (megatron's DDP grad buffers) or
    (LoGRA) any rank's reduced sketches are not finite: the step is then skipped on every
    rank (the loss is the same everywhere; the rest is one MIN all-reduce). The buffers are
    summed, not tested element by element: a bool copy of every gradient would raise the
    step's peak memory by a quarter of the fp32 grads (an overflowing sum of finite
    gradients, which would also skip, signals a step gone wrong anyway)."""
    tensors = [buffer.grad_data for chunk in objs.model
               for buffer in getattr(chunk, "buffers", []) +
               getattr(chunk, "expert_parallel_buffers", [])]
    tensors += objs.logra.sketch_buffers() if objs.logra is not None else []
    flag = torch.full((1,), 1.0 if math.isfinite(loss_sum) else 0.0, device=current_device())
    if tensors:  # a sum carries any NaN or inf: one pass, no buffer-sized temporary
        total = torch.stack([t.sum(dtype=torch.float32) for t in tensors]).sum()
        flag *= torch.isfinite(total).float()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(host_value(flag, assume=[1.0])[0])


class SkippedUpdatesError(RuntimeError):
    """Too many updates in a row were skipped (non-finite loss, sketches or grads)."""


@dataclass
class SkippedUpdates:
    """Counts skipped updates in a row and stops the run at ``limit`` (0: never)."""

    limit: int
    in_a_row: int = 0

    def record(self, ok: bool, update: int, *, announce: bool) -> None:
        if ok:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if announce:
            print(f"update {update} skipped: non-finite loss or gradients (weights and "
                  f"optimizer state untouched; {self.in_a_row} in a row)", flush=True)
        if self.limit and self.in_a_row >= self.limit:
            raise SkippedUpdatesError(
                f"{self.in_a_row} updates in a row (up to update {update}) had a non-finite "
                f"loss or gradients and were skipped: the run stops (--max-skipped-updates "
                f"{self.limit}). Lower --lr or check the data; resume from the last "
                f"checkpoint with --load")


OptimizerStep = Callable[[list[dict]], tuple[bool, float | None]]
"""(this rank's loss reports) -> (update successful, grad norm): replaces the plain
``optimizer.step()`` (e.g. a step scaled by predicted-KL control)."""


def train_step(objs, microbatches, *, seq_length: int, micro_batch_size: int,
               loss_fn: LossFn | None = None, reports_out: list | None = None,
               optimizer_step: OptimizerStep | None = None,
               advance_schedule: bool = True, update: int = 0) -> StepResult:
    """One optimizer step. ``reports_out`` (a list) receives the last stage's loss reports;
    ``advance_schedule`` False keeps the learning rate where it is (the later optimizer
    steps of one RL update: the schedule counts updates); ``update`` (1-based) names the
    step to ``runtime.faults``."""
    objs.optimizer.zero_grad()
    if advance_schedule:
        objs.scheduler.step(increment=1)
    lr = float(objs.optimizer.param_groups[0]["lr"])
    with PHASES("forward_backward"):  # megatron's grad finalisation included
        reports = forward_backward(objs.model, microbatches, seq_length=seq_length,
                                   micro_batch_size=micro_batch_size,
                                   vocab_size=objs.arch.vocab_size, loss_fn=loss_fn)
    if reports_out is not None:
        reports_out.extend(reports)
    maybe_fail("backward", update)
    loss_sum, count = global_report_sums(reports, 2)  # a batch without loss tokens: sum 0
    loss, tokens = (loss_sum / count if count else float("nan")), int(round(count))
    if _finite_update(objs, loss_sum):
        with PHASES("optimizer_step"):
            if optimizer_step is None:
                ok, grad_norm, _ = objs.optimizer.step()
            else:
                ok, grad_norm = optimizer_step(reports)
    else:  # weights and optimizer state untouched; the grads and sketches are dropped
        objs.optimizer.zero_grad()
        ok, grad_norm = False, None
    maybe_fail("optimizer", update)
    if not ok and advance_schedule:
        objs.scheduler.step(increment=-1)
    return StepResult(loss, tokens, None if grad_norm is None else float(grad_norm), bool(ok),
                      lr)
