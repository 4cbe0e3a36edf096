"""megatron-core's optimizer internals, read in one place (megatron-core 0.16.x).

Not a patch: nothing of megatron is replaced or changed. But these functions read
attributes megatron-core does not document, so they are tied to its layout, checked
against 0.16.1 (importing this module refuses another version: ``runtime.versions``):

- ``ChainedOptimizer.chained_optimizers``;
- of each sub-optimizer (``MegatronOptimizer``): the inner torch optimizer
  ``optimizer`` (its ``param_groups`` hold the fp32 main params: shards of the param
  buffer with the distributed optimizer, fp32 copies of bf16 params, or the model params
  themselves for fp32 without it; its ``state`` holds Adam's moments),
  ``_copy_main_params_to_model_params()`` and ``reload_model_params()``;
- of ``Float16OptimizerWithFloat16Params``: ``float16_groups`` /
  ``fp32_from_float16_groups``;
- of ``DistributedOptimizer``: ``model_float16_groups`` /
  ``shard_fp32_from_float16_groups``, ``_get_model_param_range_map(param)["param"]``,
  ``data_parallel_group`` and ``model_chunks`` (the DDP chunks' ``start_param_sync``).

Who reads them: ``kl.held_back_step`` (the held-back, rescaled step), ``checkpoint.load``
(Adam state before a load, main params after the weights changed) and the memory
benchmark (``benchmarks/_train_probe.py``). Check the attributes above before widening
the supported version.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_logra.runtime import versions

versions.require("megatron-core", "megatron_logra.runtime.megatron_optimizer")


def sub_optimizers(optimizer: MegatronOptimizer | None) -> list[MegatronOptimizer]:
    """The megatron optimizers inside a ``ChainedOptimizer`` (or the optimizer itself;
    none for None)."""
    if optimizer is None:
        return []
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def torch_optimizers(optimizer: MegatronOptimizer | None) -> list[torch.optim.Optimizer]:
    """The inner torch optimizers (Adam) of every sub-optimizer that has one."""
    return [sub.optimizer for sub in sub_optimizers(optimizer)
            if getattr(sub, "optimizer", None) is not None]


def main_params(sub: MegatronOptimizer) -> list[torch.Tensor]:
    """The params a sub-optimizer's torch optimizer steps (the fp32 main params)."""
    return [p for group in sub.optimizer.param_groups for p in group["params"]]


def fp32_copies(sub: MegatronOptimizer) -> dict[int, tuple[torch.nn.Parameter, int, int]]:
    """id(main param) -> (model param, start, end): the mains that are fp32 copies of a
    lower-precision model param, and which flat range of it each holds."""
    if isinstance(sub, DistributedOptimizer):
        out = {}
        for models, mains in zip(sub.model_float16_groups, sub.shard_fp32_from_float16_groups):
            for param, main in zip(models, mains):
                owned = sub._get_model_param_range_map(param)["param"]
                out[id(main)] = (param, owned.start, owned.end)
        return out
    pairs = zip(getattr(sub, "float16_groups", []), getattr(sub, "fp32_from_float16_groups", []))
    return {id(main): (param, 0, param.numel())
            for models, mains in pairs for param, main in zip(models, mains)}


def fp32_main_copies(sub: MegatronOptimizer) -> Iterator[torch.Tensor]:
    """Every fp32 copy of a lower-precision model param a sub-optimizer holds."""
    for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
        for group in getattr(sub, attr, None) or []:
            yield from group


def data_parallel_group(sub: MegatronOptimizer):
    """The group a distributed optimizer shards its main params over (None otherwise)."""
    return sub.data_parallel_group if isinstance(sub, DistributedOptimizer) else None


def copy_main_to_model(sub: MegatronOptimizer) -> None:
    """Model params <- main params, as megatron's own step ends."""
    sub._copy_main_params_to_model_params()


def gather_model_params(sub: MegatronOptimizer) -> None:
    """A distributed optimizer's updated shards all-gathered over DP into every rank's
    model params, as megatron's own step ends (nothing for the others)."""
    if isinstance(sub, DistributedOptimizer):
        for chunk in sub.model_chunks:
            chunk.start_param_sync(force_sync=True)


def materialize_adam_state(optimizer: MegatronOptimizer | None) -> None:
    """Give every param Adam state with one common ``step`` before loading into it.

    megatron-core 0.16.1's DistributedOptimizer.state_dict() asserts a single distinct
    step, which a never-stepped torch Adam lacks; the values are overwritten by the load.
    """
    for torch_opt in torch_optimizers(optimizer):
        for group in torch_opt.param_groups:
            for param in group["params"]:
                state = torch_opt.state[param]
                state.setdefault("exp_avg", torch.zeros_like(param))
                state.setdefault("exp_avg_sq", torch.zeros_like(param))
                state.setdefault("step", torch.tensor(0.0))


def reload_model_params(optimizer: MegatronOptimizer | None) -> None:
    """Refresh megatron's fp32 main params from the model params (changed underneath)."""
    for sub in sub_optimizers(optimizer):
        reload = getattr(sub, "reload_model_params", None)
        if reload is not None:
            reload()
