"""Shared by memory.py and step_time.py: one optimizer variant, measured in a fresh process.

    python benchmarks/_train_probe.py JSON_SPEC     (prints one JSON line)

The spec names a model shape (random init; only its config is needed), a variant
(dense Adam with megatron's distributed optimizer, or LoGRA in a precision mode),
the device and the batch. The child counts model-state bytes by enumerating every
tensor the model, DDP and the optimizers hold (storages counted once), then runs
train steps on random tokens and reports step times and peak memory: CUDA max
allocated over the steps; on CPU the same quantity counted by hand, the bytes of
Python-held tensors before the last step plus the peak of the live tensor storage
allocated inside it (``runtime.live_bytes``; that step runs untimed, then a timed
one). The CPU peak RSS over imports is reported beside it (allocator caching and
freed-but-resident heap included, so it is no check of an analytic model).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SHAPES = {  # HF config fields of the benchmark shapes (random-init)
    "tiny": dict(family="llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                 intermediate_size=384, vocab_size=384),
    "smollm2-135m": dict(family="llama", hidden_size=576, num_layers=30, num_heads=9,
                         num_kv_heads=3, intermediate_size=1536, vocab_size=49152),
    "qwen2.5-1.5b": dict(family="qwen2", hidden_size=1536, num_layers=28, num_heads=12,
                         num_kv_heads=2, intermediate_size=8960, vocab_size=151936),
}
VARIANTS = {  # name -> (optimizer, master weights)
    "dense_adam": ("adam", None),
    "logra_fp32_master": ("logra", "fp32"),
    "logra_none": ("logra", "none"),
}


def shape_dir(shape: str) -> str:
    from megatron_logra.model.tiny_assets import tiny_hf_config

    kw = dict(SHAPES[shape])
    family = kw.pop("family")
    out = Path(tempfile.mkdtemp(prefix=f"shape-{shape}-"))
    (out / "config.json").write_text(json.dumps(tiny_hf_config(family, **kw)))
    return str(out)


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        if t is not None and hasattr(t, "untyped_storage") and t.numel():
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def _optimizer_tensors(megatron_opt):
    """Every tensor a megatron optimizer holds: inner torch state and its fp32 main params."""
    opts = getattr(megatron_opt, "chained_optimizers", None) or [megatron_opt]
    for opt in opts:
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            for state in inner.state.values():
                yield from (v for v in state.values() if hasattr(v, "untyped_storage"))
            for group in inner.param_groups:
                yield from group["params"]  # fp32 main shards (or the params themselves)
        for attr in ("shard_fp32_from_float16_groups", "fp32_from_float16_groups"):
            for group in getattr(opt, attr, None) or []:
                yield from group


def model_state_bytes(objs) -> dict[str, int]:
    """Bytes by category, each storage counted once (params first, so views are not doubled)."""
    model = objs.model[0]
    params = _storages(list(model.parameters())
                       + [b.param_data for b in model.buffers if b.param_data is not None])
    grads = {k: v for k, v in _storages([b.grad_data for b in model.buffers]).items()
             if k not in params}
    dense_opt = getattr(objs.optimizer, "dense", objs.optimizer)
    opt = {k: v for k, v in _storages(list(_optimizer_tensors(dense_opt))).items()
           if k not in params and k not in grads}
    out = {"params": sum(params.values()), "grads": sum(grads.values()),
           "dense_optimizer": sum(opt.values())}
    logra = getattr(objs.optimizer, "state_bytes", None)
    out.update({f"logra_{k}": v for k, v in (logra() if logra else {}).items()})
    out["total"] = sum(out.values())
    return out


def run(spec: dict) -> dict:
    import torch

    if spec["device"] == "cpu":
        os.environ["MEGATRON_LOGRA_DEVICE"] = "cpu"
    from megatron_logra.config import LograConfig, OptimizerConfig
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.logits import causal_inputs
    from megatron_logra.model.provider import ModelBuildConfig
    from megatron_logra.runtime.device import init_runtime, peak_memory_bytes, synchronize
    from megatron_logra.runtime.live_bytes import LiveTensorBytes
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.training.setup import build_training_objects
    from megatron_logra.training.step import train_step

    rt = init_runtime()
    initialize(ParallelConfig(), 1, seed=0)
    imports_rss = _current_rss()  # CPU: peak memory is counted over the interpreter + imports
    arch = load_arch(shape_dir(spec["shape"]))
    name, master = VARIANTS[spec["variant"]]
    opt = OptimizerConfig(name=name, lr=1e-5, use_distributed_optimizer=True,
                          logra=LograConfig(rank=spec["rank"], master_weights=master or "fp32",
                                            update_ratio=6e-5,
                                            targets=tuple(spec["targets"].split(",")),
                                            untargeted=spec.get("untargeted", "frozen")))
    build = ModelBuildConfig(bf16=True, recompute_activations=spec.get("recompute", False))
    objs = build_training_objects(arch, build, opt, seed=0, train_iters=spec["steps"] + 1)
    if rt.device.type == "cpu":  # count the steps' peak, not the build's transient copies
        import gc

        gc.collect()
        _release_freed_heap()
        _reset_peak_rss()
    elif rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(0)
    mbs, seq = spec["micro_batch_size"], spec["seq_length"]
    times = []
    live = LiveTensorBytes() if rt.device.type == "cpu" else None
    for step in range(spec["steps"]):
        last = step == spec["steps"] - 1
        batch = []
        for _ in range(spec["microbatches"]):
            tokens = torch.randint(0, arch.vocab_size, (mbs, seq), generator=g)
            mb = causal_inputs(tokens)
            mb.update(labels=torch.roll(tokens, -1, 1), loss_mask=torch.ones(mbs, seq))
            batch.append(mb)
        synchronize()
        if last and live is not None:  # CPU: live tensor bytes of the last step (timed apart)
            held_before = sum(_storages(_python_held_tensors()).values())
            with live:
                train_step(objs, batch, seq_length=seq, micro_batch_size=mbs)
        t0 = time.perf_counter()
        train_step(objs, batch, seq_length=seq, micro_batch_size=mbs)
        synchronize()
        times.append(time.perf_counter() - t0)
    if live is None:
        peak = peak_memory_bytes()
    else:
        peak = held_before + live.peak_bytes
    state = model_state_bytes(objs)  # after the steps: Adam creates its state lazily
    n_params = sum(p.numel() for p in objs.model[0].parameters())
    return {"variant": spec["variant"], "device": str(rt.device), "params": n_params,
            "model_state_bytes": state,
            "peak_mem_bytes": peak,  # CUDA max allocated; CPU live tensor bytes (see above)
            "peak_rss_bytes": _rss() - imports_rss if live is not None else None,
            "step_times_s": [round(t, 4) for t in times],
            "step_time_s": min(times[1:] if len(times) > 1 else times)}


def _python_held_tensors():
    import gc

    import torch

    return [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]


def _rss() -> int:
    """Peak RSS of this process (VmHWM; resettable, see ``_reset_peak_rss``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _release_freed_heap() -> None:
    """glibc keeps freed heap resident; hand it back so RSS counts live memory only."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def measure(spec: dict) -> dict:
    """Run one spec in a fresh subprocess (its own peak) and return its report."""
    import subprocess

    proc = subprocess.run([sys.executable, __file__, json.dumps(spec)], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{spec} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    print(json.dumps(run(json.loads(sys.argv[1]))))
