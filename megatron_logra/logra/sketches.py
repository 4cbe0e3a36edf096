"""The sketched weights of this rank: slots, projections, and their reductions.

``SketchSet`` finds the sketched linears of this rank's model chunks, gives each
weight a canonical, layout-independent name (global layer index) and a
``SketchSlot``, takes the weight out of autograd (``requires_grad=False``: DDP then
allocates no grad buffer for it), and owns two flat fp32 buffers holding every
sketch S (out_local x r): one for column-parallel weights (S rows are local) and
one for row-parallel weights (S is a partial sum over TP ranks).

Once per update, after megatron's own gradient finalisation:
``reduce(num_tokens)`` sums the row-parallel buffer over TP, both buffers over
DP (an out x r payload per weight instead of out x in), and divides by the
global loss-token count, as megatron scales dense gradients (S = G A^T of the
per-token mean loss; the count is kept for the optimizer's own normalisation).

Each slot also knows which HF module (q, k, v of the fused qkv; gate, up of fc1;
one for the other weights; the vocab padding apart) each of its local rows
belongs to (``module_rows``), for RowAdam's per-module statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.logra.config import LograConfig
from megatron_logra.logra.projection import parameter_seed, projection_block
from megatron_logra.logra.sketched_linear import (
    SKETCHED_TYPES,
    SketchedColumnParallelLinear,
    SketchedVocabParallelEmbedding,
    SketchSlot,
)
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import row_segments
from megatron_logra.runtime.host_read import host_value

EMBEDDING = "embedding.word_embeddings.weight"


def _canonical_rows(module, name: str, out_local: int, tp_rank: int, tp_size: int,
                    gated: bool) -> torch.Tensor:
    """Global (TP=1) row index of each local row. fc1 of a gated MLP holds [gate_t; up_t]."""
    local = torch.arange(out_local, dtype=torch.int64)
    if module.logra_parallel == "row":
        return local
    if gated and name.endswith("mlp.linear_fc1.weight"):
        half = out_local // 2
        return torch.where(local < half, tp_rank * half + local,
                           tp_size * half + tp_rank * half + (local - half))
    return tp_rank * out_local + local


def hf_modules_of_rows(arch: ModelArch, name: str) -> tuple[torch.Tensor, tuple[str, ...]]:
    """(module index [canonical rows] int64, module names) of megatron weight ``name``: the
    HF tensor each canonical (TP=1) row comes from (qkv interleaved per query group, fc1
    [gate; up]); zero-padded vocabulary rows form a module of their own ("padding")."""
    names: list[str] = []
    ids = []
    for seg in row_segments(arch, name):
        key = seg.hf_name or "padding"
        if key not in names:
            names.append(key)
        ids.append(torch.full((seg.rows,), names.index(key), dtype=torch.int64))
    return torch.cat(ids), tuple(names)


def anchor_frozen_embeddings(chunks: list[torch.nn.Module]) -> None:
    """With every parameter frozen, the first stage's embedding output would not require
    grad and no backward (hence no sketch) would run: make it a differentiable leaf while
    grad is enabled, as the reference's embedding hook does. A no-op when it already
    requires grad (a sketched or trained embedding)."""
    def hook(module, inputs, output):
        if torch.is_grad_enabled() and not output.requires_grad:
            return output.detach().requires_grad_(True)
        return None

    for chunk in chunks:
        if chunk.pre_process:
            chunk.embedding.register_forward_hook(hook)


def _embedding_and_output(chunk) -> list[tuple[str, torch.nn.Module, bool, bool]]:
    """(canonical name, module, gated, duplicate) of a chunk's sketched embedding / output
    layer. A tied output layer on a later stage than the embedding holds its own copy of the
    embedding matrix: same name (same projections), marked duplicate (counted once in norms)."""
    out = []
    if chunk.pre_process and isinstance(chunk.embedding.word_embeddings,
                                        SketchedVocabParallelEmbedding):
        out.append((EMBEDDING, chunk.embedding.word_embeddings, False, False))
    if chunk.post_process and isinstance(chunk.output_layer, SketchedColumnParallelLinear):
        if not chunk.share_embeddings_and_output_weights:
            out.append(("output_layer.weight", chunk.output_layer, False, False))
        elif not chunk.pre_process:
            out.append((EMBEDDING, chunk.output_layer, False, True))
    return out


class SketchSet:
    """Every sketched weight of this rank, in a fixed order (by canonical name)."""

    def __init__(self, chunks: list[torch.nn.Module], cfg: LograConfig, arch: ModelArch, *,
                 seed: int):
        """``cfg``: the run's LoGRA settings (rank, projection, refresh interval);
        ``seed``: the run's, the base of every projection's seed."""
        self.cfg, self.seed = cfg, seed
        self.num_tokens = 1.0  # global loss tokens of the last reduce()
        self.gated = any(bool(c.config.gated_linear_unit) for c in chunks)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        found = []
        for chunk in chunks:
            gated = bool(chunk.config.gated_linear_unit)
            for layer in chunk.decoder.layers:
                for name, module in layer.named_modules():
                    if isinstance(module, SKETCHED_TYPES):
                        canonical = f"decoder.layers.{layer.layer_number - 1}.{name}.weight"
                        found.append((canonical, module, gated, False))
            found += _embedding_and_output(chunk)
        found.sort(key=lambda item: item[0])
        tied_over_pp = (parallel_state.get_pipeline_model_parallel_world_size() > 1
                        and any(c.share_embeddings_and_output_weights for c in chunks))
        self.params: list[torch.nn.Parameter] = []
        self.slots: list[SketchSlot] = []
        sizes = {"column": 0, "row": 0, "tied": 0}
        for canonical, module, gated, duplicate in found:
            weight = module.weight
            out_local, in_local = weight.shape
            col_offset = tp_rank * in_local if module.logra_parallel == "row" else 0
            rows = _canonical_rows(module, canonical, out_local, tp_rank, tp_size, gated)
            module_ids, module_names = hf_modules_of_rows(arch, canonical)
            weight.requires_grad_(False)
            slot = SketchSlot(name=canonical, parallel=module.logra_parallel,
                              global_rows=rows, col_offset=col_offset,
                              module_rows=module_ids[rows].to(weight.device),
                              module_names=module_names,
                              sketch=torch.empty(0),  # bound to a buffer view below
                              duplicate=duplicate,
                              gated_halves=gated and canonical.endswith("mlp.linear_fc1.weight"))
            # a tied embedding split over first and last stage is summed over both
            slot.buffer = "tied" if canonical == EMBEDDING and tied_over_pp else slot.parallel
            slot.offset = sizes[slot.buffer]
            sizes[slot.buffer] += out_local * cfg.rank
            weight.logra_slot = slot
            self.params.append(weight)
            self.slots.append(slot)
        device = self.params[0].device if self.params else torch.device("cpu")
        self.buffers = {kind: torch.zeros(n, dtype=torch.float32, device=device)
                        for kind, n in sizes.items()}
        for weight, slot in zip(self.params, self.slots):
            n = weight.shape[0] * cfg.rank
            slot.sketch = self.buffers[slot.buffer][slot.offset:slot.offset + n].view(
                weight.shape[0], cfg.rank)

    def __len__(self) -> int:
        return len(self.slots)

    def projection_update(self, update: int) -> int:
        """The update index whose seed the projections of update ``update`` use."""
        return (update // self.cfg.refresh_interval) * self.cfg.refresh_interval

    def seed_of(self, slot: SketchSlot, update: int) -> int:
        return parameter_seed(self.seed, self.projection_update(update), slot.name)

    def _projection_dtype(self, weight: torch.Tensor) -> torch.dtype:
        """The weight's dtype when it holds A exactly (Rademacher +-2^-k: r a power of 4),
        else fp32. Halves A's memory in bf16 and spares a cast per forward."""
        r = self.cfg.rank
        exact = self.cfg.projection == "rademacher" and r & (r - 1) == 0 and \
            (r.bit_length() - 1) % 2 == 0
        return weight.dtype if exact else torch.float32

    def refresh(self, update: int) -> None:
        """Set every slot's projection A (its columns) for update ``update`` (0-based)."""
        for weight, slot in zip(self.params, self.slots):
            cols = (slot.col_offset, slot.col_offset + weight.shape[1])
            slot.projection = projection_block(self.seed_of(slot, update), self.cfg.rank, cols,
                                               kind=self.cfg.projection, device=weight.device,
                                               dtype=self._projection_dtype(weight))

    def zero(self) -> None:
        for buffer in self.buffers.values():
            buffer.zero_()
        self.num_tokens = 1.0

    def reduce(self, num_tokens: torch.Tensor | None) -> None:
        """TP-sum row-parallel sketches, DP-sum all, sum a tied embedding's two copies over the
        embedding group (first + last stage), divide by the global token count
        (``num_tokens`` as megatron's finalize_model_grads leaves it: already global)."""
        if parallel_state.get_tensor_model_parallel_world_size() > 1 and self.buffers["row"].numel():
            dist.all_reduce(self.buffers["row"], group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_data_parallel_world_size() > 1:
            group = parallel_state.get_data_parallel_group()
            for buffer in self.buffers.values():
                if buffer.numel():
                    dist.all_reduce(buffer, group=group)
        if self.buffers["tied"].numel():
            dist.all_reduce(self.buffers["tied"], group=parallel_state.get_embedding_group())
        if num_tokens is not None:
            count = float(host_value(num_tokens, assume=1.0))
            if count > 0:
                self.divide(count)
                self.num_tokens = count

    def divide(self, divisor: float) -> None:
        """In place: every sketch divided by ``divisor``."""
        for buffer in self.buffers.values():
            buffer.div_(divisor)

    def sketch_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())
