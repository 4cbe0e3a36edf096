"""``SyncedEngines``: the rollout engines kept serving the trainer's weights (collective).

The RL side of the seam rl/ -> rollout/ -> weight_sync/, and where the two meet: the
engines (``rollout.engines.RolloutEngines``: placement, servers, their life cycle) report
a failure or a restart upward, and this class decides to push again
(``weight_sync.sync.WeightSync``: the pushes), as slime wires its rollout manager and
weight updater: the updater never restarts an engine, the rollout side never imports the
updater.

- ``push(version)``: the trainer's weights become ``version`` in every engine, one after
  the other (each has its own weight group). The very first push starts (or connects
  to) the servers. A failed push restarts that engine alone and pushes to it again
  (``TRIES`` tries); the others go on.
- ``generate(requests, version)``: completions from the engines serving ``version``
  (rank 0; None elsewhere); the engines that failed were restarted by the engine side,
  and get the weights again here before the requests are retried (``TRIES`` tries).
"""

from __future__ import annotations

import time

import torch

from megatron_logra.rollout.engines import RolloutEngines
from megatron_logra.rollout.types import Completion, SampleRequest
from megatron_logra.runtime.collectives import rank0_value
from megatron_logra.weight_sync.contract import needs
from megatron_logra.weight_sync.sync import SyncStats, WeightSync

TRIES = 3
ENGINE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # --rollout-dtype


class SyncedEngines:
    def __init__(self, engines: RolloutEngines, sync: WeightSync):
        self.engines, self.sync = engines, sync
        self.rank, self.replicas = engines.rank, engines.replicas

    @classmethod
    def start(cls, cfg, objs) -> SyncedEngines:
        """Collective: the run's engines placed (``cfg``: the ``RunConfig``; ``objs``: its
        ``TrainingObjects``) and the trainer's side of weight sync, set up for them (a
        weight group on gloo when the engines share the trainer's GPUs); no server runs
        before the first ``push``."""
        rl, opt = cfg.rl, cfg.optimizer
        lora = opt.lora if opt.peft == "lora" else None
        serves_adapter = needs(rl.weight_sync.transport).engine_serves_adapter
        engines = RolloutEngines.placed(
            rl.rollout, model_dir=cfg.model.model_dir, output_dir=cfg.output_dir,
            max_model_len=cfg.training.seq_length,
            lora_rank=lora.rank if serves_adapter and lora is not None else 0, arch=objs.arch)
        sync = WeightSync(rl.weight_sync, objs.model, objs.arch, ENGINE_DTYPES[rl.rollout.dtype],
                          optimizer=objs.optimizer, lora=lora,
                          engine_tp=rl.rollout.tensor_parallel_size,
                          group_backend="gloo" if engines.placement.shares_trainer_gpus
                          else None)
        return cls(engines, sync)

    @property
    def stats(self) -> SyncStats:
        return self.sync.stats

    # --- pushes --------------------------------------------------------------------------
    def push(self, version: int) -> None:
        """Push the trainer's weights as ``version`` into every engine; restart an engine
        and push to it again on failure."""
        if self.replicas > 1:  # start the ones not running all at once
            self.engines.start(list(range(self.replicas)))
        for replica in range(self.replicas):
            self.push_to(replica, version)

    def push_to(self, replica: int, version: int) -> None:
        """Push to engine ``replica`` alone (collective)."""
        self.engines.wake(replica, ["weights"])
        self.sync.use(replica)
        for _ in range(TRIES):
            t0 = time.perf_counter()
            failed, sent = self._push_once(replica, version)
            failed = rank0_value(failed)  # rank 0's outcome decides for every rank
            self.stats.seconds += time.perf_counter() - t0
            if not failed:
                self.stats.bytes += sent
                self.stats.pushes += 1
                return
            if self.rank == 0:
                print(f"weight push"
                      f"{' to ' + self.engines.name(replica) if self.replicas > 1 else ''} "
                      f"failed ({failed}); restarting the engine", flush=True)
                self.engines.restart(replica)
        name = rank0_value(self.engines.name(replica) if self.rank == 0 else None)
        to = "" if name == "engine" else f" to {name}"  # one engine started here: no name
        raise RuntimeError(f"weight push{to} failed {TRIES} times: see the engine errors "
                           f"above")

    def _push_once(self, replica: int, version: int) -> tuple[str, int]:
        """(failure message or "", bytes sent)."""
        failed = self.engines.start([replica])[replica]
        if failed:
            return failed, 0
        server = self.engines.servers[replica]
        # each server's own TP size (servers at several URLs may differ): its workers' blocks
        self.sync.use(replica, rank0_value(server.world_size if self.rank == 0 else None))
        result = self.sync.push(server, version)
        return result.failed, result.sent

    def mismatches(self) -> int | None:
        """The tensors the engines hold differently from the trainer, summed over the
        engines (vLLM's checksums; collective); None when a check failed."""
        counts = []
        for replica in range(self.replicas):
            self.sync.use(replica)
            counts.append(self.sync.engine_mismatches(self.engines.servers[replica]))
        return None if None in counts else sum(counts)

    # --- generation ------------------------------------------------------------------------
    def generate(self, requests: list[SampleRequest] | None, version: int,
                 phase: str = "rollouts") -> list[Completion] | None:
        """Completions of ``requests`` (rank 0; None elsewhere) from the engines serving
        ``version``; engines that failed are restarted (``RolloutEngines.try_generate``),
        resynced here, and the requests generated again."""
        for replica in range(self.replicas):
            self.engines.wake(replica, ["weights", "kv_cache"])
        for _ in range(TRIES):
            done, restarted = self.engines.try_generate(requests, version, phase)
            if not restarted:
                return done
            for replica in restarted:
                self.push_to(replica, version)
        names = rank0_value([self.engines.name(r) for r in restarted] if self.rank == 0
                            else None)
        raise RuntimeError(f"rollouts failed {TRIES} times ({', '.join(names)}): see the "
                           f"engine errors above")

    def generate_here(self, requests: list[SampleRequest], version: int,
                      phase: str = "rollouts") -> list[Completion]:
        """Rank 0 alone, no restart (``RolloutEngines.generate_here``)."""
        return self.engines.generate_here(requests, version, phase)

    def release(self) -> None:
        """Colocated engines give the devices to the trainer (collective)."""
        self.engines.release()

    def close(self) -> None:
        self.engines.close()
        self.sync.close()
