"""Patch: ``DistributedOptimizer._set_main_param_and_optimizer_states`` (megatron-core 0.16.x).

What it replaces: the copy loop that writes loaded tensors into each main param's
optimizer state. It iterates over the *destination* keys, which for torch Adam
include ``step``; ``load_parameter_state_from_fully_reshardable`` deliberately
leaves ``step`` out of the source (the step is restored from the common state),
so loading a ``fully_reshardable`` checkpoint raises ``KeyError: 'step'``.

Fix: copy only the keys the source provides. Results are identical: every key
that the original copies successfully is copied the same way; ``step`` keeps the
value that ``load_state_dict`` restored from the common state.

Supported: megatron-core 0.16.x (checked against 0.16.1); another version is refused
(``runtime.versions``).
"""

from __future__ import annotations

from megatron_logra.runtime import versions

@versions.patch_once("megatron_logra.patches.dist_optimizer_step_state")
def apply() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states_present_in_source(self, model_param, tensors):
        if self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            return original(self, model_param, tensors)
        group_index, group_order = self.model_param_group_index_map[model_param]
        main_param = self.optimizer.param_groups[group_index]["params"][group_order]
        destination = {"param": main_param, **self.optimizer.state[main_param]}
        for key, value in tensors.items():
            destination[key].copy_(value)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_present_in_source
