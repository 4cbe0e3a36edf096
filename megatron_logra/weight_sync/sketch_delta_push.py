"""The sketch delta (LoGRA): every rank's own rows of D with seeds, plus the unsketched
params that train, in full (none when they are frozen, the paper's setting)."""

from __future__ import annotations

from megatron_logra.logra.optimizer import LograOptimizer
from megatron_logra.model.hf_mapping import megatron_param_names
from megatron_logra.model.provider import canonical_param_names, unwrap
from megatron_logra.runtime.collectives import every_rank
from megatron_logra.weight_sync.contract import Delivery, Transport
from megatron_logra.weight_sync.transport import TrainerWeights


class SketchDeltaPush:
    transport = Transport.SKETCH_DELTA
    verifiable = True

    def __init__(self, weights: TrainerWeights, optimizer):
        """Collective. ``optimizer``: a ``LograOptimizer`` keeping each update's (D,
        coefficient, seed) (``keep_updates``: ``contract.NEEDS``, set by the CLI)."""
        if not (isinstance(optimizer, LograOptimizer) and optimizer.keep_updates):
            raise ValueError("sketch-delta weight sync needs a LograOptimizer that keeps its "
                             "updates (keep_updates): run with --optimizer logra "
                             "--weight-sync sketch-delta")
        self.weights, self.optimizer = weights, optimizer
        names = canonical_param_names(weights.model[0], weights.arch)
        trained = {names[n] for n, p in unwrap(weights.model[0]).named_parameters()
                   if p.requires_grad}
        everyone = every_rank(([s.name for s in optimizer.sketches.slots], trained))
        sketched = {n for ns, _ in everyone for n in ns}
        trained = set().union(*(t for _, t in everyone))
        # the unsketched params that train go in full with each delta; frozen ones
        # (--logra-untargeted frozen) never change and are not sent
        self.unsketched = [n for n in megatron_param_names(weights.arch)
                           if n not in sketched and n in trained]

    def ready(self, version: int) -> bool:
        return True

    def deliver(self, engine, version: int) -> Delivery:
        return self.weights.direct.sketch(engine, version, self.optimizer, self.unsketched)

    def applied(self, version: int) -> None:
        pass
