"""The LoGRA optimizer: RowAdam on the sketched weights (the paper's update rule).

``LograOptimizer`` owns the sketched weights' update. The other parameters are either
frozen (the paper's reference: ``dense`` is None, no optimizer state, no grads) or
trained by the megatron-core optimizer it wraps (``dense``: megatron keeps their DP
reduction, clipping, mixed precision and sharding). ``step()`` runs the dense step (if
any), then the RowAdam update of every sketched weight, in the reference's order
(``skzhang1/RL`` ``nemo_rl/models/automodel/logra.py``):

1. the reduced sketch (of the per-token mean loss) is divided by the global token
   count again, as the reference does (this only weights the steps inside v);
2. v, rho per local row (``row_adam``); per HF module (q, k, v, o, gate, up, down) the
   mean rho and, with norm restoration, ||S_m||: partial sums over TP for
   column-parallel weights (their rows are split) and over DP for row-sharded ones;
3. D = S / (rho + eps mean_m rho), then D_m *= ||S_m|| / ||D_m|| (restoration);
4. one global factor c over all sketched weights, ``update_ratio * ||W|| / ||D A||``
   (||W|| from the fp32 masters when kept; partial squared norms summed over TP and PP)
   or the scheduler's learning rate;
5. ``alpha`` = ``scale_fn(stats)`` when ``step_sketches`` is given one (predicted-KL
   control, ``kl/scaled_step``); 1 in ``step()``;
6. the factor alpha c D is rounded to bf16 (the reference's default;
   ``update_factor_dtype``), then W -= (alpha c D) A in row chunks, in one of the
   precision modes: fp32 params (exact); bf16 params + fp32 master (the master gets
   the update, the bf16 weight is rounded from it); bf16 params only (``none``): the
   fp32 value of W - (alpha c D) A is rounded stochastically with counter-based bits, so
   any process holding the same bf16 W and (factor, seed) reproduces it bit-exactly.

Then the sketches are zeroed and new projections drawn for the next update.

Every rank of a DP group holds the same reduced S. Without the distributed optimizer
each computes the whole update; with it (``shard_over_dp``) each DP rank owns whole
rows of every sketched weight (``row_shards``): it keeps v and the fp32 master for
those rows only, updates them, and the DP group all-gathers the updated rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.logra import row_adam
from megatron_logra.logra.config import LograConfig
from megatron_logra.logra.low_rank_apply import apply_bf16_update
from megatron_logra.logra.row_shards import RowShard, all_gather_rows, plan_row_shard
from megatron_logra.logra.sketched_linear import SketchSlot
from megatron_logra.logra.sketches import EMBEDDING, SketchSet
from megatron_logra.runtime.host_read import host_value
from megatron_logra.runtime.phase_times import PHASES

FACTOR_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass
class SketchUpdate:
    """What one update did to a sketched weight: W -= coefficient * D A(seed)."""

    d: torch.Tensor  # [owned rows, r] fp32 (bf16-representable with a bf16 factor)
    coefficient: float  # 1 when D is the rounded factor alpha c D itself
    seed: int
    shard: RowShard  # which local rows of the weight d's rows are (all without DP sharding)


def _active_rows(d: torch.Tensor) -> torch.Tensor | None:
    """Indices of D's nonzero rows when they are under half of them (else None: all rows).
    Asked only of the word embedding, whose unseen tokens' rows get no gradient."""
    nonzero = d.abs().amax(dim=1) > 0
    count = int(host_value(nonzero.sum(), assume=d.shape[0]))  # a trace updates every row
    return None if count * 2 > d.shape[0] else nonzero.nonzero().squeeze(1)


class LograOptimizer:
    """RowAdam over a ``SketchSet`` (+ the dense megatron optimizer, if any); megatron's
    optimizer API."""

    def __init__(self, dense, sketches: SketchSet, cfg: LograConfig, *, lr: float,
                 shard_over_dp: bool = False):
        """``cfg``: the run's LoGRA settings (RowAdam's beta2, eps, update ratio, master
        weights, norm restoration, factor dtype, keep_updates; checked when built); ``lr``:
        the schedule's peak, the step size when no dense optimizer carries param groups;
        ``shard_over_dp``: row-aligned DP sharding (--use-distributed-optimizer)."""
        self.dense, self.sketches, self.cfg = dense, sketches, cfg
        self.shard_over_dp = shard_over_dp
        # without a dense optimizer the scheduler drives these groups (the lr step size)
        self._groups = [{"lr": lr, "weight_decay": 0.0, "params": []}]
        dp_size, dp_rank = 1, 0
        if shard_over_dp:
            dp_size = parallel_state.get_data_parallel_world_size()
            dp_rank = parallel_state.get_data_parallel_rank()
        self.shards = [plan_row_shard(p.shape[0], s.gated_halves, dp_size, dp_rank)
                       for p, s in zip(sketches.params, sketches.slots)]
        self.row_v = [torch.zeros(sh.num_owned, dtype=torch.float32, device=p.device)
                      for p, sh in zip(sketches.params, self.shards)]
        keep_master = [p.dtype != torch.float32 and cfg.master_weights == "fp32"
                       for p in sketches.params]
        self.masters = [sh.take(p.detach()).float().clone() if keep else None
                        for p, sh, keep in zip(sketches.params, self.shards, keep_master)]
        # per-module statistics: slot i's modules are entries [offsets[i], offsets[i + 1])
        self.module_offsets = [0, *accumulate(len(slot.module_names)
                                              for slot in sketches.slots)]
        self.owned_modules = [sh.take(slot.module_rows)
                              for sh, slot in zip(self.shards, sketches.slots)]
        # which modules' rows are split over DP (row-sharded weights) and over TP
        # (column-parallel weights): their statistics are summed over that group
        per_module = [(sh.sharded, slot.parallel == "column", len(slot.module_names))
                      for sh, slot in zip(self.shards, sketches.slots)]
        self.module_split = tuple(
            tuple(flags[k] for flags in per_module for _ in range(flags[2])) for k in (0, 1))
        self.steps = 0  # RowAdam steps taken (bias correction)
        # (D, coefficient, seed) per weight of the last update, for a receiver (rollout engine,
        # tests); off by default: it holds another out x r fp32 tensor per sketched weight
        self.keep_updates = cfg.keep_updates
        self.last_updates: dict[str, SketchUpdate] = {}
        self.last_stats: dict[str, float] = {}
        sketches.refresh(0)

    # --- megatron optimizer API the trainer and scheduler use -------------------------------
    @property
    def param_groups(self):
        return self.dense.param_groups if self.dense is not None else self._groups

    def scale_loss(self, loss):
        return self.dense.scale_loss(loss) if self.dense is not None else loss

    def zero_grad(self, set_to_none: bool = True):
        if self.dense is not None:
            self.dense.zero_grad(set_to_none)
        self.sketches.zero()

    def sketch_buffers(self) -> list[torch.Tensor]:
        """The flat buffers of this rank's reduced sketches (``training.step`` checks them
        for non-finite values before the step)."""
        return [b for b in self.sketches.buffers.values() if b.numel()]

    def get_loss_scale(self):
        if self.dense is not None:
            return self.dense.get_loss_scale()
        return torch.ones((), device=self._device())

    @torch.no_grad()
    def step(self):
        ok, grad_norm, zeros = True, None, None
        if self.dense is not None:
            ok, grad_norm, zeros = self.dense.step()
        if ok:
            self.step_sketches()
        return ok, self.reported_grad_norm(grad_norm), zeros

    def reported_grad_norm(self, dense_grad_norm: float | None) -> float | None:
        """The grad norm to log: the dense step's, or with every unsketched parameter
        frozen (no dense step) the norm of the last update's reduced sketches."""
        if self.dense is None:
            return self.last_stats.get("sketch_norm")
        return dense_grad_norm

    def gather_directions(self) -> list[SketchSlot]:
        """During ``scale_fn``: the sketched weights' slots, each ``sketch`` holding this
        update's direction D (all local rows) beside its projection A; the weight tangent
        is -c D A (``kl/weight_tangent``). With DP sharding each rank computed D for its own
        rows only: the rows are all-gathered into the sketch buffers first (the step reads
        its own)."""
        if self.shard_over_dp:
            group = parallel_state.get_data_parallel_group()
            for slot, shard in zip(self.sketches.slots, self.shards):
                all_gather_rows(slot.sketch, shard, group)
        return list(self.sketches.slots)

    # --- RowAdam ---------------------------------------------------------------------------
    def _lr(self) -> float:
        return float(self.param_groups[0]["lr"])

    def _module_sums(self, width: int, per_row) -> torch.Tensor:
        """[width, modules] per-module sums of ``width`` per-row statistics, summed over the
        ranks that hold other rows of the same module: DP (row-sharded weights) and TP
        (column-parallel weights). ``per_row(i)`` returns ``width`` tensors [owned rows of
        slot i]."""
        sk, offsets = self.sketches, self.module_offsets
        parts = [torch.zeros(width, 0, dtype=torch.float64, device=self._device())]
        for i in range(len(sk)):
            values = per_row(i)
            n = offsets[i + 1] - offsets[i]
            parts.append(torch.stack([row_adam.module_sums(v, self.owned_modules[i], n)
                                      for v in values]))
        rows = torch.cat(parts, dim=1).cpu()
        dp_split, tp_split = self.module_split
        rows = self._masked_sum(rows, dp_split, parallel_state.get_data_parallel_group)
        return self._masked_sum(rows, tp_split, parallel_state.get_tensor_model_parallel_group)

    def _directions(self) -> float:
        """Turn each sketch's owned rows into D [owned rows, r] in place (the sketch buffer is
        zeroed after the step anyway, so D costs no second out x r tensor per weight).
        Returns ||S||_F of the whole model's reduced sketches (before the token division).

        One read of each sketch (its row norms) and one in-place scaling: the token division,
        1 / (rho + eps mean rho) and the module's restoration factor are one fp64 factor per
        row, and ||D_m||^2 follows from the row norms (sum_i ||S_i||^2 / denom_i^2)."""
        cfg, sk = self.cfg, self.sketches
        tokens = sk.num_tokens  # the reference's normalisation: S / generated tokens, again
        row_sq, rhos = [], []
        for i, (slot, shard) in enumerate(zip(sk.slots, self.shards)):
            norms = torch.linalg.vector_norm(shard.take(slot.sketch), dim=1)  # fp32, r terms
            row_sq.append(norms.double().square_().div_(tokens ** 2))  # ||S_i / tokens||^2
            self.row_v[i].mul_(cfg.beta2).add_((row_sq[i] / slot.sketch.shape[1]).float(),
                                               alpha=1.0 - cfg.beta2)
            rhos.append(row_adam.row_scale(self.row_v[i], self.steps, cfg.beta2))
        rho_sum, count, sketch_sq = self._module_sums(
            3, lambda i: [rhos[i], torch.ones_like(rhos[i]), row_sq[i]])
        mean_rho = rho_sum / count.clamp(min=1)
        denoms = [row_adam.row_denominator(rhos[i].double(), self._of_rows(mean_rho, i), cfg.eps)
                  for i in range(len(sk))]
        restore = torch.ones_like(sketch_sq)
        if cfg.norm_restoration:
            (direction_sq,) = self._module_sums(1, lambda i: [row_sq[i] / denoms[i].square()])
            restore = row_adam.restoration_factors(sketch_sq, direction_sq)
        for i, (slot, shard) in enumerate(zip(sk.slots, self.shards)):
            factor = (self._of_rows(restore, i) / denoms[i] / tokens).float()
            for rows, state_rows in shard.pieces():
                slot.sketch[rows].mul_(factor[state_rows, None])
        return self._sketch_norm(sketch_sq) * tokens

    def _of_rows(self, per_module: torch.Tensor, i: int) -> torch.Tensor:
        """A per-module statistic [all modules] (fp64) for each owned row of slot i."""
        mine = per_module[self.module_offsets[i]:self.module_offsets[i + 1]]
        return mine.to(self._device())[self.owned_modules[i]]

    def _sketch_norm(self, sketch_sq: torch.Tensor) -> float:
        """||S||_F over the model from per-module squared norms (whole over TP and DP
        already): a tied embedding's last-stage copy counted once, stages summed over PP."""
        total = torch.zeros(1, dtype=torch.float64)
        for i, slot in enumerate(self.sketches.slots):
            if not slot.duplicate:
                total += sketch_sq[self.module_offsets[i]:self.module_offsets[i + 1]].sum()
        total = self._masked_sum(total, (True,),
                                 parallel_state.get_pipeline_model_parallel_group)
        return host_value(total[0], assume=1.0) ** 0.5

    def _masked_sum(self, values: torch.Tensor, mask: tuple[bool, ...],
                    group_fn) -> torch.Tensor:
        """``values`` [..., n] with the columns where ``mask`` (n flags) holds summed over a
        group."""
        if not any(mask) or not dist.is_initialized():
            return values
        group = group_fn()
        if dist.get_world_size(group) == 1:
            return values
        where = torch.tensor(mask, dtype=torch.bool)
        summed = torch.where(where, values, 0.0).to(self._device())
        dist.all_reduce(summed, group=group)
        return torch.where(where, summed.cpu(), values)

    def _device(self) -> torch.device:
        return self.sketches.params[0].device if len(self.sketches) else torch.device("cpu")

    def _global_norms(self) -> tuple[float, float]:
        """(||W||^2, ||c-free update D A||^2) over every sketched weight of the model: partial
        sums over owned rows (of the fp32 master when kept), summed over DP for sharded
        weights, then over TP and PP. A tied embedding's last-stage copy is the same matrix:
        counted once."""
        parts = torch.zeros(2, 2, dtype=torch.float64)  # [weight, update] x [replicated, sharded]
        for i, (param, slot, shard) in enumerate(zip(self.sketches.params, self.sketches.slots,
                                                     self.shards)):
            if slot.duplicate:
                continue
            d = shard.take(slot.sketch)
            master = self.masters[i]
            weight_sq = sum(row_adam.weight_sq_norm(
                param[rows] if master is None else master[state_rows])
                for rows, state_rows in shard.pieces())
            nonzero = _active_rows(d) if slot.name == EMBEDDING else None
            update_sq = host_value(row_adam.update_sq_norm(
                d if nonzero is None else d[nonzero], slot.projection), assume=1.0)
            parts[:, int(shard.sharded)] += torch.tensor([weight_sq, update_sq],
                                                         dtype=torch.float64)
        parts = self._masked_sum(parts, (False, True), parallel_state.get_data_parallel_group)
        totals = self._masked_sum(parts.sum(dim=1), (True, True),
                                  parallel_state.get_model_parallel_group)
        weight_sq, update_sq = host_value(totals, assume=[1.0, 1.0])
        return weight_sq, update_sq

    @torch.no_grad()
    def step_sketches(self, scale_fn: Callable[[dict], float] | None = None) -> None:
        """The RowAdam update of every sketched weight (after the dense step, if any)."""
        cfg, sk = self.cfg, self.sketches
        update = self.steps  # 0-based index of this update
        self.steps += 1
        with PHASES("row_adam"):  # D, its norms and the step size
            sketch_norm = self._directions()
            weight_sq, update_sq = self._global_norms()
        if cfg.update_ratio is not None:
            c = row_adam.norm_ratio_factor(cfg.update_ratio, weight_sq, update_sq)
        else:
            c = self._lr()
        stats = {"update": update, "c": c, "weight_norm": weight_sq ** 0.5,
                 "update_norm": update_sq ** 0.5, "sketch_norm": sketch_norm}
        alpha = 1.0 if scale_fn is None else float(scale_fn(stats))
        stats["alpha"] = alpha
        coefficient = alpha * c
        self.last_updates = {}
        with PHASES("low_rank_apply"):
            self._apply_all(update, coefficient)
        self.last_stats = stats
        sk.zero()
        with PHASES("projection"):
            sk.refresh(update + 1)

    def _apply_all(self, update: int, coefficient: float) -> None:
        """W -= coefficient D A for every sketched weight (D in the sketch buffers), the factor
        rounded first; DP-sharded rows all-gathered after."""
        cfg, sk = self.cfg, self.sketches
        factor_dtype = FACTOR_DTYPES[cfg.update_factor_dtype]
        dp_group = parallel_state.get_data_parallel_group() if self.shard_over_dp else None
        for i, (param, slot, shard) in enumerate(zip(sk.params, sk.slots, self.shards)):
            seed = sk.seed_of(slot, update)
            applied = coefficient
            if factor_dtype != torch.float32:  # the factor alpha c D itself, rounded
                for rows, _ in shard.pieces():
                    d = slot.sketch[rows]
                    d.copy_(d.mul_(coefficient).to(factor_dtype))
                applied = 1.0
            for rows, state_rows in shard.pieces():
                self._apply(i, param, slot, rows, state_rows, slot.sketch[rows], applied, seed)
            all_gather_rows(param.data, shard, dp_group)
            if self.keep_updates:
                self.last_updates[slot.name] = SketchUpdate(shard.take(slot.sketch).clone(),
                                                            applied, seed, shard)

    def _apply(self, i: int, param, slot, rows: slice, state_rows: slice, d: torch.Tensor,
               coefficient: float, seed: int) -> None:
        """W[rows] -= coefficient D A (D [rows, r]); only on D's nonzero rows when they are
        few (an embedding's unseen tokens: row-wise independent, the result is the same)."""
        cfg = self.cfg
        master = None if self.masters[i] is None else self.masters[i][state_rows]
        target = master if master is not None else param.data[rows]
        global_rows = slot.global_rows[rows]
        active = _active_rows(d) if slot.name == EMBEDDING else None
        block = target if active is None else target[active]
        if active is not None:
            d, global_rows = d[active], global_rows[active.cpu()]
        if master is None and param.dtype == torch.bfloat16 and cfg.master_weights == "none":
            apply_bf16_update(block, d, coefficient, seed, rank=self.sketches.cfg.rank,
                              kind=self.sketches.cfg.projection, global_rows=global_rows,
                              col_offset=slot.col_offset, projection=slot.projection)
        else:  # an fp32 master, or fp32 params
            row_adam.apply_low_rank_update(block, d, slot.projection, coefficient, exact=False)
        if active is not None:
            target[active] = block
        if master is not None:
            weight_rows = param.data[rows]
            if active is None:
                weight_rows.copy_(master)
            else:
                weight_rows[active] = master[active].to(param.dtype)

    # --- state ------------------------------------------------------------------------------
    def reload_masters(self) -> None:
        """Re-copy the fp32 masters from the weights (after weights were loaded underneath)."""
        for param, shard, master in zip(self.sketches.params, self.shards, self.masters):
            if master is not None:
                master.copy_(shard.take(param.detach()).float())

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """megatron's dense state + RowAdam's row states and masters as sharded tensors in the
        canonical (TP=1) layout, so they reshard across TP/PP/DP like the weights."""
        from megatron_logra.logra.state_sharding import logra_sharded_state

        state = {"logra": logra_sharded_state(self)}
        if self.dense is not None:
            state["dense"] = self.dense.sharded_state_dict(model_sharded_state_dict,
                                                           is_loading=is_loading, **kwargs)
        return state

    def load_state_dict(self, state: dict) -> None:
        from megatron_logra.logra.state_sharding import load_logra_state

        if self.dense is not None:
            self.dense.load_state_dict(state["dense"])
        load_logra_state(self, state["logra"])
        self.sketches.zero()
        self.sketches.refresh(self.steps)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the sketched weights (for the memory accounting)."""
        indices = {id(t.untyped_storage()): t.untyped_storage().nbytes()
                   for slot, owned in zip(self.sketches.slots, self.owned_modules)
                   for t in (slot.global_rows, slot.module_rows, owned)}
        return {"sketches": self.sketches.sketch_bytes(),
                "row_indices": sum(indices.values()),  # int64: global row, HF module
                "row_states": sum(v.numel() * 4 for v in self.row_v),
                "masters": sum(m.numel() * 4 for m in self.masters if m is not None),
                "projections": sum(s.projection.numel() * s.projection.element_size()
                                   for s in self.sketches.slots if s.projection is not None)}
