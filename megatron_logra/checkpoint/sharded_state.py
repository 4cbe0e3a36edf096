"""What a training checkpoint holds, as megatron-core sharded state dicts.

The model's ``sharded_state_dict`` and the optimizer's (``fully_reshardable``, so the
optimizer state reshards across DP sizes too), and the two helpers a weights-only load
of a customized model needs (LoRA's adapters are not in a base model's checkpoint).
"""

from __future__ import annotations

from pathlib import Path

from megatron.core import dist_checkpointing

from megatron_logra.model.provider import unwrap

_OPT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def model_sharded_state_dict(model: list) -> dict:
    return unwrap(model[0]).sharded_state_dict()


def training_state_dict(objs, is_loading: bool, with_optimizer: bool) -> dict:
    """{"model": ..., "optimizer": ...} of ``TrainingObjects`` ``objs``."""
    model_sd = model_sharded_state_dict(objs.model)
    state = {"model": model_sd}
    if with_optimizer:
        state["optimizer"] = objs.optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                               metadata=_OPT_METADATA)
    return state


def without_missing_added_params(ckpt: Path, model: list, arch,
                                 model_sd: dict) -> tuple[dict, set[str]]:
    """``model_sd`` less the parameters a customization added (LoRA's adapters) that the
    checkpoint does not hold (a base model's checkpoint to start from: they keep their
    fresh values); returns (what to load, the state-dict keys left out)."""
    from megatron_logra.model.hf_mapping import megatron_param_names
    from megatron_logra.model.provider import canonical_param_names

    base = set(megatron_param_names(arch))
    added = {local.rsplit(".", 1)[-1]
             for local, canon in canonical_param_names(model[0], arch).items()
             if canon not in base}
    if not added:
        return model_sd, set()
    stored = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    left_out = {k for k, v in model_sd.items() if k.rsplit(".", 1)[-1] in added
                and not any(key == v.key or key.startswith(f"{v.key}.") for key in stored)}
    return {k: v for k, v in model_sd.items() if k not in left_out}, left_out


def load_state_checked(model: list, state: dict, left_out: set[str]) -> None:
    """``load_state_dict`` of this rank's chunk: strict, except for the ``left_out`` keys."""
    missing, unexpected = unwrap(model[0]).load_state_dict(state, strict=False)
    wrong = [k for k in missing if k not in left_out] + list(unexpected)
    if wrong:
        raise KeyError(f"checkpoint and model differ in {wrong[:5]}")
