"""How each update compares with dense Adam's: a diagnostic (``--log-adam-cosine``).

Per optimizer step, the cosine between the update this run applied to the layers'
linear weights (q/k/v, o, gate/up, down: megatron's linear_qkv, linear_proj, linear_fc1,
linear_fc2) and the step dense Adam would take from the same gradients:

    G_t = dY^T X                     the dense gradient of each weight, whatever the method
                                     (LoGRA never forms it; LoRA's base is frozen): taken
                                     from the layer's input X and output gradient dY by hooks
    m_t = b1 m + (1 - b1) G_t,  v_t = b2 v + (1 - b2) G_t^2        a shadow Adam state
    U_t = (m_t / (1 - b1^t)) / (sqrt(v_t / (1 - b2^t)) + eps)      dense Adam's direction
    cos_t = <-dW_t, U_t> / (|dW_t| |U_t|)   over all those weights (and per kind)

with dW_t the change of the weights the engine serves (LoRA: W + (alpha / r) B A). The
shadow is driven by the run's own gradients, so it is the direction dense Adam would
take at the run's point; a dense Adam run gets cos = 1 (up to rounding) when it does not
clip (``--clip-grad 0``), which is the check that the diagnostic is right.

Costs a dense weight gradient per weight and four fp32 copies of those weights (G, m, v
and the weights before the step): a diagnostic for comparisons, not for memory-lean runs.
It changes nothing the run computes (hooks read, never write). The shadow state is not
checkpointed: a resumed run starts it empty, and ``adam_cosine_history`` (the gradients
it has seen) says so.

G is megatron's gradient: summed over the microbatches and the data-parallel ranks and
divided by the step's global loss-token count, as megatron's per-token loss does
(``finalize_model_grads``, whose count the probe reads by wrapping the model config's
``finalize_model_grads_func``). Tensor parallel: a column-parallel rank's G is the rows
it holds (dY_t^T X), a row-parallel rank's the columns (dY^T X_t); the dot products and
norms are summed over the model-parallel group (every shard once). Sequence parallel is
refused (the hooked input would be a slice).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from megatron_logra.model.provider import unwrap
from megatron_logra.runtime.device import current_device

KINDS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def _served_weight(module) -> torch.Tensor:
    """The weight the engine serves for this layer (LoRA: W + (alpha / r) B A), fp32."""
    served = getattr(module, "served_weight", None)
    return (served() if served is not None else module.weight.detach()).float()


class AdamCosine:
    """Hooks on every targeted linear of ``model_chunks``; ``before_step``/``after_step``
    around each optimizer step."""

    def __init__(self, model_chunks: list, *, beta1: float, beta2: float, eps: float):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.modules: dict[str, torch.nn.Module] = {}
        for chunk in model_chunks:
            for name, module in unwrap(chunk).named_modules():
                kind = name.rsplit(".", 1)[-1]
                if kind in KINDS and isinstance(module, (ColumnParallelLinear,
                                                         RowParallelLinear)):
                    if getattr(module, "sequence_parallel", False):
                        raise ValueError("--log-adam-cosine does not support sequence "
                                         "parallel (its hooks read each layer's whole input)")
                    self.modules[name] = module
                    module.register_forward_hook(self._forward_hook)
        self._name = {id(m): n for n, m in self.modules.items()}
        config = unwrap(model_chunks[0]).config
        if not config.calculate_per_token_loss:
            raise ValueError("--log-adam-cosine scales gradients as megatron's per-token "
                             "loss does; the model was built without it")
        finalize = config.finalize_model_grads_func
        self.num_tokens = 1.0

        def finalize_and_count(model, num_tokens, *args, **kwargs):
            out = finalize(model, num_tokens, *args, **kwargs)  # leaves num_tokens global
            self.num_tokens = float(num_tokens) if num_tokens is not None else 1.0
            return out

        config.finalize_model_grads_func = finalize_and_count
        self.grads: dict[str, torch.Tensor] = {}  # G [out_local, in_local] fp32, summed
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.before: dict[str, torch.Tensor] = {}
        self.steps = 0

    def _forward_hook(self, module, inputs, output) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if not (torch.is_grad_enabled() and out.requires_grad):
            return  # no-grad passes: the KL probe, old logprobs, evaluation
        x = inputs[0].detach()
        name = self._name[id(module)]
        out.register_hook(lambda dy: self._accumulate(name, x, dy))

    def _accumulate(self, name: str, x: torch.Tensor, dy: torch.Tensor) -> None:
        """G += dY^T X for one microbatch: x [s, b, in], dy [s, b, out]."""
        g = dy.reshape(-1, dy.shape[-1]).float().t() @ x.reshape(-1, x.shape[-1]).float()
        if name in self.grads:
            self.grads[name] += g
        else:
            self.grads[name] = g

    def begin(self) -> None:
        """Start an optimizer step's gradient (drops a skipped step's)."""
        self.grads.clear()

    def before_step(self) -> None:
        """The weights before the step (call after the backward, before the step)."""
        self.before = {n: _served_weight(m).clone() for n, m in self.modules.items()}

    def after_step(self, ok: bool) -> dict:
        """Fold this step's gradient into the shadow Adam and compare; {} for a skipped
        step. Collective over the world (every rank calls it)."""
        if not ok:
            self.before, self.grads = {}, {}
            return {}
        dp = parallel_state.get_data_parallel_world_size()
        self.steps += 1
        b1, b2, t = self.beta1, self.beta2, self.steps
        # per kind: <-dW, U>, |dW|^2, |U|^2
        sums = torch.zeros(len(KINDS), 3, dtype=torch.float64)
        for name, module in self.modules.items():
            g = self.grads.get(name)
            if g is None:  # a layer that got no gradient this step (no loss tokens)
                g = torch.zeros_like(self.before[name])
            if dp > 1:
                dist.all_reduce(g, group=parallel_state.get_data_parallel_group())
            if self.num_tokens > 0:
                g /= self.num_tokens
            m = self.m.setdefault(name, torch.zeros_like(g))
            v = self.v.setdefault(name, torch.zeros_like(g))
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            u = (m / (1 - b1 ** t)) / ((v / (1 - b2 ** t)).sqrt() + self.eps)
            delta = _served_weight(module) - self.before[name]
            row = sums[KINDS.index(name.rsplit(".", 1)[-1])]
            row += torch.stack([-(delta.double() * u.double()).sum(),
                                delta.double().square().sum(), u.double().square().sum()])
        self.before, self.grads = {}, {}
        sums = sums.to(current_device())
        dist.all_reduce(sums, group=parallel_state.get_model_parallel_group())
        sums = sums.cpu()
        record = {"adam_cosine_history": self.steps}
        for key, row in (("adam_cosine", sums.sum(dim=0)), *(
                (f"adam_cosine_{kind.removeprefix('linear_')}", r)
                for kind, r in zip(KINDS, sums))):
            dot, aa, bb = (float(x) for x in row)
            if aa > 0 and bb > 0:  # left out where the update or Adam's step is zero
                record[key] = dot / math.sqrt(aa * bb)
        return record
