"""The LoRA adapter push (``--weight-sync lora-adapter``): the adapter only, in PEFT's
format, served by vLLM's LoRA support on the unmerged base."""

from __future__ import annotations

from dataclasses import replace

from megatron_logra.weight_sync.contract import Delivery, EngineError, Transport
from megatron_logra.weight_sync.gathered_weights import gather_adapters
from megatron_logra.weight_sync.transport import TrainerWeights, deliver_through_rank0

class LoraAdapterPush:
    """LoRA: the server keeps the frozen base (pushed in full, unmerged) and serves the
    adapter through vLLM's LoRA support (runtime loading); each update sends the adapter
    only, in PEFT's format (q/k/v and gate/up sharing the fused layer's A)."""

    transport = Transport.LORA_ADAPTER
    verifiable = False  # the server's weights are the base: nothing more to check

    def __init__(self, weights: TrainerWeights, lora):
        """``lora``: the run's ``LoraConfig``; ``weights`` must push the base unmerged."""
        if weights.merged:
            raise ValueError("lora-adapter sync needs the base weights pushed unmerged")
        self.weights, self.lora = weights, lora

    def ready(self, version: int) -> bool:
        return True

    def deliver(self, engine, version: int) -> Delivery:
        return deliver_through_rank0(self, engine, version)

    def gather(self):
        """(PEFT's adapter tensors in the engine dtype, its adapter_config) on rank 0."""
        from megatron_logra.convert.lora_export import (adapted_weights, peft_config,
                                                        peft_tensors)

        w = self.weights
        adapters = gather_adapters(w.model, w.arch)
        if adapters is None:
            return None
        tensors = {k: v.to(w.dtype) for k, v in peft_tensors(
            w.arch, adapters.__getitem__, adapted_weights(list(adapters))).items()}
        return tensors, peft_config(self.lora, tensors, base_model="")

    def send(self, engine, payload, version: int) -> int:
        return engine.set_adapter(*payload, version)

    def applied(self, version: int) -> None:
        pass

    def follow_full(self, engine, version: int, result: Delivery) -> Delivery:
        """After a full push of the base: the adapter too (collective)."""
        payload = self.gather()
        if self.weights.rank != 0 or result.failed:
            return result
        try:
            return replace(result, sent=result.sent + self.send(engine, payload, version))
        except (EngineError, ValueError) as exc:
            return replace(result, failed=str(exc))
