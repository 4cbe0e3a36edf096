"""One rank's dry run: the real code of one training update, traced on fake CUDA tensors.

``trace_rank(cfg, rank, world_size)`` makes this process rank ``rank`` of a fake world
(``world``), with fake CUDA (``fake_cuda``) under ``FakeTensorMode``, and runs what the
job runs, at full size:

1. build: megatron-core's groups and RNG seeds (``runtime.parallel.initialize``), the
   model, DDP, the optimizer and the scheduler (``training.build``, as
   ``training.prepare`` does; no weights are loaded: they have no values here);
2. one training update of the stage on the worst-case batch (``batch``): RL through
   ``rl.policy_update.PolicyUpdate.train`` (forward, backward, the non-finite guard, the
   optimizer step, predicted-KL control's tangent pass, scaling and realized-KL forward),
   SFT through ``training.step.train_step``;
3. RL: the first weight push (always full) for the recipe's engine layout: the push plan
   and every message each vLLM worker would receive from this rank
   (``weight_sync.channel``), packed on the device its group sends from; nothing is sent
   (the engine is not part of the trace), and the engine's share of a GPU it shares with
   the trainer is reported from its plan (``rollout.engine_memory``).

Memory (``memory.UpdateMemory``), collectives and host reads (``checks.TraceChecks``) are
recorded throughout; a failure the real run would meet (a device mismatch, a collective
a backend refuses) ends the trace with its call site.
"""

from __future__ import annotations

import time
import traceback

import torch

from megatron_logra.config import RunConfig
from megatron_logra.dry_run.batch import rl_samples, sft_microbatches
from megatron_logra.dry_run.call_sites import call_site, is_machinery, short_path
from megatron_logra.dry_run.checks import TraceChecks
from megatron_logra.dry_run.fake_cuda import fake_cuda
from megatron_logra.dry_run.memory import Category, UpdateMemory
from megatron_logra.dry_run.world import fake_world, object_collectives
from megatron_logra.memory.held_state import model_state_bytes
from megatron_logra.runtime.host_read import answered_by
from megatron_logra.runtime.megatron_optimizer import materialize_adam_state

GIB = 2**30


def trace_rank(cfg: RunConfig, rank: int, world_size: int, gpus_per_node: int = 8) -> dict:
    """The report of rank ``rank`` (see the module doc): its coordinates, model state, peak
    memory by category (the update's and the weight push's), collectives by phase and
    backend, the push's messages, the host reads answered, the engine's share, errors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start, cpu = time.perf_counter(), time.process_time()
    report: dict = {"rank": rank, "errors": []}
    checks = TraceChecks(UpdateMemory())
    with fake_cuda(), fake_world(rank, world_size, cfg.parallel, gpus_per_node) as where:
        report["coordinates"] = where.to_dict()
        with FakeTensorMode(allow_non_fake_inputs=True), checks, answered_by(checks.answer):
            try:
                _trace(cfg, world_size, gpus_per_node, checks, report)
            except Exception as exc:  # noqa: BLE001 - the report says what failed, and where
                report["errors"].append(_failure(exc, checks.phase))
    report["collectives"] = checks.summary()
    report["object_collectives"] = _counted(object_collectives)
    report["p2p_log"] = checks.p2p
    report["host_reads"] = [{"site": site, **entry} for site, entry in checks.host_reads.items()]
    report["trace_seconds"] = round(time.perf_counter() - start, 2)
    report["trace_cpu_seconds"] = round(time.process_time() - cpu, 2)
    return report


def _trace(cfg: RunConfig, world_size: int, gpus_per_node: int, checks: TraceChecks,
           report: dict) -> None:
    from megatron_logra.model.arch import load_arch
    from megatron_logra.runtime import parallel
    from megatron_logra.training.build import build_training_objects
    from megatron_logra.training.prepare import model_build_config

    parallel.initialize(cfg.parallel, world_size, cfg.training.seed)
    arch = load_arch(cfg.model.model_dir)
    objs = build_training_objects(arch, model_build_config(cfg), cfg.optimizer,
                                  seed=cfg.training.seed, train_iters=cfg.training.train_iters)
    report["params"] = sum(p.numel() for p in objs.model[0].parameters())
    materialize_adam_state(objs.dense_optimizer)  # an update of a job under way
    memory = checks.memory
    memory.register(objs)
    report["built_bytes"] = memory.snapshot("current")
    checks.phase = "update"
    with memory:
        _update(cfg, objs, arch)
    report["model_state_bytes"] = model_state_bytes(objs)
    report["update_peak"] = memory.snapshot("peak")
    report["update_peak_site"] = memory.peak_sites.get("cuda", [])
    report["peak_bytes"] = report["update_peak"]["total"]
    if cfg.training.stage != "rl":
        return
    checks.phase = "weight_push"
    memory.reset_peak()
    with memory, memory.labelled(Category.PUSH):
        report["weight_push"] = _first_push(cfg, objs, arch, world_size, gpus_per_node)
    report["push_peak"] = memory.snapshot("peak")
    report["push_peak_site"] = memory.peak_sites.get("cuda", [])
    report["peak_bytes"] = max(report["peak_bytes"], report["push_peak"]["total"])
    report["engine"] = _engine_share(cfg, arch, report["weight_push"])


def _update(cfg: RunConfig, objs, arch) -> None:
    """One update of the stage on its worst-case batch."""
    from megatron.core import parallel_state

    if cfg.training.stage == "rl":
        from megatron_logra.rl.policy_update import PolicyUpdate

        PolicyUpdate(cfg, objs, pad_id=0).train(rl_samples(cfg), update=0)
        return
    from megatron_logra.training.step import train_step

    microbatches = sft_microbatches(cfg, parallel_state.get_data_parallel_world_size())
    train_step(objs, microbatches, seq_length=cfg.training.seq_length,
               micro_batch_size=cfg.training.micro_batch_size, update=1)


def _placement(cfg: RunConfig, world_size: int, gpus_per_node: int):
    from megatron_logra.rollout.placement import plan_placement

    engine = cfg.rl.rollout
    return plan_placement(engine.placement, engine.devices,
                          engine_tp=engine.tensor_parallel_size, cuda=True,
                          node_devices=list(range(gpus_per_node)),
                          local_world_size=min(world_size, gpus_per_node),
                          remote_engine=bool(engine.engine_url), replicas=engine.replicas)


def _first_push(cfg: RunConfig, objs, arch, world_size: int, gpus_per_node: int) -> dict:
    """The first push's messages from this rank (``weight_sync.channel``'s full rounds:
    a bucket of parameters per round, one message per engine worker), each packed and
    dropped in turn as the real push sends and frees them."""
    from megatron_logra.rl.synced_engines import ENGINE_DTYPES
    from megatron_logra.weight_sync.contract import needs
    from megatron_logra.weight_sync.transport import TrainerWeights

    rl = cfg.rl
    placement = _placement(cfg, world_size, gpus_per_node)
    weights = TrainerWeights(objs.model, arch, ENGINE_DTYPES[rl.rollout.dtype],
                             rl.weight_sync.bucket_mb * 2**20, rl.rollout.tensor_parallel_size,
                             merged=not needs(rl.weight_sync.transport).engine_serves_adapter,
                             group_backend="gloo" if placement.shares_trainer_gpus else None)
    channel = weights.direct
    # where the messages live (weight_sync.p2p.message_device of the group the push joins)
    device = channel.device if channel.backend == "nccl" else torch.device("cpu")
    per_worker = [0] * channel.engine_tp
    rounds = channel._buckets(None)
    for names in rounds:
        for worker, box in enumerate(channel._blocks_round(names, record=False)):
            if box.empty:
                continue
            _, tensors = box.pack(channel.dtype, device)
            per_worker[worker] += sum(t.numel() * t.element_size() for t in tensors)
            del tensors
    return {"placement": placement.mode, "colocated": placement.shares_trainer_gpus,
            "sleep_mode": placement.sleep_mode,
            "group_backend": channel.backend, "message_device": str(device),
            "rounds": len(rounds), "bytes": sum(per_worker), "bytes_per_worker": per_worker,
            "parameters_sent": len(channel.shards)}


def _engine_share(cfg: RunConfig, arch, push: dict) -> dict:
    """The rollout engine's bytes per GPU it runs on (its plan: weights over its TP, the KV
    cache it is given, its CUDA context), and on how many GPUs (its TP ranks, times the
    replicas); those are the trainer's when it shares them (``colocated``)."""
    from megatron_logra.rollout.engine_memory import engine_bytes

    engine = cfg.rl.rollout
    kv = int(engine.kv_cache_gib * GIB) if engine.kv_cache_gib else 0
    total = engine_bytes(arch.num_parameters, engine.tensor_parallel_size,
                         2 if engine.dtype == "bfloat16" else 4, kv)
    return {"colocated": push["colocated"], "sleep_mode": push["sleep_mode"],
            "engine_tp": engine.tensor_parallel_size,
            "gpus": engine.tensor_parallel_size * engine.replicas,
            "kv_cache_bytes": kv, "bytes_per_gpu": total}


def _failure(exc: Exception, phase: str) -> dict:
    """What failed, in which phase, and where: the innermost frame of the exception's
    traceback outside torch and the dry run (the message of a dry-run check names its own
    site)."""
    frames = traceback.extract_tb(exc.__traceback__)
    site = next((f"{short_path(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames)
                 if not is_machinery(f.filename)), call_site())
    return {"phase": phase, "kind": type(exc).__name__, "message": str(exc)[:2000],
            "site": site, "frames": [f"{short_path(f.filename)}:{f.lineno} {f.name}"
                                     for f in frames[-12:]]}


def _counted(notes: list[dict]) -> list[dict]:
    """Equal notes once each, with their count."""
    out: dict[tuple, dict] = {}
    for note in notes:
        entry = out.setdefault(tuple(note.items()), {**note, "count": 0})
        entry["count"] += 1
    return list(out.values())
