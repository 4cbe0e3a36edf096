"""vLLM's weight checksums, predicted from HF tensors: what a vLLM server holding exactly
the trainer's weights reports on ``/weight_checker {"action": "checksum"}``. Pure torch.

vLLM hashes every parameter of every worker (``compute_tensor_digests``: SHA-256 of the
raw bytes, in the stored dtype), keyed ``dp0:pp0:pcp0:tp{rank}:{vLLM name}``. Its
parameters are fused and sharded (``weight_sync.vllm_layout``: qkv_proj, gate_up_proj, a
column slice of o_proj and down_proj, a row slice of the vocab padded to 64); the
padding rows of a vocab parameter are zeros (vLLM's loader zero-fills them; a push never
touches them). ``ChecksumBuilder`` assembles each worker's parameters from HF tensors as
they arrive (one parameter at a time in memory: a fused parameter is hashed and dropped
as soon as its last piece came) and names the HF tensors behind any mismatch.
"""

from __future__ import annotations

import hashlib
from collections import defaultdict

import torch

from megatron_logra.weight_sync.vllm_layout import VLLM_VOCAB_PADDING, vllm_placements
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import hf_param_shapes

_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def digest(t: torch.Tensor) -> str:
    """vLLM's digest of one tensor: SHA-256 of its bytes as stored."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8)
                          .numpy()).hexdigest()


def checksum_key(tp_rank: int, param: str) -> str:
    return f"dp0:pp0:pcp0:tp{tp_rank}:{param}"


class ChecksumBuilder:
    def __init__(self, arch: ModelArch, tp: int):
        """``tp``: the server's TP size (its worker count)."""
        self.arch, self.tp = arch, tp
        self.sources: dict[str, set[str]] = defaultdict(set)  # key -> HF names in it
        self.rows: dict[str, int] = defaultdict(int)
        self.width: dict[str, int | None] = {}
        for name in hf_param_shapes(arch):
            for rank in range(tp):
                for p in vllm_placements(arch, name, tp, rank):
                    key = checksum_key(rank, p.param)
                    self.sources[key].add(name)
                    self.rows[key] = max(self.rows[key], p.local_row + p.row1 - p.row0)
                    if name in _VOCAB:
                        padded = -(-arch.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
                        self.rows[key] = padded // tp
                    self.width[key] = None if p.col0 is None else p.col1 - p.col0
        self.pending: dict[str, torch.Tensor] = {}
        self.missing: dict[str, set[str]] = {k: set(v) for k, v in self.sources.items()}
        self.expected: dict[str, str] = {}

    def add(self, name: str, value: torch.Tensor) -> None:
        """HF tensor ``name``, full (the dtype the server stores)."""
        for rank in range(self.tp):
            for p in vllm_placements(self.arch, name, self.tp, rank):
                key = checksum_key(rank, p.param)
                if key not in self.pending:
                    width = self.width[key]
                    shape = (self.rows[key],) if width is None else (self.rows[key], width)
                    self.pending[key] = torch.zeros(shape, dtype=value.dtype)
                piece = value[p.row0:p.row1] if p.col0 is None else \
                    value[p.row0:p.row1, p.col0:p.col1]
                self.pending[key][p.local_row:p.local_row + p.row1 - p.row0] = piece
                self.missing[key].discard(name)
                if not self.missing[key]:
                    self.expected[key] = digest(self.pending.pop(key))

    def mismatched(self, served: dict[str, str]) -> list[str]:
        """The HF tensors behind every parameter whose served checksum differs from the
        expected one (or that the server lacks); the builder must have seen every tensor."""
        incomplete = sorted(k for k, names in self.missing.items() if names)
        if incomplete:
            raise ValueError(f"checksums: HF tensors missing for {incomplete[:3]}")
        # a server with LoRA enabled names its base weights ``...base_layer.weight``
        served = {k.replace(".base_layer", ""): v for k, v in served.items()}
        bad = {name for key, want in self.expected.items() if served.get(key) != want
               for name in self.sources[key]}
        return sorted(bad)
