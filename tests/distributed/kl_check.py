"""In a torchrun worker: the predicted-KL controller's numbers at one TP/PP/DP layout.

The model is built from the same seed at the layout (the same weights at every
layout, as the invariance tests check; bf16 optional), one plain update is taken, then a second
update on the same batch is taken through ``PredictedKLStep``: its K (the Fisher
quadratic form along the update, from the forward-mode pass through TP
communication and PP stages), alpha and the realized KL. Every DP rank trains on the
same batch and probes the same rows, so every layout must give the TP1 numbers.
"""

from __future__ import annotations


def kl_numbers(tp: int, pp: int, optimizer: str, distributed_optimizer: bool,
               world_size: int, bf16: bool = False) -> dict:
    from megatron_logra.config import KLControlConfig, LograConfig, OptimizerConfig
    from megatron_logra.kl.controller import PredictedKLStep
    from megatron_logra.logra.config import TARGETS
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig
    from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.testing.batches import random_microbatches
    from megatron_logra.training.build import build_training_objects
    from megatron_logra.training.step import forward_backward

    initialize(ParallelConfig(tp, pp), world_size, seed=11)
    arch = load_arch(EMBEDDED_DEFAULT)
    opt = OptimizerConfig(name=optimizer, lr=2e-3, clip_grad=0.0,
                          use_distributed_optimizer=distributed_optimizer,
                          logra=LograConfig(rank=16, targets=TARGETS, update_ratio=2e-3))
    objs = build_training_objects(arch, ModelBuildConfig(bf16=bf16), opt, seed=11,
                                  train_iters=4)
    batch = random_microbatches(arch.vocab_size, count=2, batch=2, seq=32, seed=4,
                                mask_fraction=0.25)
    kw = dict(seq_length=32, micro_batch_size=2, vocab_size=arch.vocab_size)
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)
    objs.optimizer.step()
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)
    kl = PredictedKLStep(KLControlConfig(control="predicted", budget=1e-3, budget_final=1e-3),
                         temperature=0.9, vocab_size=arch.vocab_size)
    ok, _, record = kl.step(objs, 0, batch[0], mismatch=None)
    return {"ok": bool(ok), **record}
