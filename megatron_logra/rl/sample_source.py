"""Where an RL update's samples come from: the engine, the verifier, the prompts, the
advantages (rank 0), and the weight pushes that keep the engine on the trainer's weights.

``RolloutSource`` places the engine (``rollout.placement``), starts rank 0's driver
(prompts, verifier, the vLLM server's config), links to the engine
(``rollout.engines.EngineLink``, every push through ``weight_sync``) and owns the
reward baseline. ``rollout_batch(update)`` samples P prompts x G responses at the
current version, scores them and computes the advantages (with --dynamic-sampling,
groups without reward spread are replaced by more generations), and broadcasts the
samples to every rank; ``evaluate()`` scores the held-out prompts (pass@1, pass@k).
Collective: every rank calls every method.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_logra.config import RunConfig
from megatron_logra.data.tasks import generate_items
from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.rl import advantages as adv
from megatron_logra.rl import prompts_and_scores as scores
from megatron_logra.rl.policy_loss import RolloutSample
from megatron_logra.rl.verifiers import Verifier
from megatron_logra.rollout.engines import EngineLink
from megatron_logra.rollout.engine_memory import shared_gpu_sizer
from megatron_logra.rollout.placement import EnginePlacement, plan_placement, split_replicas
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.runtime.collectives import from_rank0
from megatron_logra.runtime.device import current_device, node_devices
from megatron_logra.training.build import TrainingObjects
from megatron_logra.weight_sync.sync import WeightSync

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class _Driver:
    """Rank 0's engine config, verifier and prompts (None elsewhere)."""

    engine_cfgs: list[ServerSpec]  # one per --rollout-replicas
    verifier: Verifier
    train_prompts: list
    eval_prompts: list
    tokenizer: object


class RolloutSource:
    def __init__(self, cfg: RunConfig, objs: TrainingObjects):
        self.cfg, self.rank = cfg, dist.get_rank()
        rl, opt = cfg.rl, cfg.optimizer
        self.replica_placements: list[EnginePlacement] = []  # rank 0: each engine's
        self.placement = self._place_engine()
        self.weights = WeightSync(rl.weight_sync, objs.model, objs.arch,
                                  _DTYPES[rl.rollout.dtype], optimizer=objs.optimizer,
                                  lora=opt.lora if opt.peft == "lora" else None,
                                  engine_tp=rl.rollout.tensor_parallel_size,
                                  group_backend="gloo" if self.placement.shares_trainer_gpus
                                  else None)
        self.baseline = adv.RunningBaseline(rl.baseline_decay)
        self.driver = self._start_driver_everywhere()
        self.link = EngineLink(self.weights, self.driver.engine_cfgs if self.driver else None,
                               sleep_mode=self.placement.sleep_mode,
                               replicas=rl.rollout.replicas,
                               sizer=shared_gpu_sizer(rl.rollout, objs.arch, self.placement,
                                                      self.replica_placements))

    @property
    def engine(self):
        """Rank 0's ``VllmServer`` (None elsewhere, and before the first push)."""
        return self.link.engine

    def push(self, version: int, transport: str | None = None) -> None:
        """Push the trainer's weights as ``version``; ``transport`` forces one (tests,
        benchmarks)."""
        self.link.push(version, transport)

    def engine_mismatches(self) -> int | None:
        """The tensors the engines hold differently from the trainer, summed over the
        engines (vLLM's checksums; collective); None when a check failed."""
        counts = []
        for replica in range(self.link.replicas):
            self.weights.use(replica)
            counts.append(self.weights.engine_mismatches(self.link.engines[replica]))
        return None if None in counts else sum(counts)

    def close(self) -> None:
        self.link.close()
        if self.driver is not None:
            self.driver.verifier.close()

    # --- set-up --------------------------------------------------------------------------
    def _place_engine(self) -> EnginePlacement:
        """Rank 0 plans where the engine runs on its node (``rollout.placement``; a refusal
        is raised on every rank), and node 0's trainer ranks keep off a dedicated
        engine's CPU cores."""
        rl = self.cfg.rl
        cuda = current_device().type == "cuda"

        def plan() -> EnginePlacement:
            whole = plan_placement(
                rl.rollout.placement, rl.rollout.devices,
                engine_tp=rl.rollout.tensor_parallel_size, cuda=cuda,
                node_devices=node_devices(),
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                visible=os.environ.get("CUDA_VISIBLE_DEVICES"),
                remote_engine=bool(rl.rollout.engine_url), replicas=rl.rollout.replicas)
            self.replica_placements = split_replicas(
                whole, rl.rollout.replicas, rl.rollout.tensor_parallel_size, cuda=cuda,
                node_devices=node_devices(), visible=os.environ.get("CUDA_VISIBLE_DEVICES"))
            return whole
        placement = from_rank0(plan)
        if placement.trainer_cores and os.environ.get("GROUP_RANK", "0") == "0":
            os.sched_setaffinity(0, placement.trainer_cores)
        if self.rank == 0 and (placement.note or placement.devices):
            kind = "cores" if placement.trainer_cores else "GPUs"
            print(placement.note or f"rollout engine on {kind} {list(placement.devices)} of "
                  f"node 0, dedicated", flush=True)
        return placement

    def _start_driver_everywhere(self) -> _Driver | None:
        """Rank 0 builds the driver; a failure there (bad task data, no prompts fit) is
        raised on every rank, so no rank waits in a collective for a rank that died."""
        driver = None

        def start() -> None:  # rank 0 keeps the driver
            nonlocal driver
            try:
                driver = self._start_driver()
            except (ValueError, RuntimeError, OSError) as exc:
                raise RuntimeError(
                    f"RL set-up failed on rank 0: {type(exc).__name__}: {exc}") from exc
        from_rank0(start)
        return driver

    def _start_driver(self) -> _Driver:
        cfg, rl = self.cfg, self.cfg.rl
        tokenizer = load_tokenizer(cfg.model.model_dir, cfg.model.tokenizer_model)
        items = generate_items(cfg.data.tasks, cfg.data.dataset_size, self.data_seed)
        prompts = scores.encode_prompts(items, tokenizer,
                                          cfg.training.seq_length - rl.max_new_tokens)
        if len(prompts) <= rl.eval_prompts:
            raise ValueError(f"only {len(prompts)} prompts fit --seq-length - --max-new-tokens; "
                             f"raise --dataset-size or --seq-length (need > --eval-prompts)")
        init_dir = str(self._engine_init_dir())
        engine_cfgs = [ServerSpec(
            init_dir, max_model_len=cfg.training.seq_length, engine=rl.rollout,
            lora_rank=self.weights.engine_lora_rank, env=tuple(placed.env.items()),
            cpu_cores=placed.engine_cores, sleep_mode=placed.sleep_mode, replica=replica)
            for replica, placed in enumerate(self.replica_placements)]
        print(f"{len(prompts) - rl.eval_prompts} train / {rl.eval_prompts} eval prompts",
              flush=True)
        verifier = Verifier(rl.verifier)
        return _Driver(engine_cfgs, verifier, prompts[rl.eval_prompts:], prompts[:rl.eval_prompts],
                       tokenizer)

    @property
    def data_seed(self) -> int:
        d = self.cfg.data
        return d.data_seed if d.data_seed is not None else self.cfg.training.seed

    def _engine_init_dir(self) -> Path:
        """config + tokenizer of the model folder; the weights come with the first push."""
        out = Path(self.cfg.output_dir) / "engine_init"
        out.mkdir(parents=True, exist_ok=True)
        for f in Path(self.cfg.model.model_dir).iterdir():
            if f.is_file() and not f.name.endswith((".safetensors", ".bin", ".gguf")) \
                    and not f.name.endswith(".index.json"):
                shutil.copy2(f, out / f.name)
        return out

    # --- samples -------------------------------------------------------------------------
    def rollout_batch(self, update: int, version: int) -> tuple[list[RolloutSample], dict]:
        """Update ``update``'s samples (every rank) generated at weights ``version``, and
        the rollout's figures (collective: a failed engine is restarted and resynced)."""
        groups, stats = self._generate_groups(
            update, lambda requests, phase: self.link.generate(requests, version, phase),
            from_rank0)
        samples, stats = from_rank0(lambda: self._samples(groups, stats, version,
                                                          self.baseline))
        self.baseline.value = stats["baseline"]  # every rank checkpoints the same state
        return samples, stats

    def produce_here(self, update: int, version: int,
                     baseline: adv.RunningBaseline) -> tuple[list[RolloutSample], dict]:
        """Rank 0 alone (no collective: ``rl.samples_ahead`` runs it beside training):
        update ``update``'s samples from the engine serving ``version``, their advantages
        against ``baseline`` (which it advances); an engine failure raises EngineError."""
        groups, stats = self._generate_groups(
            update, lambda requests, phase: self.link.generate_here(requests, version, phase),
            lambda decide: decide())
        return self._samples(groups, stats, version, baseline)

    def _samples(self, groups: list, stats: dict, version: int,
                 baseline: adv.RunningBaseline) -> tuple[list[RolloutSample], dict]:
        """Rank 0: the update's samples (generated at ``version``) with their advantages,
        and ``stats`` with the rewards' and responses' figures."""
        rl = self.cfg.rl
        prompts = [p for p, _, _ in groups]
        completions = [c for _, group, _ in groups for c in group]
        r = torch.tensor([rewards for _, _, rewards in groups], dtype=torch.float32)
        if rl.algorithm == "grpo":
            a = adv.grpo_advantages(r, scale_by_std=rl.grpo_std_norm)
        else:
            failure = rl.failure_reward if rl.verifier.reward == "binary" else None
            a = baseline.advantages(adv.reinforce_outcomes(r, failure))
        samples = [RolloutSample(p.ids, c.token_ids, c.logprobs, float(a.flatten()[k]),
                                 truncated=c.truncated, reward=float(r.flatten()[k]),
                                 version=version)
                   for k, (p, c) in enumerate(zip(
                       [p for p in prompts for _ in range(rl.responses_per_prompt)],
                       completions))]
        length, truncated = scores.length_stats(completions)
        stats.update(reward_mean=float(r.mean()), response_len=length,
                     truncated_frac=truncated, baseline=baseline.value)
        return samples, stats

    def _generate_groups(self, update: int, generate, decide) -> tuple[list | None, dict]:
        """Rank 0: the update's P groups [(prompt, G completions, G rewards)]; None elsewhere.
        With --dynamic-sampling, groups whose rewards are all equal are set aside and more
        prompts generated until P groups have signal or --dynamic-sampling-max-rounds
        rounds are done; a batch still short is filled with set-aside groups.
        ``generate(requests, phase)``: the completions (rank 0); ``decide(fn)``: rank 0's
        ``fn()`` where every rank learns it (``from_rank0``: every rank takes part in each
        round), or where rank 0 alone does."""
        rl = self.cfg.rl
        kept, dropped, rounds, seconds = [], [], 0, 0.0
        while True:
            prompts = requests = None
            if self.rank == 0:
                prompts, requests = scores.step_requests(
                    self.driver.train_prompts, rl, update, self.data_seed, rounds)
            t0 = time.perf_counter()
            completions = generate(requests, f"rollouts {update + 1}" + (
                f" round {rounds + 1}" if rounds else ""))
            seconds += time.perf_counter() - t0
            more = decide(lambda: self._sort_groups(prompts, completions, kept, dropped,
                                                    rounds))
            rounds += 1
            if not more:
                break
        stats: dict = {"rollout_time_s": seconds}
        groups = None
        if self.rank == 0:
            groups, with_signal = scores.fill_groups(kept, dropped, rl.prompts_per_step)
            if rl.dynamic_sampling:
                stats.update(dynamic_sampling_rounds=rounds,
                             dynamic_sampling_signal_groups=with_signal,
                             dynamic_sampling_dropped_groups=len(dropped))
        return groups, stats

    def _sort_groups(self, prompts, completions, kept: list, dropped: list,
                     rounds: int) -> bool:
        """Rank 0: each prompt's group scored and added to ``kept``, or to ``dropped``
        (no signal under --dynamic-sampling); whether another round is wanted (``rounds``:
        the rounds done before this one)."""
        rl = self.cfg.rl
        rewards = scores.score(self.driver.verifier, self.driver.tokenizer, prompts,
                                 completions, rl.responses_per_prompt)
        g = rl.responses_per_prompt
        for i, prompt in enumerate(prompts):
            group = (prompt, completions[i * g:(i + 1) * g], rewards[i])
            signal = not rl.dynamic_sampling or scores.has_signal(rewards[i])
            (kept if signal else dropped).append(group)
        return (rl.dynamic_sampling and len(kept) < rl.prompts_per_step
                and rounds + 1 < rl.dynamic_sampling_max_rounds)

    def evaluate(self, version: int) -> dict:
        """Held-out pass@1 and pass@k at weights ``version`` (every rank)."""
        rl = self.cfg.rl
        requests = scores.eval_requests(self.driver.eval_prompts, rl) if self.rank == 0 else None
        completions = self.link.generate(requests, version, "eval")

        def score() -> dict:  # rank 0, which holds the verifier
            rewards = scores.score(self.driver.verifier, self.driver.tokenizer,
                                     self.driver.eval_prompts, completions, rl.eval_samples)
            p1, pk = scores.pass_at(rewards)
            length, truncated = scores.length_stats(completions)
            return {"eval_pass@1": p1, f"eval_pass@{rl.eval_samples}": pk,
                    "eval_response_len": length, "eval_truncated_frac": truncated,
                    # per eval prompt (fixed prompts and seeds): paired gains and their SE
                    "eval_prompt_pass": scores.prompt_pass_rates(rewards)}
        return from_rank0(score)
