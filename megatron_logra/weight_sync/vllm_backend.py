"""The ``mlogra`` weight-transfer backend: the worker side of this project's pushes, as a
vLLM ``WeightTransferEngine`` (vLLM 0.32's RL interface; registered in every vLLM process
by ``weight_sync.vllm_plugin``).

A vLLM server started with ``--weight-transfer-config '{"backend": "mlogra"}'`` takes
pushes through its own RL routes (``VLLM_SERVER_DEV_MODE=1``):

- ``/init_weight_transfer_engine {"init_info": MlograInitInfo}``: each worker joins the
  trainer's standalone group (``weight_sync.p2p``: gloo on CPU, NCCL on CUDA) as group rank
  ``trainers + its TP rank``; every trainer rank is a member, so each sends each worker
  only the pieces of its own shard that worker holds (no gather on any rank);
- ``/start_weight_update``, then ``/update_weights {"update_info": {"rounds": N,
  "transport": T, "version": V}}``: the workers receive N rounds of one message from
  every trainer rank (``weight_sync.messages``: blocks of full values, changed elements
  of a sparse delta, rows of D of a sketch delta applied as W -= c D A(seed)) and apply
  each to their live parameters, checked first (``worker_shards``);
- ``/finish_weight_update {"weight_version": "V"}``: vLLM records the version.

vLLM's built-in backends (nccl, ipc, sparse_nccl, nccl_m2n) need CUDA and send whole
tensors from one trainer rank; this one runs on CPU (gloo), carries the sketch delta
(D and a seed: r/in of a full push) and reshards M trainer ranks into N workers.
Everything is applied in place, so a CPU server needs its linear weights kept live
(``cpu_live_weights``: ``MLOGRA_LIVE_WEIGHTS=1`` in its environment); a server without
it refuses the first push before applying any of it (``messages.check_message``: the
weight holds no live tensor), naming the fix.

vLLM internals used: the ``WeightTransferEngine`` base class and its typed
``init_info_cls`` / ``update_info_cls`` (vllm/distributed/weight_transfer/base.py), vLLM
0.32.x (``runtime.versions``).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

from vllm.distributed.weight_transfer.base import (WeightTransferEngine,
                                                   WeightTransferInitInfo,
                                                   WeightTransferUpdateInfo)

from megatron_logra.runtime import versions
from megatron_logra.weight_sync.contract import Transport
from megatron_logra.weight_sync.p2p import GroupAddress, join_group, message_device
from megatron_logra.weight_sync.worker_shards import WorkerShards


@dataclass
class MlograInitInfo(WeightTransferInitInfo):
    """``p2p.GroupAddress``'s fields, JSON-native (they cross HTTP)."""

    host: str
    port: int
    prefix: str
    trainers: int
    workers: int
    backend: str
    timeout_s: float = GroupAddress.timeout_s

    def __post_init__(self):
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"mlogra init_info: backend {self.backend!r} (gloo or nccl)")
        if self.trainers < 1 or self.workers < 1:
            raise ValueError(f"mlogra init_info: {self.trainers} trainers, {self.workers} "
                             f"workers (each at least 1)")


@dataclass
class MlograUpdateInfo(WeightTransferUpdateInfo):
    rounds: int
    """Rounds of one message from every trainer rank."""
    transport: str = Transport.FULL
    """``contract.Transport``: full | sparse-delta | sketch-delta (fault injection tells
    them apart)."""
    version: int = 0
    """The version this update becomes (fault injection: ``runtime.faults``)."""

    def __post_init__(self):
        if self.rounds < 1:
            raise ValueError(f"mlogra update_info: rounds {self.rounds} (at least 1)")


class MlograWeightTransferEngine(WeightTransferEngine[MlograInitInfo, MlograUpdateInfo]):
    init_info_cls = MlograInitInfo
    update_info_cls = MlograUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args, **kwargs):
        versions.require("vllm", "megatron_logra.weight_sync.vllm_backend")
        super().__init__(*args, **kwargs)
        self.shards = WorkerShards(self.model, self.model_config.model)
        self.address: GroupAddress | None = None
        self.group = None

    def init_transfer_engine(self, init_info: MlograInitInfo) -> None:
        """Join the trainer's group (blocks until every member joined; a NCCL group whose
        members share a GPU is gloo, ``p2p.join_group``); a fresh group replaces the one
        before (the trainer side restarted)."""
        if init_info.workers != self.shards.tp:
            raise ValueError(f"mlogra init_info: the trainer expects {init_info.workers} "
                             f"workers; this server has TP {self.shards.tp}")
        self.address = GroupAddress(**asdict(init_info))
        self.group = join_group(self.address, self.address.trainers + self.shards.tp_rank,
                                device=self.shards.device if init_info.backend == "nccl"
                                else None)
        self.shards.zero_vocab_padding()  # as vLLM's loader leaves it (dummy weights: not)

    def start_weight_update(self) -> None:
        if self.group is None:
            raise RuntimeError("mlogra: no weight group; call /init_weight_transfer_engine")

    def receive_weights(self, update_info: MlograUpdateInfo) -> None:
        from megatron_logra.runtime.faults import engine_fault

        def after_first_round() -> None:
            if update_info.transport == Transport.FULL:
                engine_fault("engine-full-push", update_info.version, self.engine_start)
        self.shards.receive(self.group, self.address, update_info.rounds,
                            message_device(self.group, self.shards.device), after_first_round)
        if update_info.transport != Transport.FULL:
            engine_fault("engine-delta-push", update_info.version, self.engine_start)

    @property
    def engine_start(self) -> int:
        """Which server of the run this is (``server_process.ENGINE_START_ENV``)."""
        return int(os.environ.get("MLOGRA_ENGINE_START", "1"))

    def finish_weight_update(self) -> None:
        """Nothing to do: every message was applied in place as it came."""

    def shutdown(self) -> None:
        self.group = self.address = None
