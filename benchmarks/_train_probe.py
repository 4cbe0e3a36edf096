"""Shared by memory.py and step_time.py: one optimizer variant, measured in fresh processes.

    python benchmarks/_train_probe.py JSON_SPEC            one report (prints one JSON line)
    torchrun --nproc-per-node N benchmarks/_train_probe.py JSON_SPEC   (a TP/PP/DP layout)
    python benchmarks/_train_probe.py --serve JSON_SPEC    step on each "step" line of stdin

The spec names a model shape (``memory.shapes``; random init, only its config is
needed), a variant (dense Adam with megatron's distributed optimizer, LoGRA in a
precision mode, or LoRA), the layout (``tp``, ``pp``; DP is what the process count
leaves), the device and the batch. Each rank counts its model-state bytes by enumerating
every tensor the model, DDP and the optimizers hold (storages counted once), then runs
train steps on random tokens (``testing.batches``) and reports step times and peak
memory: CUDA max allocated over the steps; on CPU the same quantity counted by hand, the
bytes of Python-held tensors before the last step plus the peak of the live tensor
storage allocated inside it (``runtime.live_bytes``; that step runs untimed). The CPU
peak RSS over imports is reported beside it (allocator caching and freed-but-resident
heap included, so it is no check of an analytic model). Rank 0 prints every rank's
figures.

``--serve`` (step_time.py) builds once and then times one step per request, with the
step's phases (``runtime.phase_times``), so two variants' processes can be stepped in
turn and machine noise hits both alike.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from pathlib import Path

from megatron_logra.memory.held_state import model_state_bytes, storage_bytes
from megatron_logra.memory.shapes import shape_dir

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {  # name -> (optimizer, LoGRA master weights, PEFT)
    "dense_adam": ("adam", None, "none"),
    "logra_fp32_master": ("logra", "fp32", "none"),
    "logra_none": ("logra", "none", "none"),
    "lora": ("adam", None, "lora"),
}


def add_setup_args(p, steps: int, steps_help: str) -> None:
    """The flags memory.py and step_time.py share: the batch, recompute and LoGRA's scope."""
    p.add_argument("--seq-length", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=steps, help=steps_help)
    p.add_argument("--recompute", action="store_true", help="full activation recompute")
    p.add_argument("--targets", default="qkv,proj,fc1,fc2",
                   help="LoGRA's sketched weights (--logra-targets; the paper's four)")
    p.add_argument("--untargeted", choices=("frozen", "adam"), default="frozen",
                   help="LoGRA's unsketched parameters (--logra-untargeted; the paper freezes)")


class Probe:
    """One variant's model, optimizer and batches on this rank, built once."""

    def __init__(self, spec: dict):
        import torch

        if spec["device"] == "cpu":
            os.environ["MEGATRON_LOGRA_DEVICE"] = "cpu"
        from megatron_logra.config import LograConfig, LoraConfig, OptimizerConfig
        from megatron_logra.model.arch import load_arch
        from megatron_logra.model.provider import ModelBuildConfig
        from megatron_logra.runtime.device import init_runtime
        from megatron_logra.runtime.parallel import ParallelConfig, initialize
        from megatron_logra.training.build import build_training_objects

        self.spec = spec
        self.rt = init_runtime()
        initialize(ParallelConfig(spec.get("tp", 1), spec.get("pp", 1)), self.rt.world_size,
                   seed=0)
        self.imports_rss = _current_rss()  # CPU: peak memory is counted over imports
        self.arch = load_arch(shape_dir(spec["shape"]))
        name, master, peft = VARIANTS[spec["variant"]]
        opt = OptimizerConfig(name=name, lr=1e-5, use_distributed_optimizer=True, peft=peft,
                              logra=LograConfig(rank=spec["rank"], master_weights=master or "fp32",
                                                update_ratio=6e-5,
                                                targets=tuple(spec["targets"].split(",")),
                                                untargeted=spec.get("untargeted", "frozen")),
                              lora=LoraConfig(rank=spec.get("lora_rank", 16)))
        build = ModelBuildConfig(bf16=True, recompute_activations=spec.get("recompute", False),
                                 use_transformer_engine=spec.get("transformer_engine", False))
        self.objs = build_training_objects(self.arch, build, opt, seed=0,
                                           train_iters=spec["steps"] + 1)
        from megatron.core import parallel_state

        # each DP rank its own tokens; TP and PP peers of one replica the same ones
        self.generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
        if self.rt.device.type == "cpu":  # count the steps' peak, not the build's copies
            import gc

            gc.collect()
            _release_freed_heap()
            _reset_peak_rss()
        elif self.rt.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def _batch(self) -> list[dict]:
        from megatron_logra.testing.batches import random_microbatches

        return random_microbatches(self.arch.vocab_size, count=self.spec["microbatches"],
                                   batch=self.spec["micro_batch_size"],
                                   seq=self.spec["seq_length"], seed=self.generator)

    def _train_step(self, batch) -> None:
        from megatron_logra.training.step import train_step

        train_step(self.objs, batch, seq_length=self.spec["seq_length"],
                   micro_batch_size=self.spec["micro_batch_size"])

    def step(self) -> dict:
        """One timed step: {"seconds", "phases": {name: seconds}}."""
        from megatron_logra.runtime.device import synchronize
        from megatron_logra.runtime.phase_times import PHASES

        batch = self._batch()
        synchronize()
        PHASES.enabled = True
        PHASES.take()
        start = time.perf_counter()
        self._train_step(batch)
        synchronize()
        seconds = time.perf_counter() - start
        PHASES.enabled = False
        return {"seconds": seconds, "phases": PHASES.take()}

    def peak_step(self) -> int:
        """One untimed step; its peak memory (CUDA max allocated since the build, or on CPU
        the Python-held tensors before it plus the peak live storage allocated inside it)."""
        from megatron_logra.runtime.device import peak_memory_bytes, synchronize
        from megatron_logra.runtime.live_bytes import LiveTensorBytes

        batch = self._batch()
        synchronize()
        if self.rt.device.type != "cpu":
            self._train_step(batch)
            synchronize()
            return peak_memory_bytes()
        held_before = sum(storage_bytes(_python_held_tensors()).values())
        with LiveTensorBytes() as live:
            self._train_step(batch)
        return held_before + live.peak_bytes

    def report(self, times: list[float], peak: int) -> dict:
        model = self.objs.model[0]
        return {"variant": self.spec["variant"], "device": str(self.rt.device),
                "rank": self.rt.rank, "params": sum(p.numel() for p in model.parameters()),
                "model_state_bytes": model_state_bytes(self.objs),  # after the steps: Adam
                "peak_mem_bytes": peak,  # creates its state lazily
                "peak_rss_bytes": (_rss() - self.imports_rss
                                   if self.rt.device.type == "cpu" else None),
                "step_times_s": [round(t, 4) for t in times],
                "step_time_s": min(times[1:] if len(times) > 1 else times) if times else None}


def run(spec: dict) -> dict:
    """Build, ``steps - 1`` timed steps, then the peak step; every rank's report on rank 0
    (``ranks``, by global rank) with rank 0's figures at the top level."""
    import torch.distributed as dist

    probe = Probe(spec)
    times = [probe.step()["seconds"] for _ in range(spec["steps"] - 1)]
    mine = probe.report(times, probe.peak_step())
    ranks = [None] * probe.rt.world_size
    dist.all_gather_object(ranks, mine)
    return dict(mine, ranks=ranks, layout={"tp": spec.get("tp", 1), "pp": spec.get("pp", 1),
                                           "dp": probe.rt.world_size
                                           // (spec.get("tp", 1) * spec.get("pp", 1))})


def serve(spec: dict) -> None:
    """Build, then answer each stdin line: "step" -> one timed step's JSON, "report" -> the
    model-state report; EOF ends."""
    probe = Probe(spec)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "step":
            print(json.dumps(probe.step()), flush=True)
        elif command == "report":
            print(json.dumps(probe.report([], 0)), flush=True)
        else:
            print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)


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
    """Run one spec in fresh processes (their own peaks): one process, or torchrun with
    ``tp * pp * dp`` of them. Returns rank 0's report (every rank's under ``ranks``)."""
    import subprocess

    procs = spec.get("tp", 1) * spec.get("pp", 1) * spec.get("dp", 1)
    cmd = [sys.executable, __file__, json.dumps(spec)]
    if procs > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={procs}", *cmd[1:]]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS=str(max(1, 2 // procs))))
    if proc.returncode != 0:
        raise SystemExit(f"{spec} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class Server:
    """A ``--serve`` child: ``step()`` times one step of its variant in its own process."""

    def __init__(self, spec: dict):
        import subprocess

        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", json.dumps(spec)],
                                     cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._read()  # ready

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"the probe process exited ({self.proc.wait()}); see its stderr")
        return json.loads(line)

    def ask(self, command: str) -> dict:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    if sys.argv[1] == "--serve":
        serve(json.loads(sys.argv[2]))
    else:
        report = run(json.loads(sys.argv[1]))
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(report))
