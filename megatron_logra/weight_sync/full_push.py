"""The full push: every parameter, each trainer rank its own pieces, then the version;
the server's weights checked against the trainer's (vLLM's checksums), what differs
resent."""

from __future__ import annotations

from megatron_logra.runtime.collectives import from_rank0
from megatron_logra.weight_sync.contract import Delivery, EngineError, Transport
from megatron_logra.weight_sync.transport import TrainerWeights

class FullPush:
    transport = Transport.FULL

    def __init__(self, weights: TrainerWeights):
        self.weights = weights

    def push(self, engine, version: int, names: list[str] | None = None) -> Delivery:
        """Every parameter (or ``names``, canonical) in full, then the version: every rank
        sends each server worker its pieces (the server must be running)."""
        w = self.weights
        done = w.direct.full(engine, version, names, record=w.shadow is not None)
        if w.shadow is not None and names is None and not (done.failed or done.refused):
            w.shadow_version = version
        return Delivery(failed=done.failed or done.refused, sent=done.sent)

    def mismatches(self, engine) -> tuple[list[str] | None, str]:
        """(HF names whose server copy differs from the trainer's, "") on every rank, or
        (None, the server's error): vLLM's own checksums against the ones the trainer's
        weights make (``weight_sync.checksums``)."""
        return self._checksum_mismatches(engine)

    def _checksum_mismatches(self, engine) -> tuple[list[str] | None, str]:
        """The HF tensors behind every vLLM parameter whose checksum on the server differs
        from what the trainer's weights make (``weight_sync.checksums``); the full weights
        stream to rank 0 a bucket at a time (a TP gather per parameter), so this costs
        a full push's gathers as well as vLLM's hashing."""
        from megatron_logra.weight_sync.checksums import ChecksumBuilder

        w = self.weights
        builder = ChecksumBuilder(w.arch, w.direct.engine_tp) if w.rank == 0 else None
        for bucket in w.buckets():  # rank 0; the others send inside
            for name, tensor in bucket:
                builder.add(name, tensor)

        def compare() -> tuple[list[str] | None, str]:  # rank 0, which holds the engine
            try:
                return builder.mismatched(engine.checksums()), ""
            except EngineError as exc:
                return None, str(exc)
        return from_rank0(compare)

    def resend_mismatches(self, engine, version: int) -> tuple[Delivery, int]:
        """Compare the server's weights with the trainer's (checksums) and resend the
        mismatching tensors in full: (result, number of mismatching tensors)."""
        w = self.weights
        bad, failed = self.mismatches(engine)
        if bad is None:
            return Delivery(failed=failed or "checksum check failed"), 0
        if not bad:
            return Delivery(), 0
        if w.rank == 0:
            print(f"weight sync: checksum mismatch in {len(bad)} tensors "
                  f"({bad[:3]}...); resending them in full", flush=True)
        names = sorted({w.hf_source[h] for h in bad})
        return self.push(engine, version, names=names), len(bad)
