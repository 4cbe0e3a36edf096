"""The sparse delta: each sender's changed engine-dtype elements against what it last
sent (exact); needs a recorded base at the previous version."""

from __future__ import annotations

from megatron_logra.weight_sync.contract import Delivery, Transport
from megatron_logra.weight_sync.transport import TrainerWeights

class SparseDeltaPush:
    transport = Transport.SPARSE_DELTA
    verifiable = True  # the server holds what a full push would send: checksums apply

    def __init__(self, weights: TrainerWeights):
        self.weights = weights
        weights.track_changes()

    def ready(self, version: int) -> bool:
        """Whether the senders' recorded base is ``version - 1`` (rank 0 decides)."""
        w = self.weights
        return w.shadow is not None and w.shadow_version == version - 1

    def deliver(self, engine, version: int) -> Delivery:
        return self.weights.direct.sparse(engine, version)

    def applied(self, version: int) -> None:
        self.weights.shadow_version = version
