"""Per-rank memory of the traced update, by category: torch's ``MemTracker`` with the
categories this package reports.

``MemTracker`` (``torch.distributed._tools.mem_tracker``) files every storage an op
creates under a category (parameters, gradients, optimizer state inside a torch
optimizer's step, activations, temporaries), keeps the current bytes per device and
category, and a snapshot at the peak; CUDA storages count in 512-byte blocks, as CUDA's
caching allocator rounds them. ``UpdateMemory`` adds the categories torch does not know
(LoGRA's state: sketches, row moments, projections, row indices; the weight push's
message buffers), files what the build made before tracking starts (``register``:
``held(objs)``, then anything else alive on the device as other), and files what is
created inside ``labelled(category)`` under that category (the push's messages). It is
driven by the dry run's one dispatch mode (``checks.TraceChecks`` hands it each op's
outputs), without MemTracker's module tracking (see ``UpdateMemory.__enter__``), and
notes the call stack where the peak was reached (``peak_sites``).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _RefType
from torch.utils._pytree import tree_leaves

from megatron_logra.dry_run.call_sites import call_stack
from megatron_logra.memory.held_state import optimizer_tensors


class Category(_RefType):
    """MemTracker's categories (same names and values: its code files under them) and ours."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    LOGRA = "LoGRA state"
    PUSH = "Weight push"


SITE_STEP = 64 * 2**20  # the peak's site is taken again when it has grown this much
REPORTED = {  # report key -> the categories it sums
    "params": (Category.PARAM, Category.BUFFER), "grads": (Category.GRAD,),
    "optimizer": (Category.OPT,), "logra": (Category.LOGRA,), "activations": (Category.ACT,),
    "temporaries": (Category.TEMP,), "weight_push": (Category.PUSH,), "other": (Category.OTH,)}


def held(objs) -> dict[Category, list[torch.Tensor]]:
    """The tensors the built objects hold (``training.build.TrainingObjects``), by category:
    model params (and DDP's param buffers), DDP's grad buffers, megatron's fp32 mains and
    Adam moments plus LoGRA's fp32 masters (optimizer state), LoGRA's sketches, row
    moments, projections and row indices."""
    model = objs.model[0]
    out = {Category.PARAM: list(model.parameters()) + [b.param_data for b in model.buffers
                                                       if b.param_data is not None],
           Category.GRAD: [b.grad_data for b in model.buffers],
           Category.OPT: list(optimizer_tensors(objs.dense_optimizer)),
           Category.LOGRA: []}
    logra = objs.logra
    if logra is not None:
        out[Category.OPT] += [m for m in logra.masters if m is not None]
        out[Category.LOGRA] += list(logra.sketches.buffers.values()) + logra.row_v
        out[Category.LOGRA] += [t for slot, owned in zip(logra.sketches.slots,
                                                         logra.owned_modules)
                                for t in (slot.projection, slot.global_rows, slot.module_rows,
                                          owned) if t is not None]
    return out


class UpdateMemory(MemTracker):
    """``MemTracker`` with ``Category``; see the module doc."""

    def __init__(self) -> None:
        super().__init__()
        self._ref_class = Category
        self._label: Category | None = None
        self._peak_mem, self._peak_mem_snap = {}, {}
        self._site_at: dict = {}
        self.peak_sites: dict[str, list[str]] = {}

    def register(self, objs) -> None:
        """File what exists before tracking starts: ``held(objs)`` (each storage under the
        first category that holds it: params first, so fp32 params that are their own
        optimizer's mains stay params), then every other live tensor on a device as other
        (CPU tensors are the host's, not the GPU's)."""
        for category, tensors in held(objs).items():
            for t in tensors:
                self._file(t, category)
        for t in _live_tensors():
            if t.device.type != "cpu":
                self._file(t, Category.OTH)

    def _file(self, t: torch.Tensor | None, category: Category) -> None:
        """``t``'s storage under ``category`` unless it is filed already."""
        if t is not None and t.numel() and t.untyped_storage() not in self._WINFO:
            self._update_and_maybe_create_winfos(t, category)

    @contextlib.contextmanager
    def labelled(self, category: Category) -> Iterator[None]:
        """What ops create while inside is filed under ``category`` (a torch optimizer's
        state stays optimizer state)."""
        previous, self._label = self._label, category
        try:
            yield
        finally:
            self._label = previous

    # Driven, not a dispatch mode of its own: the dry run's one mode
    # (``checks.TraceChecks``) hands it every op's outputs (``track_outputs``), one Python
    # layer less per op. MemTracker's module tracking is left out: its module-wise
    # snapshots deep-copy the whole snapshot at every module call, refuse a root module
    # called twice (a second microbatch) and hook every param, frozen ones included; what
    # it decides with it, forward or backward, comes from autograd itself (``_reftype``).
    def __enter__(self) -> UpdateMemory:
        if self._depth == 0:
            self._register_global_optimizer_hook()
            self._track_resize()
            self.reset_peak()
        self._depth += 1
        return self

    def __exit__(self, *args) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._deregister_param_and_optimizer_hooks()
            self._restore_resize()

    @property
    def tracking(self) -> bool:
        return self._depth > 0

    def _reftype(self) -> Category:
        """Optimizer state inside a torch optimizer's step; in autograd's backward,
        temporaries, except what a forward recomputed there with grad enabled creates
        (activation recompute: activations); else activations; or the label."""
        if self._in_opt:
            return Category.OPT
        if torch._C._current_graph_task_id() != -1 and not torch.is_grad_enabled():
            kind = Category.TEMP
        else:
            kind = Category.ACT
        return self._label or kind

    def track_outputs(self, outputs) -> None:
        """File the storages an op returned (new ones only) under the current category."""
        reftype = self._reftype()
        for t in tree_leaves(outputs):
            if isinstance(t, torch.Tensor):
                self._track(reftype, t)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        """MemTracker's, and the peak moves here, when bytes are added (not after every
        op, as MemTracker's dispatch checks it); the code that allocated at the peak is
        noted (``peak_site``) when the peak grows by a block of ``SITE_STEP`` bytes."""
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        snap = self._curr_mem_snap.get(winfo.device)
        if snap is not None and snap[_TOTAL_KEY] > self._peak_mem.get(winfo.device, 0):
            self._peak_mem[winfo.device] = snap[_TOTAL_KEY]
            self._peak_mem_snap[winfo.device] = dict(snap)
            if snap[_TOTAL_KEY] >= self._site_at.get(winfo.device, 0) + SITE_STEP:
                self._site_at[winfo.device] = snap[_TOTAL_KEY]
                self.peak_sites[winfo.device.type] = call_stack()

    def reset_peak(self) -> None:
        """Start a new peak from the current bytes."""
        self._peak_mem_snap = self.get_tracker_snapshot("current")
        self._peak_mem = {dev: snap[_TOTAL_KEY] for dev, snap in self._peak_mem_snap.items()}
        self._site_at = dict(self._peak_mem)
        self.peak_sites: dict[str, list[str]] = {}  # device type -> the peak's call stack

    def snapshot(self, kind: str, device: str = "cuda") -> dict[str, int]:
        """{report key: bytes, "total"} of the ``kind`` ("current" | "peak") snapshot on the
        device type ``device``."""
        snaps = [s for dev, s in self.get_tracker_snapshot(kind).items() if dev.type == device]
        snap = snaps[0] if snaps else {}
        out = {key: int(sum(snap.get(c, 0) for c in cats)) for key, cats in REPORTED.items()}
        out["total"] = int(snap.get(_TOTAL_KEY, 0))
        return out


def _live_tensors() -> list[torch.Tensor]:
    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
