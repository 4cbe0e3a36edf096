"""Predicted-KL control of one RL update on the trainer (``--kl-control predicted``; with
``--kl-control measure`` alpha is 1 and the same K and realized KL are only logged).

Per update: the rollout/trainer mismatch of this batch updates m and the budget; the
optimizer steps held back (``kl/scaled_step``); one forward-mode pass on the
probe responses (the first ``--kl-probe-responses`` of each DP rank, each cut at
``--kl-probe-max-tokens`` tokens including its prompt: ``cap_probe``; their generated
positions) gives K; alpha = min(alpha_max, sqrt(budget / K)) scales the update; a plain
forward on the same probe tokens afterwards gives the realized KL(old || new). Every
rank gets the same K and alpha: the per-token sums are all-reduced over the world (only
the last stage contributes; its TP peers hold equal sums, so the total is divided by
TP). A probe without any generated position is an error, never an uncontrolled step.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.kl import budget as kl_budget
from megatron_logra.kl.config import KLControlConfig
from megatron_logra.kl.scaled_step import scaled_optimizer_step
from megatron_logra.kl.tangent_forward import UpdateTangents, logits_with_tangent
from megatron_logra.runtime.device import current_device, synchronize
from megatron_logra.runtime.host_read import host_value


def _global_mean(values: torch.Tensor | None) -> tuple[float, int]:
    """(mean, count) of per-token values [n] held by the last stage of every DP group."""
    total = torch.zeros(2, dtype=torch.float64, device=current_device())
    if values is not None:
        total[0], total[1] = values.double().sum(), values.numel()
    dist.all_reduce(total)
    total /= parallel_state.get_tensor_model_parallel_world_size()
    value_sum, value_count = host_value(total, assume=[1.0, 1.0])
    count = int(round(value_count))
    return (value_sum / value_count if count else 0.0), count


def _moved_anywhere(tangents: UpdateTangents | None) -> bool:
    """Whether the update moves any rank's weights (a global OR): a dense tangent or a
    low-rank factor c D with a nonzero entry (an update whose advantages were all zero has
    sketches, and so D, of zeros: it moves nothing, and K = 0 is right for it)."""
    moved = tangents is not None and (
        any(host_value(t.abs().max() > 0, assume=True) for t in tangents.dense.values()
            if t.numel())
        or any(t.coefficient != 0 and t.d.numel()
               and host_value(t.d.abs().max() > 0, assume=True)
               for t in tangents.low_rank.values()))
    flag = torch.tensor([float(moved)], device=current_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(host_value(flag, assume=[1.0])[0])


def require_tangent_reached(moved: bool) -> None:
    """K = 0 exactly (a Fisher form over logits whose tangent is zero everywhere) for an
    update that moved the weights means the forward-mode tangent never reached the logits:
    a layer without a jvp sits in the path (Transformer Engine's linears: the tangent is
    carried through megatron-core's local layers only). The control would then take
    alpha_max silently; refuse instead."""
    if moved:
        raise RuntimeError("predicted-KL control: the update moved the weights but its "
                           "tangent never reached the logits (K = 0): a layer without a "
                           "forward-mode jvp is in the model (Transformer Engine's "
                           "linears?); build the model with --transformer-impl local")


def cap_probe(probe: dict[str, torch.Tensor], max_tokens: int) -> dict[str, torch.Tensor]:
    """Each probe response cut at ``max_tokens`` tokens, prompt included (the reference's
    cap): a position stays in ``loss_mask`` only if the token it predicts is among the
    first ``max_tokens``. Trailing columns and rows with no position left are dropped
    (causal: the kept positions' logits do not change; a probe left empty keeps its first
    row, fully masked). Tensors [b] keep their kept rows, [b, s] are cut to [b', s'],
    attention_mask [b, 1, s, s] to [b', 1, s', s']."""
    mask = probe["loss_mask"] > 0
    kept = mask & (torch.arange(mask.shape[1], device=mask.device) < max_tokens - 1)[None, :]
    if host_value(torch.eq(kept, mask).all(), assume=True):  # a trace keeps the whole probe
        return probe
    rows = kept.any(dim=1).nonzero().squeeze(1)
    length = int(kept.any(dim=0).nonzero().max()) + 1 if rows.numel() else 1
    if not rows.numel():
        rows = torch.zeros(1, dtype=torch.long)
    out = {}
    for key, t in probe.items():
        t = t[rows.to(t.device)]
        if key == "attention_mask":
            t = t[:, :, :length, :length]
        elif t.dim() >= 2:
            t = t[:, :length]
        out[key] = t
    out["loss_mask"] = out["loss_mask"] * kept[rows, :length].to(out["loss_mask"])
    return out


def response_rows(x: torch.Tensor, mask: torch.Tensor, most: int) -> torch.Tensor:
    """``x[mask]`` for x [b, s, ...] and a bool mask [b, s]: the masked positions' rows
    [n, ...] in row-major order. Their count is read once on the host (``most``: the most
    there can be, what a trace without values takes)."""
    count = int(host_value(mask.sum(), assume=most))
    index = torch.nonzero_static(mask.reshape(-1), size=count).squeeze(1)
    return x.reshape(-1, *x.shape[2:]).index_select(0, index)


class PredictedKLStep:
    def __init__(self, cfg: KLControlConfig, *, temperature: float, vocab_size: int,
                 max_response_tokens: int | None = None):
        """``max_response_tokens``: the most generated tokens a probe response holds
        (--max-new-tokens; None: any position may be one)."""
        self.cfg, self.temperature, self.vocab_size = cfg, temperature, vocab_size
        self.max_response_tokens = max_response_tokens
        self.controller = kl_budget.KLController(cfg)
        self._old_logits: torch.Tensor | None = None  # probe rows [n, Vp/TP], old weights

    def _responses(self, x: torch.Tensor, probe: dict[str, torch.Tensor]) -> torch.Tensor:
        """The rows of ``x`` [b, s, ...] at the probe's response positions [n, ...]."""
        rows, length = probe["loss_mask"].shape
        most = rows * min(length, self.max_response_tokens or length)
        return response_rows(x, probe["loss_mask"].bool(), most)

    def _vocab_kwargs(self, local_vocab: int) -> dict:
        return {"temperature": self.temperature, "vocab_size": self.vocab_size,
                "vocab_start": parallel_state.get_tensor_model_parallel_rank() * local_vocab,
                "tp_group": parallel_state.get_tensor_model_parallel_group()}

    def quadratic_form(self, model, probe: dict[str, torch.Tensor],
                       tangents: UpdateTangents | None) -> float:
        """K averaged over the probe's response tokens (global); keeps the old logits."""
        out = logits_with_tangent(model, probe, tangents)
        values = None
        if out is not None:
            logits, tangent = out
            self._old_logits = self._responses(logits, probe)
            values = kl_budget.fisher_quadratic(self._old_logits,
                                                self._responses(tangent, probe),
                                                **self._vocab_kwargs(logits.shape[-1]))
        k, count = _global_mean(values)
        if count == 0:
            raise RuntimeError("the KL probe holds no generated position: every probe "
                               "response's prompt fills --kl-probe-max-tokens; raise it")
        if k == 0.0:
            require_tangent_reached(_moved_anywhere(tangents))
        return k

    def realized_kl(self, model, probe: dict[str, torch.Tensor]) -> float:
        """KL(old || new) on the probe's response tokens after the step."""
        out = logits_with_tangent(model, probe, None)
        values = None
        if out is not None:
            new = self._responses(out[0], probe)
            values = kl_budget.token_kl(self._old_logits, new,
                                        **self._vocab_kwargs(new.shape[-1]))
        self._old_logits = None
        return _global_mean(values)[0]

    def step(self, objs, update: int, probe: dict[str, torch.Tensor],
             mismatch: float | None) -> tuple[bool, float | None, dict]:
        """Observe the mismatch, take the scaled step, measure; (ok, grad norm, record)."""
        self.controller.observe_mismatch(mismatch)
        budget = self.controller.budget(update)
        probe = {k: v.to(current_device())
                 for k, v in cap_probe(probe, self.cfg.probe_max_tokens).items()}
        record = {"kl_budget": budget, "kl_mismatch_avg": self.controller.mismatch}
        probe_time = [0.0]  # the forward-mode pass and the realized-KL forward

        def choose_alpha(tangents: UpdateTangents) -> float:
            t0 = time.perf_counter()
            k = self.quadratic_form(objs.model, probe, tangents)
            synchronize()
            probe_time[0] += time.perf_counter() - t0
            alpha = (1.0 if self.cfg.control == "measure" else
                     kl_budget.step_scale(k, budget, self.cfg.alpha_max))
            record.update(kl_quadratic=k, alpha=alpha, kl_pred=alpha * alpha * k)
            return alpha

        ok, grad_norm, _ = scaled_optimizer_step(objs.optimizer, objs.model, choose_alpha)
        if ok:
            t0 = time.perf_counter()
            record["kl_realized"] = self.realized_kl(objs.model, probe)
            synchronize()
            probe_time[0] += time.perf_counter() - t0
        record["kl_probe_time_s"] = probe_time[0]
        return ok, grad_norm, record
