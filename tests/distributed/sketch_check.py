"""In a torchrun worker: every sketch S of this rank vs the dense G A^T at a TP/PP layout.

The dense and the sketched model are built from the same seed at the layout; one
batch runs through megatron's pipeline schedule in each. For a column-parallel
weight the reference is the local dense gradient times A^T; for a row-parallel one
it is G[:, c0:c1] A[:, c0:c1]^T summed over the TP group (what S is after its
reduction). Returns the worst relative error over all ranks and weights.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state


def sketch_vs_dense(tp: int, pp: int, world_size: int) -> dict:
    from megatron_logra.config import LograConfig, OptimizerConfig
    from megatron_logra.logra.config import TARGETS
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig, unwrap
    from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.testing.batches import random_microbatches
    from megatron_logra.training.build import build_training_objects
    from megatron_logra.training.step import forward_backward

    initialize(ParallelConfig(tp, pp), world_size, seed=11)
    arch = load_arch(EMBEDDED_DEFAULT)
    dense = build_training_objects(arch, ModelBuildConfig(), OptimizerConfig(name="adam"),
                                   seed=11, train_iters=2)
    sketched = build_training_objects(
        arch, ModelBuildConfig(), OptimizerConfig(name="logra", logra=LograConfig(rank=16, targets=TARGETS)),
        seed=11, train_iters=2)
    batch = random_microbatches(arch.vocab_size, count=2, batch=2, seq=32, seed=2)
    for objs in (dense, sketched):
        objs.optimizer.zero_grad()
        forward_backward(objs.model, batch, seq_length=32, micro_batch_size=2,
                         vocab_size=arch.vocab_size)
    dense_params = dict(unwrap(dense.model[0]).named_parameters())
    worst, kinds = 0.0, set()
    for local_name, weight in unwrap(sketched.model[0]).named_parameters():
        slot = getattr(weight, "logra_slot", None)
        if slot is None:
            continue
        want = dense_params[local_name].main_grad.float() @ slot.projection.t()
        if slot.parallel == "row" and tp > 1:
            dist.all_reduce(want, group=parallel_state.get_tensor_model_parallel_group())
        worst = max(worst, float((slot.sketch - want).abs().max() / want.abs().max()))
        kinds.add(local_name.split(".")[-2])
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {"worst": worst, "kinds": sorted(kinds)})
    return {"max_rel_err": max(e["worst"] for e in everyone),
            "kinds_per_rank": [e["kinds"] for e in everyone]}
