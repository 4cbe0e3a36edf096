"""Stream megatron-core ``torch_dist`` checkpoints tensor by tensor, without building the model.

megatron-core's ``dist_checkpointing`` saves a model it holds in memory; a
converter must not (27B in fp32 would not fit host memory). This module writes
and reads the same on-disk format through torch.distributed.checkpoint's public
planner API, one stored chunk at a time:

* ``checkpoint_layout(arch)`` lists what megatron-core itself would store for the
  full (TP=1, PP=1) model: it builds the model on the meta device and reads its
  ``sharded_state_dict()``, so keys, stacked-layer global shapes and the fc1
  [gate; up] chunking come from megatron-core, not from a copy of its rules.
* ``write_checkpoint(dir, layout, produce)`` saves with a ``SavePlanner`` whose
  ``resolve_data`` asks ``produce(chunk)`` for each chunk only when the writer
  reaches it (memory: one chunk, i.e. one layer's tensor).
* ``CheckpointReader(dir).read_param(arch, name)`` assembles one canonical
  parameter of one layer from whatever chunks a checkpoint holds (a training
  checkpoint saved at TP2/PP2 as well as a converted one).

The result loads with ``dist_checkpointing.load`` at any TP/PP/DP (tested).
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron_logra.model.arch import ModelArch

@dataclass(frozen=True)
class Chunk:
    """One stored piece: rows ``rows`` of canonical parameter ``param`` (a full layer tensor,
    or half of fc1), at ``offset`` of the stored tensor ``key`` (global shape ``global_shape``,
    the layer index prepended for stacked layer tensors)."""

    key: str
    global_shape: tuple[int, ...]
    offset: tuple[int, ...]
    sizes: tuple[int, ...]
    param: str
    rows: tuple[int, int]


@dataclass(frozen=True)
class ExtraState:
    """A per-layer ``_extra_state`` object megatron-core stores (its data, pickled in a list)."""

    unique_key: str
    data: object


@dataclass(frozen=True)
class CheckpointLayout:
    arch: ModelArch
    chunks: list[Chunk]
    extra_states: list[ExtraState]
    shapes: dict[str, tuple[int, ...]]  # canonical parameter -> full (TP=1) shape

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def params(self) -> list[str]:
        """Canonical parameter names, in storage order."""
        return list(dict.fromkeys(c.param for c in self.chunks))


def checkpoint_layout(arch: ModelArch, build=None) -> CheckpointLayout:
    """What megatron-core's ``sharded_state_dict()`` stores for ``arch`` at TP=1, PP=1;
    ``build`` (a ``ModelBuildConfig``): the model as trained, e.g. with LoRA's adapters.

    Needs megatron's parallel state initialised at TP=1, PP=1 (world size 1 is enough).
    """
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject,
        ShardedTensor,
        ShardedTensorFactory,
    )

    from megatron_logra.model.provider import ModelBuildConfig, build_meta_model

    if (parallel_state.get_tensor_model_parallel_world_size() != 1
            or parallel_state.get_pipeline_model_parallel_world_size() != 1):
        raise RuntimeError("checkpoint_layout needs the parallel state at TP=1, PP=1")
    model = build_meta_model(arch, build or ModelBuildConfig())
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    chunks, extras = [], []
    for local_name, item in model.sharded_state_dict().items():
        if isinstance(item, ShardedObject):
            extras.append(ExtraState(item.unique_key, item.data))
            continue
        pieces = item.build() if isinstance(item, ShardedTensorFactory) else [item]
        if isinstance(pieces, dict):
            pieces = list(pieces.values())
        param = local_name  # at TP=1, PP=1 the local names are the canonical ones
        row = 0
        for piece in pieces:
            if not isinstance(piece, ShardedTensor) or piece.flattened_range is not None:
                raise RuntimeError(f"{local_name}: unexpected sharded item {type(piece).__name__}")
            prepend = piece.prepend_axis_num
            sizes = (1,) * prepend + tuple(piece.data.shape)
            rows = piece.data.shape[0] if piece.data.dim() else 1
            chunks.append(Chunk(piece.key, tuple(piece.global_shape), tuple(piece.global_offset),
                                sizes, param, (row, row + rows)))
            row += rows
    layout = CheckpointLayout(arch, chunks, extras, shapes)
    for name in layout.params():  # self-check: the chunks of each parameter cover it
        shape = layout.shape(name)
        rows = sum(c.rows[1] - c.rows[0] for c in chunks if c.param == name)
        if rows != (shape[0] if shape else 1):
            raise RuntimeError(f"megatron stores {rows} rows of {name}, expected shape {shape}")
    return layout


# --------------------------------------------------------------------------- writing

Produce = Callable[[Chunk], torch.Tensor]
"""chunk -> its tensor, shape ``chunk.sizes`` (the writer casts to the layout's dtype)."""


class _StreamingSavePlanner(SavePlanner):
    """A planner whose data is produced only when the storage writer asks for it."""

    def __init__(self, layout: CheckpointLayout, produce: Produce, dtype: torch.dtype,
                 on_chunk: Callable[[int, int, Chunk], None] | None):
        self.layout, self.produce, self.dtype, self.on_chunk = layout, produce, dtype, on_chunk
        self._by_index = {(c.key, c.offset): c for c in layout.chunks}
        self._extras = {e.unique_key: e for e in layout.extra_states}
        self._done = 0

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(c.key, torch.Size(c.offset)),
                           type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(
                               chunk=ChunkStorageMetadata(torch.Size(c.offset), torch.Size(c.sizes)),
                               properties=TensorProperties(dtype=self.dtype),
                               size=torch.Size(c.global_shape)))
                 for c in self.layout.chunks]
        items += [WriteItem(index=MetadataIndex(e.unique_key), type=WriteItemType.BYTE_IO)
                  for e in self.layout.extra_states]
        return SavePlan(items)

    def create_global_plan(self, all_plans):
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            buffer = io.BytesIO()
            torch.save([self._extras[write_item.index.fqn].data], buffer)
            return buffer
        chunk = self._by_index[(write_item.index.fqn, tuple(write_item.index.offset))]
        tensor = self.produce(chunk).reshape(chunk.sizes).to("cpu", self.dtype).contiguous()
        self._done += 1
        if self.on_chunk is not None:
            self.on_chunk(self._done, len(self.layout.chunks), chunk)
        return tensor


def write_checkpoint(out_dir: str | os.PathLike, layout: CheckpointLayout, produce: Produce,
                     dtype: torch.dtype,
                     on_chunk: Callable[[int, int, Chunk], None] | None = None) -> None:
    """Write a megatron-core torch_dist checkpoint (metadata.json, common.pt, .distcp files)."""
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    planner = _StreamingSavePlanner(layout, produce, dtype, on_chunk)
    writer = FileSystemWriter(str(out), single_file_per_rank=True, sync_files=True,
                              thread_count=1, per_thread_copy_ahead=0)
    dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
    torch.save({}, out / "common.pt")
    save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), str(out))


# --------------------------------------------------------------------------- reading


class _RegionLoadPlanner(LoadPlanner):
    """Copies stored chunks into preallocated destination regions ``{(key, offset): tensor}``."""

    def __init__(self, targets: dict[tuple[str, tuple[int, ...]], torch.Tensor]):
        self.targets = targets

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise NotImplementedError

    def resolve_tensor(self, read_item):
        dest = self.targets[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item, tensor) -> None:
        pass


class CheckpointReader:
    """Reads regions of the tensors of a megatron-core torch_dist checkpoint folder."""

    def __init__(self, ckpt_dir: str | os.PathLike):
        self.path = Path(ckpt_dir)
        if not (self.path / ".metadata").is_file():
            raise FileNotFoundError(f"{self.path} is not a torch_dist checkpoint (no .metadata)")
        self.reader = FileSystemReader(str(self.path))
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)

    def keys(self) -> list[str]:
        return list(self.metadata.state_dict_metadata)

    def read_region(self, key: str, offset: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """Stored tensor ``key`` restricted to ``[offset, offset + sizes)`` (its stored dtype)."""
        md = self.metadata.state_dict_metadata.get(key)
        if md is None or not hasattr(md, "chunks"):
            raise KeyError(f"{self.path} holds no tensor {key!r}; it was saved for another model "
                           f"or is not a model checkpoint")
        dest = torch.empty(sizes, dtype=md.properties.dtype)
        chunk = ChunkStorageMetadata(torch.Size(offset), torch.Size(sizes))
        items = create_read_items_for_chunk_list(key, md, [chunk])
        covered = sum(torch.Size(i.lengths).numel() for i in items)
        if covered != dest.numel():
            raise ValueError(f"{self.path}: {key} region {offset}+{sizes} is covered by "
                             f"{covered} of {dest.numel()} elements: the checkpoint is incomplete")
        plan = self.reader.prepare_local_plan(LoadPlan(items))
        self.reader.read_data(plan, _RegionLoadPlanner({(key, tuple(offset)): dest})).wait()
        return dest

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.metadata.state_dict_metadata[key].size)

    def read_param(self, layout: CheckpointLayout, name: str) -> torch.Tensor:
        """Canonical parameter ``name`` (full TP=1 tensor), from its chunks in ``layout``."""
        pieces = [c for c in layout.chunks if c.param == name]
        if not pieces:
            raise KeyError(f"no stored chunk for parameter {name!r}")
        parts = []
        for c in pieces:
            if self.global_shape(c.key) != c.global_shape:
                raise ValueError(f"{self.path}: {c.key} has global shape "
                                 f"{self.global_shape(c.key)}, the model expects {c.global_shape}; "
                                 f"the checkpoint belongs to another model")
            parts.append(self.read_region(c.key, c.offset, c.sizes))
        shape = layout.shape(name)
        return torch.cat([p.reshape(c.rows[1] - c.rows[0], *shape[1:]) if shape else p.reshape(())
                          for p, c in zip(parts, pieces)]) if len(parts) > 1 else parts[0].reshape(shape)
