"""The weight channel into vLLM's server: every trainer rank sends each server worker
only its own pieces, over a torch.distributed group between them (gloo on CPU, NCCL on
GPUs; the ``mlogra`` weight-transfer backend, ``vllm_backend``, is the workers' side).

- the group (``p2p``) holds every trainer rank and every server TP rank; a restarted
  server joins a fresh one (the trainer side notices at the next push);
- a full push: each rank's own TP shard of each parameter it sends (data-parallel rank
  0; a parameter with no TP split: TP rank 0; a tied embedding: the first stage) is cut
  into ``transfer_plan.Block``s, one message per worker per bucket of parameters: no TP
  gather, no relay, no rank holding more than its shard;
- a sparse delta: each rank compares its shard, in the engine dtype, with what it last
  sent (a shard-sized shadow, kept in host memory, so it is not in the GPU memory plan:
  each sparse push copies each shard's shadow to the device and back, one parameter at a
  time) and sends each worker the changed elements it holds, as flat indices into the
  worker's own parameter (a block that changed nearly everywhere goes dense);
- a sketch delta: each rank's own rows of D (``sketch_rows``), each worker receiving the
  rows it holds; the unsketched tensors that train go as blocks.

Rank 0 opens the update on the server first (``/start_weight_update``: a delta on a base
version the server does not serve is refused before anything is sent, and every rank
hears so), then the server's workers receive round by round while every trainer rank
sends; vLLM's ``/finish_weight_update`` commits the version.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.weight_sync.messages import Outbox, add_updates
from megatron_logra.weight_sync.p2p import (GroupAddress, abort_group, join_group,
                                            message_device, open_store, send_message, wait_all)
from megatron_logra.weight_sync.contract import Delivery, EngineError, PushRefused, Transport
from megatron_logra.weight_sync.sketch_rows import owned_updates
from megatron_logra.weight_sync.transfer_plan import Block, shard_blocks, shard_extent
from megatron_logra.model.hf_mapping import hf_param_shapes, megatron_param_names, row_segments
from megatron_logra.model.provider import canonical_param_names, global_shape, served_parameters
from megatron_logra.model.sharding import tp_split
from megatron_logra.runtime.collectives import every_rank, from_rank0
from megatron_logra.runtime.device import current_device, free_port


BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
"""The integer dtype of each float dtype's width: comparing values bit for bit (sparse
deltas: the elements whose bits changed since the last push)."""


@dataclass(frozen=True)
class _Shard:
    """A parameter this rank sends: its served value (local shard) and its blocks."""

    value: Callable[[], torch.Tensor]
    blocks: tuple[Block, ...]


@dataclass
class _Link:
    """One engine's group: the group, the engine start it was built with (rank 0), and its
    bound on each send."""

    group: object = None
    joined: tuple | None = None  # (engine client, its start) the group was built with
    engine_tp: int | None = None  # the engine's TP size (None: the channel's default)
    wait_s: float = GroupAddress.timeout_s


class DirectChannel:
    """The trainer's side of the direct channel (collective: every rank calls every method)."""

    def __init__(self, model_chunks: list, arch, plan, dtype: torch.dtype, engine_tp: int,
                 bucket_bytes: int, backend: str | None = None, merged: bool = True):
        """``plan``: ``gathered_weights.PushPlan`` (who sends each parameter's stage);
        ``engine_tp``: the engine's TP size (its worker count); ``backend``: the group's,
        None for the device's (NCCL on CUDA, gloo on CPU). gloo on CUDA stages every
        message through host memory: what an engine on the trainer's own GPUs needs, as
        NCCL refuses two members of one communicator on one GPU (a NCCL group whose
        members turn out to share a GPU, as a server at --rollout-engine-url on the
        trainer's GPUs would, is gloo too: ``p2p.join_group``). ``merged``: LoRA's
        adapters merged into the weights sent (an engine serving the adapter on its own
        takes the base weights: False)."""
        self.arch, self.dtype, self.engine_tp = arch, dtype, engine_tp
        self.bucket_bytes = bucket_bytes
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = current_device()
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        self._shard_args = (model_chunks, plan, merged)
        self.default_tp = engine_tp
        self._shards_by_tp = {engine_tp: self._my_shards(model_chunks, plan, merged)}
        self.shards = self._shards_by_tp[engine_tp]  # for the engine in ``use``
        # sparse deltas: what each shard last sent, in host memory (``keep_on_host``)
        self.shadow: dict[str, torch.Tensor] = {}
        self.store = None
        self.address: GroupAddress | None = None  # rank 0: its store's (prefix set per join)
        self.joins = 0  # rank 0: groups built on its store (each its own key prefix)
        self.links: dict[int, _Link] = {}  # each replica's group (``use``)
        self.replica = 0
        self.link = self.links.setdefault(0, _Link())
        self.sent_here = 0  # bytes this rank has sent (benchmarks)
        self.hf_shapes = hf_param_shapes(arch)

    def _my_shards(self, model_chunks, plan, merged: bool,
                   engine_tp: int | None = None) -> dict[str, _Shard]:
        """The parameters this rank sends, with the blocks of its shard for an engine at
        TP ``engine_tp`` (None: ``self.engine_tp``) (LoRA: the merged weights, the value
        the forward uses, or with ``merged=False`` the base weights)."""
        canonical = canonical_param_names(model_chunks[0], arch := self.arch)
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        tp_group = dist.get_process_group_ranks(parallel_state.get_tensor_model_parallel_group())
        dp0 = parallel_state.get_data_parallel_rank() == 0
        base = set(megatron_param_names(arch))  # not LoRA's adapters: merged into these
        out = {}
        for local_name, (param, value) in served_parameters(model_chunks[0]).items():
            name = canonical[local_name]
            if name not in base or not dp0 or plan.sender[name] not in tp_group:
                continue  # not this stage's copy, or another DP replica sends it
            split = tp_split(param)
            if split is None and tp_rank != 0:
                continue  # replicated over TP: TP rank 0 sends it
            extent = shard_extent(global_shape(param), split, tp_rank, tp_size)
            blocks = tuple(shard_blocks(arch, name, extent, engine_tp or self.engine_tp))
            out[name] = _Shard(value if merged else param.detach, blocks)
        return out

    # --- the group ---------------------------------------------------------------------------
    def use(self, replica: int, engine_tp: int | None = None) -> None:
        """Send the next pushes to engine ``replica`` (every rank): each engine has its own
        group, and its own TP size (``engine_tp``, remembered for the replica: servers at
        several URLs may differ; None: as before, at first the channel's)."""
        self.replica = replica
        self.link = self.links.setdefault(replica, _Link())
        if engine_tp is not None:
            self.link.engine_tp = engine_tp
        tp = self.link.engine_tp or self.default_tp
        if tp not in self._shards_by_tp:  # each worker's blocks of this rank's shards
            self._shards_by_tp[tp] = self._my_shards(*self._shard_args, engine_tp=tp)
        self.engine_tp, self.shards = tp, self._shards_by_tp[tp]

    @property
    def group(self):
        return self.link.group

    def join(self, engine) -> str:
        """Make sure the engine's workers and every trainer rank share a group (a fresh one
        for each engine start); returns a failure ("" when joined)."""

        def new_address() -> GroupAddress | None:  # rank 0: None when already joined
            start = getattr(engine, "start_id", None)
            if (engine, start) == self.link.joined:
                return None
            if self.store is None:
                host = os.environ.get("MASTER_ADDR", "127.0.0.1")
                self.address = GroupAddress(host, free_port(), "", self.world,
                                            self.engine_tp, self.backend)
                self.store = open_store(self.address, master=True)
            # a prefix of its own for every group: a server reconnected after a failure
            # (a fresh client, counting its starts from 1 again) must not meet the keys a
            # dead group left in the store
            self.joins += 1
            return replace(self.address, workers=self.engine_tp,
                           prefix=f"mlogra-direct/{self.replica}-{start}-{self.joins}/")
        address = from_rank0(new_address)
        if address is None:
            return ""
        self.link.group = None  # the old group's workers are gone
        self.link.wait_s = address.timeout_s  # each send's bound (``p2p.wait_all``)
        failed = ""
        if self.rank == 0:
            try:
                engine.begin_join(address)
            except EngineError as exc:
                failed = str(exc)
        if not _agree(failed):
            try:
                self.link.group = join_group(
                    address, self.rank, self.store if self.rank == 0 else None,
                    self.device if self.backend == "nccl" else None)
            except RuntimeError as exc:
                failed = f"joining the direct weight group: {exc}"
            if self.rank == 0:
                try:
                    engine.end_call()
                except EngineError as exc:
                    failed = failed or str(exc)
        failed = _agree(failed)
        if not failed and self.rank == 0:
            self.link.joined = (engine, getattr(engine, "start_id", None))
        if failed:
            self.link.group = None
        return failed

    def close(self) -> None:
        self.links = {}
        self.use(self.replica)
        self.store = None

    # --- pushes ------------------------------------------------------------------------------
    def full(self, engine, version: int, names: list[str] | None = None,
             record: bool = False) -> Delivery:
        """Every parameter (or ``names``, canonical), then the commit. ``record``: keep
        each shard as sent (the base of sparse deltas)."""
        wanted = self._buckets(names)

        def rounds():
            for bucket in wanted:
                yield self._blocks_round(bucket, record)
        return self._deliver(engine, Transport.FULL, version, len(wanted), rounds())

    def sparse(self, engine, version: int) -> Delivery:
        """The changed engine-dtype elements of every shard against its shadow."""
        return self._deliver(engine, Transport.SPARSE_DELTA, version, 1,
                             iter([self._sparse_round()]))

    def sketch(self, engine, version: int, optimizer, unsketched: list[str]) -> Delivery:
        """This rank's rows of D per worker, then the unsketched tensors that train."""
        buckets = self._buckets(unsketched) if unsketched else []

        def rounds():
            yield self._sketch_round(optimizer)
            for bucket in buckets:
                yield self._blocks_round(bucket, record=False)
        return self._deliver(engine, Transport.SKETCH_DELTA, version, 1 + len(buckets),
                             rounds())

    # --- one push: ask, then every rank sends while the workers receive --------------------
    def _deliver(self, engine, kind: str, version: int, count: int,
                 rounds: Iterator[list[Outbox]]) -> Delivery:
        failed = self.join(engine)
        if failed:
            return Delivery(failed=failed)

        def ask() -> Delivery:  # rank 0's answer from the engine
            try:
                engine.expect(kind, base_version=None if kind == Transport.FULL else version - 1,
                              version=version)
                engine.begin_receive(count)
            except PushRefused as exc:
                return Delivery(refused=str(exc))
            except EngineError as exc:
                return Delivery(failed=str(exc))
            return Delivery()
        asked = from_rank0(ask)
        if asked.refused or asked.failed:
            return asked
        failed, before = "", self.sent_here
        for outboxes in rounds:
            try:
                self._send(outboxes)
            except RuntimeError as exc:  # the engine died: its sockets closed
                failed = f"direct weight send: {exc}"
                break
        if self.rank == 0:
            try:
                engine.end_call()
            except EngineError as exc:
                failed = str(exc)
        failed = _agree(failed)
        if not failed and self.rank == 0:
            try:
                engine.commit(version)
            except EngineError as exc:
                failed = str(exc)
        failed = _agree(failed)
        if failed:
            abort_group(self.link.group)
            self.link.group, self.link.joined = None, None
        sent = torch.tensor([self.sent_here - before], dtype=torch.int64)
        dist.all_reduce(sent)  # what every rank sent (the server reports no byte count)
        return Delivery(failed=failed, sent=int(sent))

    def _send(self, outboxes: list[Outbox]) -> None:
        works = []
        device = message_device(self.group, self.device)  # the host where the group is gloo
        for worker, box in enumerate(outboxes):
            meta, tensors = box.pack(self.dtype, device)
            posted, size = send_message(self.group, self.world + worker, meta, tensors, device)
            works += posted
            self.sent_here += size
        wait_all(works, self.link.wait_s)

    # --- what goes in a round ---------------------------------------------------------------
    def _buckets(self, names: list[str] | None) -> list[list[str]]:
        """Canonical names (all, or ``names``) in canonical order, cut where the HF bytes in
        the engine dtype reach the bucket size: the same on every rank."""
        item = torch.empty((), dtype=self.dtype).element_size()
        wanted = None if names is None else set(names)
        out, size = [[]], 0
        for name in megatron_param_names(self.arch):
            if wanted is not None and name not in wanted:
                continue
            if size >= self.bucket_bytes:
                out.append([])
                size = 0
            out[-1].append(name)
            for seg in row_segments(self.arch, name):
                if seg.hf_name is not None:
                    shape = self.hf_shapes[seg.hf_name]
                    size += seg.rows * (shape[1] if len(shape) == 2 else 1) * item
        return [b for b in out if b]

    def _outboxes(self) -> list[Outbox]:
        return [Outbox() for _ in range(self.engine_tp)]

    @torch.no_grad()
    def _blocks_round(self, names: list[str], record: bool) -> list[Outbox]:
        boxes = self._outboxes()
        for name in names:
            shard = self.shards.get(name)
            if shard is None:
                continue
            value = shard.value().to(self.dtype)
            if record:
                keep_on_host(self.shadow, name, value)
            for block in shard.blocks:
                boxes[block.worker].add_block(block, value)
        return boxes

    @torch.no_grad()
    def _sparse_round(self) -> list[Outbox]:
        boxes = self._outboxes()
        item = torch.empty((), dtype=self.dtype).element_size()
        for name, shard in self.shards.items():
            new = shard.value().to(self.dtype)
            old = self.shadow.get(name)
            if old is None:
                raise RuntimeError(f"sparse delta: {name} was never pushed in full from "
                                   f"rank {self.rank}")
            bits = BITS[new.dtype]
            changed = new.view(bits) != old.to(new.device).view(bits)
            keep_on_host(self.shadow, name, new)
            for block in shard.blocks:
                inside = changed[block.src_row:block.src_row + block.rows]
                values = new[block.src_row:block.src_row + block.rows]
                if block.cols is not None:
                    inside = inside[:, block.src_col:block.src_col + block.cols]
                    values = values[:, block.src_col:block.src_col + block.cols]
                where = inside.reshape(-1).nonzero().squeeze(1)
                if where.numel() == 0:
                    continue
                if where.numel() * (4 + item) >= block.numel * item:  # denser than the block
                    boxes[block.worker].add_block(block, new)
                    continue
                boxes[block.worker].add_set(block.param, _worker_index(block, where),
                                            values.reshape(-1)[where])
        return boxes

    def _sketch_round(self, optimizer) -> list[Outbox]:
        boxes = self._outboxes()
        add_updates(boxes, self.arch, owned_updates(optimizer))
        return boxes


def keep_on_host(shadow: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    """``shadow[name]`` becomes a host copy of ``value`` (into the buffer it already has:
    one host copy per shard for the whole run, pinned when ``value`` is on a GPU so the
    copies back and forth run at the link's speed)."""
    held = shadow.get(name)
    if held is None or held.shape != value.shape or held.dtype != value.dtype:
        held = shadow[name] = torch.empty(value.shape, dtype=value.dtype, device="cpu",
                                          pin_memory=value.is_cuda)
    held.copy_(value)


def _worker_index(block: Block, where: torch.Tensor) -> torch.Tensor:
    """Flat indices, within ``block`` (row-major), -> flat indices into the worker's
    parameter, whose rows are ``block.dst_width`` wide (1-D: one element per row)."""
    if block.cols is None:
        return where + block.dst_row
    rows, cols = where // block.cols, where % block.cols
    return (rows + block.dst_row) * block.dst_width + cols + block.dst_col


def _agree(failed: str) -> str:
    """The first failure any rank saw ("" when none), on every rank."""
    return next((f for f in every_rank(failed) if f), "")
