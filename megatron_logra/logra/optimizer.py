"""The LoGRA optimizer: RowAdam on the sketched weights beside megatron's dense Adam.

``LograOptimizer`` wraps the megatron-core optimizer built for the parameters
that still require grad (norm weights, biases, q/k norms: "dense Adam for
unsketched params"), so megatron keeps doing their DP reduction, clipping,
mixed precision and (with ``--use-distributed-optimizer``) their sharding and
all-gather. ``step()`` runs it, then the RowAdam update of every sketched weight:

1. v, rho per local row (``row_adam``); mean rho per layer, summed over TP for
   column-parallel layers (their rows are split), local for row-parallel ones;
2. D = S / (rho + eps mean rho); one global factor c over all sketched layers,
   ``update_ratio * ||W|| / ||D A||`` (partial squared norms summed over the
   model-parallel group: TP and PP) or the scheduler's learning rate;
3. ``alpha`` = ``step_scale_fn(...)`` (predicted-KL control; 1 by default);
4. W -= alpha c D A in row chunks, in one of the precision modes:
   fp32 params (exact); bf16 params + fp32 master (the master gets the update,
   the bf16 weight is rounded from it); bf16 params only (``none``): the fp32
   value of W - alpha c D A is rounded stochastically with counter-based bits,
   D first rounded to bf16 (the payload a rollout engine receives), so any
   process holding the same bf16 W and (D, seed) reproduces the result bit-exactly.

Then the sketches are zeroed and new projections drawn for the next update.
Every rank of a DP group holds the same reduced S and computes the same update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_logra.logra import row_adam
from megatron_logra.logra.low_rank_apply import apply_bf16_update
from megatron_logra.logra.sketches import SketchSet

MASTER_MODES = ("fp32", "none")


@dataclass(frozen=True)
class RowAdamConfig:
    beta2: float = 0.95
    eps: float = 1e-8
    update_ratio: float | None = None  # None: the step is the learning rate
    master_weights: str = "fp32"  # for bf16 params: "fp32" master copy | "none" (SR)
    chunk_rows: int = row_adam.DEFAULT_CHUNK_ROWS


@dataclass
class SketchUpdate:
    """What one update did to a sketched weight: W -= coefficient * D A(seed)."""

    d: torch.Tensor  # [out_local, r] fp32 (bf16-representable in "none" mode)
    coefficient: float  # alpha * c
    seed: int


def _active_rows(d: torch.Tensor) -> torch.Tensor | None:
    """Indices of D's nonzero rows when they are under half of them (else None: all rows)."""
    nonzero = d.abs().amax(dim=1) > 0
    count = int(nonzero.sum())
    return None if count * 2 > d.shape[0] else nonzero.nonzero().squeeze(1)


class LograOptimizer:
    """Dense megatron optimizer + RowAdam over a ``SketchSet``; megatron's optimizer API."""

    def __init__(self, dense, sketches: SketchSet, cfg: RowAdamConfig, *,
                 step_scale_fn: Callable[[dict], float] | None = None):
        if cfg.master_weights not in MASTER_MODES:
            raise ValueError(f"--logra-master-weights {cfg.master_weights!r}: choose from "
                             f"{MASTER_MODES}")
        self.dense, self.sketches, self.cfg = dense, sketches, cfg
        self.step_scale_fn = step_scale_fn
        self.row_v = [torch.zeros(p.shape[0], dtype=torch.float32, device=p.device)
                      for p in sketches.params]
        low_precision = [p.dtype != torch.float32 for p in sketches.params]
        self.masters = [p.detach().float().clone() if low and cfg.master_weights == "fp32" else None
                        for p, low in zip(sketches.params, low_precision)]
        self.steps = 0  # RowAdam steps taken (bias correction)
        # (D, coefficient, seed) per weight of the last update, for a receiver (rollout engine,
        # tests); off by default: it holds another out x r fp32 tensor per sketched weight
        self.keep_updates = False
        self.last_updates: dict[str, SketchUpdate] = {}
        self.last_stats: dict[str, float] = {}
        sketches.refresh(0)

    # --- megatron optimizer API the trainer and scheduler use -------------------------------
    @property
    def param_groups(self):
        return self.dense.param_groups

    def scale_loss(self, loss):
        return self.dense.scale_loss(loss)

    def zero_grad(self, set_to_none: bool = True):
        self.dense.zero_grad(set_to_none)
        self.sketches.zero()

    def get_loss_scale(self):
        return self.dense.get_loss_scale()

    @torch.no_grad()
    def step(self):
        ok, grad_norm, zeros = self.dense.step()
        if ok:
            self._sketch_step()
        return ok, grad_norm, zeros

    # --- RowAdam ---------------------------------------------------------------------------
    def _lr(self) -> float:
        return float(self.dense.param_groups[0]["lr"])

    def _directions(self) -> list[torch.Tensor]:
        cfg, sk = self.cfg, self.sketches
        rhos = []
        for v, slot in zip(self.row_v, sk.slots):
            row_adam.update_row_moments(v, slot.sketch, cfg.beta2)
            rhos.append(row_adam.row_scale(v, self.steps, cfg.beta2))
        # mean rho per layer over its global rows: column-parallel rows are split over TP
        sums = (torch.stack([r.double().sum() for r in rhos]).cpu() if rhos
                else torch.zeros(0, dtype=torch.float64))
        counts = torch.tensor([float(r.numel()) for r in rhos], dtype=torch.float64)
        split = torch.tensor([s.parallel == "column" for s in sk.slots], dtype=torch.bool)
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if tp > 1 and bool(split.any()):
            both = torch.stack([torch.where(split, sums, 0.0), torch.where(split, counts, 0.0)])
            both = both.to(self._device())
            dist.all_reduce(both, group=parallel_state.get_tensor_model_parallel_group())
            both = both.cpu()
            sums = torch.where(split, both[0], sums)
            counts = torch.where(split, both[1], counts)
        means = (sums / counts.clamp(min=1)).tolist()
        return [row_adam.direction(slot.sketch, rho, mean, cfg.eps)
                for slot, rho, mean in zip(sk.slots, rhos, means)]

    def _device(self) -> torch.device:
        return self.sketches.params[0].device if len(self.sketches) else torch.device("cpu")

    def _model_parallel_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self._device())
        if dist.is_initialized() and parallel_state.get_model_parallel_group() is not None \
                and dist.get_world_size(parallel_state.get_model_parallel_group()) > 1:
            dist.all_reduce(t, group=parallel_state.get_model_parallel_group())
        return t.tolist()

    def _sketch_step(self) -> None:
        cfg, sk = self.cfg, self.sketches
        update = self.steps  # 0-based index of this update
        self.steps += 1
        ds = self._directions()
        sr_mode = cfg.master_weights == "none"
        if sr_mode:  # the payload a receiver gets; the update is computed from exactly this
            ds = [d.to(torch.bfloat16).float() for d in ds]
        # rows whose sketch is zero (an embedding's unseen tokens) get no update: skip them
        active = [_active_rows(d) for d in ds]
        # a tied embedding's last-stage copy is the same matrix: count it once
        weight_sq = sum(float(torch.linalg.vector_norm(p, dtype=torch.float32)) ** 2
                        for p, s in zip(sk.params, sk.slots) if not s.duplicate)
        update_sq = sum(float(row_adam.update_sq_norm(d if rows is None else d[rows],
                                                      s.projection))
                        for d, s, rows in zip(ds, sk.slots, active) if not s.duplicate)
        weight_sq, update_sq = self._model_parallel_sum([weight_sq, update_sq])
        if cfg.update_ratio is not None:
            c = row_adam.norm_ratio_factor(cfg.update_ratio, weight_sq, update_sq)
        else:
            c = self._lr()
        stats = {"update": update, "c": c, "weight_norm": weight_sq ** 0.5,
                 "update_norm": update_sq ** 0.5}
        alpha = 1.0 if self.step_scale_fn is None else float(self.step_scale_fn(stats))
        stats["alpha"] = alpha
        coefficient = alpha * c
        self.last_updates = {}
        for i, (param, slot, d) in enumerate(zip(sk.params, sk.slots, ds)):
            seed = sk.seed_of(slot, update)
            self._apply(i, param, slot, d, coefficient, seed, active[i])
            if self.keep_updates:
                self.last_updates[slot.name] = SketchUpdate(d, coefficient, seed)
        self.last_stats = stats
        sk.zero()
        sk.refresh(update + 1)

    def _apply(self, i: int, param, slot, d, coefficient: float, seed: int,
               rows: torch.Tensor | None) -> None:
        """W -= coefficient D A on all rows, or (``rows``) on those rows only (row-wise
        independent, so the result is the same: D is zero elsewhere)."""
        cfg = self.cfg
        master = self.masters[i]
        target = master if master is not None else param.data
        block = target if rows is None else target[rows]
        if rows is not None:
            d = d[rows]
        if master is None and param.dtype == torch.bfloat16 and cfg.master_weights == "none":
            global_rows = slot.global_rows if rows is None else slot.global_rows[rows.cpu()]
            apply_bf16_update(block, d, coefficient, seed, rank=self.sketches.cfg.rank,
                              kind=self.sketches.cfg.projection, global_rows=global_rows,
                              col_offset=slot.col_offset, projection=slot.projection,
                              chunk_rows=cfg.chunk_rows)
        else:  # an fp32 master, or fp32 params
            row_adam.apply_low_rank_update(block, d, slot.projection, coefficient,
                                           chunk_rows=cfg.chunk_rows, exact=False)
        if rows is not None:
            target[rows] = block
        if master is not None:
            if rows is None:
                param.copy_(master)
            else:
                param[rows] = master[rows].to(param.dtype)

    # --- state ------------------------------------------------------------------------------
    def reload_masters(self) -> None:
        """Re-copy the fp32 masters from the weights (after weights were loaded underneath)."""
        for param, master in zip(self.sketches.params, self.masters):
            if master is not None:
                master.copy_(param.detach().float())

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, **kwargs):
        """megatron's dense state + RowAdam's row states and masters as sharded tensors in the
        canonical (TP=1) layout, so they reshard across TP/PP/DP like the weights."""
        from megatron_logra.logra.state_sharding import logra_sharded_state

        return {"dense": self.dense.sharded_state_dict(model_sharded_state_dict,
                                                       is_loading=is_loading, **kwargs),
                "logra": logra_sharded_state(self)}

    def load_state_dict(self, state: dict) -> None:
        from megatron_logra.logra.state_sharding import load_logra_state

        self.dense.load_state_dict(state["dense"])
        load_logra_state(self, state["logra"])
        self.sketches.zero()
        self.sketches.refresh(self.steps)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for the sketched weights (for the memory accounting)."""
        return {"sketches": self.sketches.sketch_bytes(),
                "row_states": sum(v.numel() * 4 for v in self.row_v),
                "masters": sum(m.numel() * 4 for m in self.masters if m is not None),
                "projections": sum(s.projection.numel() * s.projection.element_size()
                                   for s in self.sketches.slots if s.projection is not None)}
