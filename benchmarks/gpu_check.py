"""One GPU, one script: LoGRA's math is device-independent, the trainer resumes exactly and
controls the KL at world size 1, and dense Adam, LoGRA and LoRA side by side at 1.5B.

Here, once (needs the package index): megatron-core and the packages the GPU machine
lacks (``requirements/gpu-check.txt``) as wheels into ``.whl/``:

    make gpu-wheels

On the GPU machine (one H100 or H200; its own python3 with torch and
``MACHINE_PACKAGES``, no vLLM, no internet; ``.whl/`` carried along; estimated at 3-8
minutes, not yet measured on a GPU):

    make gpu-check GPU_CHECK_OUT=runs/gpu-check

On CPU, tiny shapes everywhere (under a minute on two busy cores; the test
``tests/unit/test_gpu_check.py`` runs it):

    MEGATRON_LOGRA_DEVICE=cpu .venv/bin/python benchmarks/gpu_check.py --cpu --out DIR

Parts, each a progress line and a JSON file in ``--out``:

1. ``device_independence.json``: LoGRA's projection blocks (Rademacher and Gaussian),
   its stochastic-rounding noise and bf16 rounding, and the exact low-rank update
   W <- SR(W - c D A) computed on the CPU and on the GPU: bit-identical, NaNs and
   infinities included (the bf16 bits come from an integer shift, never from torch's
   float cast, whose NaN differs by device), Gaussian projections within one float32 ulp
   (documented: libm's log/cos; the ulp distance is reported, and more than one fails).
2. ``trainer.json``: torch.distributed in one process (NCCL on CUDA, gloo on CPU), the
   embedded tiny Llama with bf16 params. Dense Adam (megatron's distributed optimizer;
   Transformer Engine's layers when they import), LoGRA with fp32 masters, LoGRA
   bf16-only and LoRA each train a few steps on fixed random tokens, save a checkpoint,
   train on; fresh objects load the checkpoint and train the same steps again: losses
   and final weights must be bit-identical (on CUDA with deterministic algorithms, as
   any exact resume needs).
   Then dense Adam and LoGRA take one update through predicted-KL control (megatron's
   local layers: Transformer Engine's have no forward-mode jvp), with fp32 params at a
   budget where the second-order prediction holds and with bf16 params at one where
   rounding to whole ulps is not most of the step (``KL_BUDGETS``): K > 0 and the
   realized KL within 10% of the predicted alpha^2 K. On CUDA with cuBLAS's
   reduced-precision reductions in bf16 GEMMs off (fp32 accumulation, as on the CPU
   where ``KL_BUDGETS``' errors were measured) and TF32 off (torch's default).
3. ``memory_time.json``: at the Qwen2.5-1.5B shape (random init, 4096 tokens,
   microbatch 1, full recompute, LoGRA r=256 as the paper), dense Adam, LoGRA (fp32
   masters) and LoRA each in a fresh process (``_train_probe.Probe``), stepped in turn
   so noise hits all alike (``step_time.py``'s interleaving): step time (median after a
   warm-up round), peak allocated memory and model-state bytes; LoGRA's and LoRA's
   model state must be below dense Adam's. Each measured peak is compared with the dry
   run's of the same step (``benchmarks/dry_run.py``'s ``gpu_check`` part, read from
   ``results/dry_run.json`` when it holds this spec): within 10%.

The last stdout line is a summary JSON; the exit status is 1 when any check failed,
with what failed on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from _train_probe import REPO, VARIANTS, Probe, Server
from step_time import _median_phases

SEED = 1234
PARTS = ("device", "trainer", "memory")
# What the GPU machine's own python3 must have: `make gpu-check` adds only .whl/'s wheels
# (megatron-core). Found by running --cpu, all three parts, with every other non-stdlib
# package made unimportable: megatron-core imports tqdm, psutil (its checkpoint writer)
# and torch.utils.cpp_extension (setuptools).
MACHINE_PACKAGES = ("torch", "numpy", "packaging", "setuptools", "tqdm", "psutil")
KL_TOLERANCE = 0.1  # |realized - predicted| <= 10% of predicted


@dataclass(frozen=True)
class Scale:
    """The sizes each part runs at: one set for the GPU, one for ``--cpu``."""

    # part 1: blocks of a weight [rows, cols] at global offsets, sketch rank r
    rows: int
    cols: int
    rank: int
    # part 2 (the embedded tiny Llama): steps before and after the save
    steps_before_save: int
    steps_after_save: int
    # part 3: _train_probe's shape, tokens per sequence, LoGRA rank, rounds (the first
    # a warm-up; a peak step follows them)
    probe_shape: str
    probe_seq: int
    probe_rank: int
    probe_microbatches: int
    probe_rounds: int


GPU = Scale(rows=1536, cols=4133, rank=256, steps_before_save=3, steps_after_save=3,
            probe_shape="qwen2.5-1.5b", probe_seq=4096, probe_rank=256, probe_microbatches=1,
            probe_rounds=5)
CPU = Scale(rows=300, cols=1000, rank=64, steps_before_save=2, steps_after_save=2,
            probe_shape="tiny", probe_seq=64, probe_rank=16, probe_microbatches=1,
            probe_rounds=2)


@dataclass(frozen=True)
class TrainerSetup:
    """Part 2 on both devices: the embedded tiny Llama, batches of ``microbatches`` x
    [micro_batch, seq] random tokens, LoGRA rank ``logra_rank`` at norm ratio 1e-2."""

    seq: int = 32
    micro_batch: int = 2
    microbatches: int = 2
    logra_rank: int = 16


TRAINER = TrainerSetup()
# Predicted-KL budgets, measured on CPU over 16 seeds (the realized KL's error against
# alpha^2 K, dense Adam and LoGRA): fp32 params at 1e-5, |error| <= 1.1% (at 1e-3 up to
# 10%: third order). bf16 params move by whole ulps: at 3e-4 (a step of about one ulp)
# |error| <= 6%, standard deviation ~3%, rounding noise; smaller budgets are noisier
# (1e-5: 19%), larger ones third-order (3e-3: 14%).
KL_BUDGETS = {"fp32": 1e-5, "bf16": 3e-4}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true",
                   help="tiny shapes on the CPU, the second device also the CPU (the tests)")
    p.add_argument("--out", help="folder for the parts' JSON files (required)")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma list of {list(PARTS)} (default: all)")
    p.add_argument("--probe", metavar="SPEC", help=argparse.SUPPRESS)  # part 3's children
    args = p.parse_args(argv)
    if not args.out and not args.probe:
        p.error("--out is required")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        p.error(f"--parts: unknown {sorted(unknown)}; choose from {list(PARTS)}")
    return args


def progress(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def write_json(out: Path, name: str, report: dict) -> None:
    (out / name).write_text(json.dumps(report, indent=1) + "\n")


# --- 1. device independence ------------------------------------------------------------
def ulp_distance(a, b) -> int:
    """The largest distance in float32 ulps between two fp32 tensors of one shape."""
    import torch

    def ordered(x):  # float32 bits -> integers in the floats' order
        bits = x.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)

    return int((ordered(a) - ordered(b)).abs().max()) if a.numel() else 0


def device_cases(scale: Scale) -> dict:
    """name -> fn(device) -> tensor: LoGRA's device-independent computations, on inputs
    drawn once on the CPU. A block sits at odd global offsets (row 700, column 37), so the
    counters of a slice are tested, not only those of a whole weight."""
    import torch

    from megatron_logra.logra.low_rank_apply import apply_bf16_update
    from megatron_logra.logra.projection import projection_block
    from megatron_logra.logra.rounding import rounding_noise, stochastic_round_bf16

    g = torch.Generator().manual_seed(SEED)
    rows, cols, rank, seed, col0 = scale.rows, scale.cols, scale.rank, 987654321, 37
    global_rows = torch.arange(700, 700 + rows)
    values = torch.randn(rows, cols, generator=g) * 0.02  # fp32 [rows, cols]
    special = values.clone()
    special[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3e38])
    weight = (torch.randn(rows, cols, generator=g) * 0.02).bfloat16()  # W bf16 [rows, cols]
    broken = weight.clone()  # W with an infinity and NaNs of both signs in its first row
    broken[0, :3] = torch.tensor([float("inf"), float("nan"), -float("nan")])
    d = (torch.randn(rows, rank, generator=g) * 1e-3).bfloat16()  # D bf16 [rows, r]

    def projection(kind):
        return lambda dev: projection_block(seed, rank, (col0, col0 + cols), kind=kind,
                                            device=dev)

    def rounded(x):
        return lambda dev: stochastic_round_bf16(x.to(dev), seed, global_rows.to(dev), col0)

    def applied(coefficient, w0=weight):
        def run(dev):
            w = w0.to(dev).clone()
            apply_bf16_update(w, d.to(dev), coefficient, seed, rank=rank, kind="rademacher",
                              global_rows=global_rows.to(dev), col_offset=col0)
            return w
        return run

    return {
        "projection_rademacher": projection("rademacher"),  # [r, cols] fp32
        "projection_gaussian": projection("gaussian"),  # [r, cols] fp32
        "rounding_noise": lambda dev: rounding_noise(  # [rows, cols] int32
            seed, global_rows.to(dev), torch.arange(col0, col0 + cols, device=dev)),
        "stochastic_round_bf16": rounded(values),  # [rows, cols] bf16
        "stochastic_round_bf16_nonfinite": rounded(special),
        "apply_bf16_update": applied(1.0),  # [rows, cols] bf16, c folded into D
        "apply_bf16_update_scaled": applied(0.37),
        "apply_bf16_update_nonfinite": applied(1.0, broken),  # NaN bits: CANONICAL_NAN
    }


def bits(t):
    """A float tensor's bit patterns as integers of its width (NaNs compare equal when
    their bits do, which torch.equal on the floats would not say); others unchanged."""
    import torch

    width = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16}
    return t.view(width[t.dtype]) if t.dtype in width else t


def device_independence(device: str, scale: Scale) -> dict:
    """Each case on the CPU and on ``device``; equal bits after moving to the CPU."""
    import torch

    results = {}
    for name, fn in device_cases(scale).items():
        on_cpu, on_device = fn("cpu"), fn(device)
        if device == "cuda":
            torch.cuda.synchronize()
        on_device = on_device.cpu()
        same = bool(torch.equal(bits(on_cpu), bits(on_device)))
        result = {"shape": list(on_cpu.shape), "dtype": str(on_cpu.dtype).removeprefix("torch."),
                  "bit_identical": same, "ok": same}
        if name == "projection_gaussian":  # documented: within one float32 ulp
            result["max_ulp"] = ulp_distance(on_cpu, on_device)
            result["elements_differing"] = int((on_cpu != on_device).sum())
            result["ok"] = result["max_ulp"] <= 1
        results[name] = result
    progress("1/3 " + ", ".join(
        f"{n} {'identical' if c['bit_identical'] else 'DIFFERS'}"
        + (f" (max {c['max_ulp']} ulp)" if "max_ulp" in c else "") for n, c in results.items()))
    return {"devices": ["cpu", device], "cases": results,
            "ok": all(r["ok"] for r in results.values())}


# --- 2. the trainer at world size 1 ---------------------------------------------------
def token_batch(arch, step: int, mask_fraction: float = 0.0) -> list[dict]:
    """Step ``step``'s fixed random batch (``testing.batches.random_microbatches``):
    microbatches of tokens [b, s], their causal inputs, next-token labels [b, s] and a
    loss mask [b, s] (``mask_fraction`` masked; the mask is drawn even at 0, so every
    step's tokens stay the same whatever the fraction)."""
    from megatron_logra.testing.batches import random_microbatches

    return random_microbatches(arch.vocab_size, count=TRAINER.microbatches,
                               batch=TRAINER.micro_batch, seq=TRAINER.seq,
                               seed=SEED * 1000 + step, mask_fraction=mask_fraction)


def trainer_optimizer(variant: str, **overrides):
    """``_train_probe.VARIANTS``' settings at step sizes that move a tiny model: lr 1e-3
    with a warm-up step and a cosine decay (a lost schedule would show), LoGRA's norm
    ratio 1e-2, LoRA rank 8."""
    from megatron_logra.config import LograConfig, LoraConfig, OptimizerConfig

    name, master, peft = VARIANTS[variant]
    settings = dict(name=name, lr=1e-3, lr_warmup_iters=1, use_distributed_optimizer=True,
                    peft=peft, lora=LoraConfig(rank=8),
                    logra=LograConfig(rank=TRAINER.logra_rank, update_ratio=1e-2,
                                      master_weights=master or "fp32"))
    return OptimizerConfig(**(settings | overrides))


def build(arch, opt, train_iters: int, *, transformer_engine: bool, bf16: bool = True):
    """Fresh model, optimizer and scheduler from ``SEED``."""
    from megatron_logra.model.provider import ModelBuildConfig
    from megatron_logra.training.build import build_training_objects

    return build_training_objects(arch, ModelBuildConfig(
        bf16=bf16, use_transformer_engine=transformer_engine), opt, seed=SEED,
        train_iters=train_iters)


def weights(objs) -> dict:
    """Every parameter of the model, copied to the CPU, by name."""
    from megatron_logra.model.provider import unwrap

    return {n: p.detach().cpu().clone() for n, p in unwrap(objs.model[0]).named_parameters()}


def train(objs, batches: list) -> list[dict]:
    """One train step per batch: [{"loss", "lr", "grad_norm", "ok"}]."""
    from megatron_logra.training.step import train_step

    out = []
    for batch in batches:
        r = train_step(objs, batch, seq_length=TRAINER.seq, micro_batch_size=TRAINER.micro_batch)
        out.append({"loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                    "ok": r.update_successful})
    return out


def resume_check(arch, variant: str, steps: tuple[int, int], ckpt: Path, te: bool) -> dict:
    """Train ``steps[0]`` steps, save, train ``steps[1]`` more; fresh objects load the save
    (as ``training.prepare`` resumes: optimizer state, then the scheduler, a registered
    resumable part) and train the same ``steps[1]`` steps again."""
    from megatron_logra.checkpoint.load import load_checkpoint
    from megatron_logra.checkpoint.meta import CheckpointMeta, optimizer_sharding
    from megatron_logra.checkpoint.save import save_checkpoint
    from megatron_logra.checkpoint.state import ResumableState

    n1, n2 = steps
    batches = [token_batch(arch, step) for step in range(n1 + n2)]
    opt = trainer_optimizer(variant)
    decay = 2 * (n1 + n2)  # the cosine schedule's length: the lr changes every step, never 0
    objs = build(arch, opt, decay, transformer_engine=te)
    initial = weights(objs)
    before = train(objs, batches[:n1])
    state = ResumableState()
    state.register("scheduler", objs.scheduler)
    meta = CheckpointMeta(step=n1, arch=arch.to_dict(), optimizer_sharding=optimizer_sharding(True))
    save_checkpoint(ckpt, objs, state.state_dict(), meta)
    straight = train(objs, batches[n1:])
    final = weights(objs)
    del objs
    fresh = build(arch, opt, decay, transformer_engine=te)
    resumed_state, _ = load_checkpoint(ckpt, fresh, weights_only=False,
                                       sharding=optimizer_sharding(True))
    ResumableState(resumed_state).register("scheduler", fresh.scheduler, required=True)
    resumed = train(fresh, batches[n1:])
    resumed_final = weights(fresh)
    del fresh
    report = {
        "layer_spec": "transformer_engine" if te and variant == "dense_adam" else "local",
        "steps_before_save": before, "steps_uninterrupted": straight, "steps_resumed": resumed,
        "losses_equal": [s["loss"] for s in straight] == [s["loss"] for s in resumed],
        "lrs_equal": [s["lr"] for s in straight] == [s["lr"] for s in resumed],
        "weights_equal": all(final[n].equal(t) for n, t in resumed_final.items()),
        "weights_moved": any(not final[n].equal(t) for n, t in initial.items()),
        "updates_successful": all(s["ok"] for s in before + straight + resumed),
    }
    report["ok"] = all(report[k] for k in ("losses_equal", "lrs_equal", "weights_equal",
                                           "weights_moved", "updates_successful"))
    return report


def kl_check(arch, optimizer: str, precision: str) -> dict:
    """tests/distributed/kl_check.py at world size 1: one plain update, then the next
    through ``PredictedKLStep`` at ``KL_BUDGETS[precision]`` (probe: the first microbatch,
    a quarter of its positions masked; no clipping, LoGRA with fp32 masters)."""
    from megatron_logra.config import KLControlConfig
    from megatron_logra.kl.controller import PredictedKLStep
    from megatron_logra.training.step import forward_backward

    variant = "dense_adam" if optimizer == "adam" else "logra_fp32_master"
    objs = build(arch, trainer_optimizer(variant, clip_grad=0.0, lr_warmup_iters=0), 4,
                 transformer_engine=False, bf16=precision == "bf16")
    batch = token_batch(arch, 100, mask_fraction=0.25)
    kw = dict(seq_length=TRAINER.seq, micro_batch_size=TRAINER.micro_batch,
              vocab_size=arch.vocab_size)
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)
    objs.optimizer.step()
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, **kw)
    budget = KL_BUDGETS[precision]
    kl = PredictedKLStep(KLControlConfig(control="predicted", budget=budget, budget_final=budget),
                         temperature=1.0, vocab_size=arch.vocab_size)
    ok, _, record = kl.step(objs, 0, batch[0], mismatch=None)
    del objs
    k, pred, real = (record.get(key, 0.0) for key in ("kl_quadratic", "kl_pred", "kl_realized"))
    error = (real - pred) / pred if pred > 0 else float("inf")
    return {"params": precision, "layer_spec": "local", "budget": budget, "step_ok": bool(ok),
            "kl_quadratic": k, "alpha": record.get("alpha"), "kl_pred": pred,
            "kl_realized": real, "relative_error": error,
            "ok": bool(ok) and k > 0 and abs(error) <= KL_TOLERANCE}


def trainer_part(device: str, scale: Scale) -> dict:
    """Exact resume for every variant, then predicted-KL control for dense Adam and LoGRA
    with bf16 and with fp32 params."""
    import torch

    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import transformer_engine_available
    from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    rt = init_runtime()
    initialize(ParallelConfig(1, 1), rt.world_size, seed=SEED)
    matmul = torch.backends.cuda.matmul
    reduced_before = matmul.allow_bf16_reduced_precision_reduction
    if device == "cuda":  # bit-exact resume needs run-to-run determinism
        torch.use_deterministic_algorithms(True, warn_only=True)
        # the KL tolerance was measured on the CPU, whose bf16 GEMMs accumulate in fp32:
        # cuBLAS's split-K reductions in bf16 would add an error that measurement never saw
        matmul.allow_bf16_reduced_precision_reduction = False
    arch, te = load_arch(EMBEDDED_DEFAULT), transformer_engine_available()
    steps = (scale.steps_before_save, scale.steps_after_save)
    report = {"device": str(rt.device), "backend": rt.backend, "world_size": rt.world_size,
              "bf16": True, "deterministic_algorithms": device == "cuda",
              "cublas_bf16_reduced_precision_reduction":  # cuBLAS's settings (None on CPU)
                  matmul.allow_bf16_reduced_precision_reduction if device == "cuda" else None,
              "tf32_matmul": matmul.allow_tf32 if device == "cuda" else None,
              "model": "embedded tiny-llama", "setup": asdict(TRAINER), "steps": steps,
              "transformer_engine_available": te, "resume": {}, "kl_control": {}}
    with tempfile.TemporaryDirectory(prefix="gpu_check_ckpt_") as tmp:
        for variant in VARIANTS:
            r = resume_check(arch, variant, steps, Path(tmp) / variant, te)
            report["resume"][variant] = r
            progress(f"2/3 trainer {variant} ({r['layer_spec']}): losses after resume "
                     f"{[s['loss'] for s in r['steps_resumed']]} "
                     f"{'==' if r['losses_equal'] else '!='} uninterrupted "
                     f"{[s['loss'] for s in r['steps_uninterrupted']]}, weights "
                     f"{'equal' if r['weights_equal'] else 'DIFFER'}")
    for precision in KL_BUDGETS:
        for optimizer in ("adam", "logra"):
            r = report["kl_control"][f"{optimizer}_{precision}"] = kl_check(arch, optimizer,
                                                                           precision)
            progress(f"2/3 predicted KL, {optimizer} {precision} params, budget {r['budget']:g}: "
                     f"K {r['kl_quadratic']:.4g}, alpha {r['alpha']:.4g}, predicted "
                     f"{r['kl_pred']:.4g}, realized {r['kl_realized']:.4g} "
                     f"({100 * r['relative_error']:+.2f}%)")
    if device == "cuda":
        torch.use_deterministic_algorithms(False)
        matmul.allow_bf16_reduced_precision_reduction = reduced_before
    report["ok"] = all(r["ok"] for group in ("resume", "kl_control")
                       for r in report[group].values())
    return report


# --- 3. memory and step time ------------------------------------------------------------
MEMORY_VARIANTS = ("dense_adam", "logra_fp32_master", "lora")


def serve_probe(spec: dict) -> None:
    """Child of part 3: build one variant (``Probe``), then answer stdin: "step" -> one
    timed step's JSON; "finish" -> the peak step and the report (``Probe.report``)."""
    probe = Probe(spec)
    print(json.dumps({"ready": True}), flush=True)
    times = []
    for line in sys.stdin:
        if line.strip() == "step":
            result = probe.step()
            times.append(result["seconds"])
            print(json.dumps(result), flush=True)
        elif line.strip() == "finish":
            print(json.dumps(probe.report(times, probe.peak_step())), flush=True)
            return


class ProbeProcess(Server):
    """``_train_probe.Server``'s protocol with this script's ``--probe`` child, started
    without waiting (the variants build side by side); lines that are not JSON (a
    library's chatter) are passed over."""

    def __init__(self, spec: dict, env: dict):
        self.name = spec["variant"]
        self.proc = subprocess.Popen([sys.executable, __file__, "--probe", json.dumps(spec)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {self.name} probe process exited ({self.proc.wait()}); "
                                   f"its stderr is above")
            if line.startswith("{"):
                return json.loads(line)


def probe_env(device: str) -> dict:
    """The children's environment: this device, the cores shared out; on CUDA no
    deterministic cuBLAS workspace (timed like a run) and expandable segments (three
    processes share the GPU's memory)."""
    threads = max(1, (os.cpu_count() or 1) // len(MEMORY_VARIANTS))
    env = dict(os.environ, MEGATRON_LOGRA_DEVICE=device, OMP_NUM_THREADS=str(threads))
    if device == "cuda":
        env.pop("CUBLAS_WORKSPACE_CONFIG", None)
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    return env


def interleave(specs: dict[str, dict], rounds: int, env: dict) -> dict[str, dict]:
    """Every variant in its own process; one step each per round, in turn; then each one's
    peak step and report."""
    procs = {name: ProbeProcess(spec, env) for name, spec in specs.items()}
    try:
        for proc in procs.values():
            proc._read()  # ready
        steps = {name: [] for name in procs}
        for round_ in range(rounds):
            for name, proc in procs.items():
                steps[name].append(proc.ask("step"))
            progress(f"3/3 round {round_ + 1}/{rounds}: " + ", ".join(
                f"{n} {steps[n][-1]['seconds']:.3f}s" for n in procs))
        reports = {name: proc.ask("finish") for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            stop(proc.proc)
    for name, report in reports.items():
        timed = steps[name][1:] or steps[name]
        report["step_times_s"] = [round(s["seconds"], 4) for s in steps[name]]
        report["step_time_s"] = round(statistics.median(s["seconds"] for s in timed), 4)
        report["phases_s"] = _median_phases(timed)
    return reports


def stop(proc: subprocess.Popen) -> None:
    """End a probe child: EOF on its stdin; killed if it has not exited a minute later."""
    try:
        proc.stdin.close()
    except OSError:  # it died already
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def memory_part(device: str, scale: Scale) -> dict:
    """Dense Adam, LoGRA (fp32 masters) and LoRA at ``scale.probe_shape``, side by side."""
    from megatron_logra.memory.shapes import SHAPES
    from megatron_logra.runtime.device import release_cached_memory

    release_cached_memory()  # what part 2 left cached goes back to the GPU
    base = {"shape": scale.probe_shape, "device": device, "seq_length": scale.probe_seq,
            "micro_batch_size": 1, "microbatches": scale.probe_microbatches,
            "steps": scale.probe_rounds, "recompute": True, "targets": "qkv,proj,fc1,fc2",
            "untargeted": "frozen", "rank": scale.probe_rank, "transformer_engine": False}
    specs = {name: dict(base, variant=name) for name in MEMORY_VARIANTS}
    runs = interleave(specs, scale.probe_rounds, probe_env(device))
    dense = runs["dense_adam"]
    figures = {}
    for name, run in runs.items():
        figures[name] = {
            "peak_mem_bytes": run["peak_mem_bytes"],
            "model_state_bytes": run["model_state_bytes"]["total"],
            "model_state_by_category": run["model_state_bytes"],
            "step_time_s": run["step_time_s"], "step_times_s": run["step_times_s"],
            "phases_s": run["phases_s"], "params": run["params"],
            "peak_vs_dense_adam": round(run["peak_mem_bytes"] / dense["peak_mem_bytes"], 4),
            "model_state_vs_dense_adam": round(run["model_state_bytes"]["total"]
                                               / dense["model_state_bytes"]["total"], 4),
            "step_time_vs_dense_adam": round(run["step_time_s"] / dense["step_time_s"], 4)}
    dry_run = dry_run_comparison(figures, scale)
    positive = all(f[k] > 0 for f in figures.values()
                   for k in ("peak_mem_bytes", "model_state_bytes", "step_time_s"))
    leaner = all(figures[n]["model_state_bytes"] < figures["dense_adam"]["model_state_bytes"]
                 for n in ("logra_fp32_master", "lora"))
    progress("3/3 " + "; ".join(
        f"{n}: peak {f['peak_mem_bytes'] / 2**20:.1f} MiB, model state "
        f"{f['model_state_bytes'] / 2**20:.1f} MiB, {f['step_time_s']:.3f} s/step"
        for n, f in figures.items()))
    return {"setup": {k: v for k, v in base.items() if k not in ("device", "steps")},
            "shape_config": SHAPES[scale.probe_shape], "layer_spec": "local",
            "device": device, "rounds": scale.probe_rounds, "peak": "CUDA max allocated"
            if device == "cuda" else "live tensor bytes (_train_probe.Probe.peak_step)",
            "variants": figures, "all_positive": positive, "leaner_than_dense_adam": leaner,
            "dry_run": dry_run, "ok": positive and leaner}


DRY_RUN_REPORT = Path(__file__).resolve().parent / "results" / "dry_run.json"
DRY_RUN_TOLERANCE = 0.10


def dry_run_comparison(figures: dict, scale: Scale, report_path: Path = DRY_RUN_REPORT) -> dict:
    """Each variant's measured peak against the dry run's of the same step (the dry run
    traces it on CPU beforehand: ``benchmarks/dry_run.py --parts gpu_check``); "ok"
    within ``DRY_RUN_TOLERANCE``. Without a dry run of this spec: a note, no check."""
    spec = {"shape": scale.probe_shape, "seq_length": scale.probe_seq, "micro_batch_size": 1,
            "microbatches": scale.probe_microbatches, "recompute": True,
            "rank": scale.probe_rank}
    part = json.loads(report_path.read_text()).get("gpu_check") \
        if report_path.is_file() else None
    if not part or part.get("spec") != spec:
        return {"note": f"no dry run of {spec} in {report_path.name}"}
    out = {}
    for name, figure in figures.items():
        traced = part["variants"].get(name)
        if traced is None:
            continue
        ratio = traced["peak_mem_bytes"] / figure["peak_mem_bytes"]
        out[name] = {"dry_run_peak_bytes": traced["peak_mem_bytes"],
                     "measured_peak_bytes": figure["peak_mem_bytes"],
                     "dry_run_over_measured": round(ratio, 4),
                     "ok": abs(ratio - 1) <= DRY_RUN_TOLERANCE}
    return out


# --- driver -----------------------------------------------------------------------------
def failed_checks(report: dict, path: str = "") -> list[str]:
    """The innermost entries of a report marked "ok": false, as dotted paths."""
    inner = [f for key, value in report.items() if isinstance(value, dict)
             for f in failed_checks(value, f"{path}.{key}" if path else key)]
    return inner or ([path] if report.get("ok") is False else [])


PART_FILES = {"1/3 device independence": "device_independence.json",
              "2/3 trainer": "trainer.json", "3/3 memory and step time": "memory_time.json"}


def run_part(label: str, out: Path, fn) -> dict:
    """Run one part, write its JSON and say how it went; an exception is that part's
    failure (the other parts still run)."""
    t0 = time.perf_counter()
    try:
        report = fn()
    except Exception as exc:  # noqa: BLE001 - reported as the part's failure
        traceback.print_exc()
        report = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    report["seconds"] = round(time.perf_counter() - t0, 2)
    write_json(out, PART_FILES[label], report)
    failed = failed_checks(report)
    progress(f"{label}: {'passed' if not failed else 'FAILED'} in {report['seconds']:.0f} s"
             + (f": {report['error']}" if "error" in report else "")
             + (f" ({', '.join(failed)})" if failed and "error" not in report else ""))
    return report


def missing_packages(names=MACHINE_PACKAGES) -> list[str]:
    """Those of ``names`` this Python cannot import."""
    import importlib.util

    return [name for name in names if importlib.util.find_spec(name) is None]


def select_device(cpu: bool) -> str:
    """cpu under --cpu; else CUDA, which must be there (deterministic cuBLAS workspace set
    before its first use, for part 2), with ``MACHINE_PACKAGES``."""
    os.environ["MEGATRON_LOGRA_DEVICE"] = "cpu" if cpu else "cuda"
    if cpu:
        return "cpu"
    missing = missing_packages()
    if missing:
        raise SystemExit(f"gpu_check: this python3 lacks {', '.join(missing)}: install them "
                         f"on the GPU machine, or add them to requirements/gpu-check.txt and "
                         f"bring their wheels (make gpu-wheels)")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_check: torch sees no CUDA device; run with --cpu for the CPU "
                         "mode, or on the GPU machine (make gpu-check)")
    return "cuda"


def main(argv=None) -> int:
    args = parse(argv)
    warnings.filterwarnings("ignore", category=UserWarning, module="megatron")  # no TE/Apex
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch's deprecations
    if args.probe:
        serve_probe(json.loads(args.probe))
        return 0
    t0 = time.perf_counter()
    device, scale = select_device(args.cpu), CPU if args.cpu else GPU
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = args.parts.split(",")
    progress(f"device {device}, scale {json.dumps(asdict(scale))}")
    reports = {}
    if "device" in parts:
        reports["device"] = run_part("1/3 device independence", out,
                                         lambda: device_independence(device, scale))
    if "trainer" in parts:
        reports["trainer"] = run_part("2/3 trainer", out, lambda: trainer_part(device, scale))
    if "memory" in parts:
        progress(f"3/3 memory and step time: {', '.join(MEMORY_VARIANTS)} at "
                 f"{scale.probe_shape}, seq {scale.probe_seq}, LoGRA r={scale.probe_rank}")
        reports["memory"] = run_part("3/3 memory and step time", out,
                                     lambda: memory_part(device, scale))
    failed = failed_checks(reports)
    summary = {"gpu_check": "failed" if failed else "passed", "device": device,
               "parts": {name: r["ok"] for name, r in reports.items()}, "failed": failed,
               "out": str(out), "seconds": round(time.perf_counter() - t0, 1)}
    if "memory" in reports and "variants" in reports["memory"]:
        summary["memory_time"] = {n: {k: f[k] for k in ("peak_mem_bytes", "model_state_bytes",
                                                        "step_time_s")}
                                  for n, f in reports["memory"]["variants"].items()}
    print(json.dumps(summary), flush=True)
    if failed:
        errors = [f"{name}: {r['error']}" for name, r in reports.items() if "error" in r]
        print(f"gpu_check FAILED: {', '.join(failed)} ('ok': false in {out}/*.json)"
              + "".join(f"\n  {e}" for e in errors), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
