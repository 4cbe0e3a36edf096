"""One vLLM worker's live parameters in HF coordinates: where each HF tensor's pieces sit
(``weight_sync.vllm_layout``), and receiving weight messages into them. Runs inside vLLM's
workers, called by the ``mlogra`` weight-transfer backend (``weight_sync.vllm_backend``).

Everything is applied in place, each worker into its own TP shard; every message is
checked against the worker's parameters before any of it is applied
(``direct_payload.check_message``).
"""

from __future__ import annotations

import torch

BASE_LAYER = ".base_layer"  # vLLM's LoRA wrapper around a layer (``BaseLayerWithLoRA``)


class WorkerShards:
    def __init__(self, model: torch.nn.Module, model_dir: str):
        """``model``: vLLM's model module on this worker; ``model_dir``: its HF folder
        (config.json gives the architecture)."""
        from vllm.distributed import (get_tensor_model_parallel_rank,
                                      get_tensor_model_parallel_world_size)

        from megatron_logra.model.arch import load_arch

        self.model = model
        self.arch = load_arch(model_dir)
        self.tp = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def params(self) -> dict[str, torch.Tensor]:
        """vLLM's parameter name -> its live tensor (read afresh). A server with LoRA
        enabled wraps each layer (``qkv_proj.base_layer.weight``): the base's names are
        the plain ones."""
        return {n.replace(BASE_LAYER, ""): p.data
                for n, p in self.model.named_parameters(remove_duplicate=False)}

    def locator(self):
        """``locate(hf_name)`` -> [(live tensor, ``vllm_layout.Placement``)]."""
        from megatron_logra.weight_sync.vllm_layout import vllm_placements

        params = self.params()

        def locate(name: str):
            return [(params[p.param], p)
                    for p in vllm_placements(self.arch, name, self.tp, self.tp_rank)]
        return locate

    @torch.inference_mode()
    def zero_vocab_padding(self) -> None:
        """Zero the rows of the vocab parameters past the vocabulary (vLLM pads it to 64;
        its loader zero-fills them, dummy weights do not, and the checksums include them)."""
        locate = self.locator()
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            for target, p in locate(name) if name in self._hf_names() else []:
                target[p.local_row + p.row1 - p.row0:].zero_()

    def _hf_names(self) -> set[str]:
        from megatron_logra.model.hf_mapping import hf_param_shapes

        return set(hf_param_shapes(self.arch))

    @torch.inference_mode()
    def receive(self, group, address, rounds: int, device: torch.device,
                after_first_round=None) -> int:
        """Receive ``rounds`` rounds of one message from every trainer rank of ``address``
        (``p2p.GroupAddress``) into ``device`` (``p2p.message_device``: the host for a gloo
        group, this GPU for NCCL) and apply each to the live parameters (checked first);
        returns the bytes received. ``after_first_round()``: called once the first round
        is applied (fault injection)."""
        from megatron_logra.weight_sync.messages import apply_message, check_message
        from megatron_logra.weight_sync.p2p import recv_message
        from megatron_logra.weight_sync.sketch_rows import apply_updates_into, check_updates
        from megatron_logra.model.hf_mapping import hf_param_shapes

        locate, params = self.locator(), self.params()
        shapes = hf_param_shapes(self.arch)

        def apply_updates(updates):
            check_updates(self.arch, updates, shapes)
            apply_updates_into(self.arch, updates, locate)

        received = 0
        for k in range(rounds):
            for sender in range(address.trainers):
                meta, tensors, size = recv_message(group, sender, device, address.timeout_s)
                check_message(meta, tensors, params)
                apply_message(meta, tensors, params, apply_updates)
                received += size
            if k == 0 and after_first_round is not None:
                after_first_round()
        return received
