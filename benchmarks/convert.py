"""SmolLM2-135M conversion both ways: wall time and peak RSS, printed as JSON.

    .venv/bin/python benchmarks/convert.py [--work-dir DIR] [--save]

Each measurement runs in a fresh subprocess: after its imports it records the
resident set (the interpreter + torch + megatron baseline), resets the kernel's peak to
it, runs one job, and reports the peak RSS (``VmHWM``) minus that baseline. Not
``ru_maxrss``: a child started by vfork + exec inherits its parent's peak there (this
script's own peak, a GB when it has just converted the GGUF). Side by side:

* ``hf_to_megatron``: the HF folder (fp32) -> megatron torch_dist checkpoint, fp32.
* ``megatron_to_hf``: that checkpoint -> HF safetensors, bf16, 64 MiB shards.
* ``load_whole_model``: what a non-streaming converter holds: every HF tensor
  read (by the same reader) and kept at once.

Streaming means each converter's ``peak_rss_over_baseline`` stays near
``largest_tensor_bytes`` plus a constant, well below ``model_bytes``
(megatron -> HF holds about two copies of the largest tensor: torch DCP's reader
deserialises a stored chunk and copies it into the destination). The last line
of stdout is the JSON report (``--save``: also benchmarks/results/convert.json and
convert.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import mib, save

REPO = Path(__file__).resolve().parents[1]


def _rss_bytes() -> int:
    return _status_bytes("VmRSS")


def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024  # kB
    raise RuntimeError(f"no {field} in /proc/self/status: this benchmark needs Linux")


def _peak_rss_bytes() -> int:
    """This process's peak RSS since the last reset (VmHWM: per address space, so not the
    parent's, unlike ru_maxrss after vfork + exec)."""
    return _status_bytes("VmHWM")


def _reset_peak_rss() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS."""
    Path("/proc/self/clear_refs").write_text("5")


def _child(job: str, src: str, out: str) -> None:
    """Run one job in this (fresh) process; print its figures as one JSON line."""
    import torch

    from megatron_logra.convert.hf_checkpoint import HFCheckpoint
    from megatron_logra.model.arch import load_arch
    from megatron_logra.convert.pipeline import _init_single_process, hf_to_megatron, megatron_to_hf

    _init_single_process()
    baseline = _rss_bytes()
    _reset_peak_rss()
    start = time.perf_counter()
    if job == "hf_to_megatron":
        hf_to_megatron(src, out, dtype=torch.float32, log=lambda msg: None)
    elif job == "megatron_to_hf":
        megatron_to_hf(src, out, hf_config_from=sys.argv[5], dtype=torch.bfloat16,
                       max_shard_bytes=64 * 1024**2, log=lambda msg: None)
    elif job == "load_whole_model":
        checkpoint = HFCheckpoint(src, load_arch(src))
        state = {name: checkpoint.read(name) for name in checkpoint.names()}
        assert sum(t.numel() * t.element_size() for t in state.values()) > 0
    else:
        raise SystemExit(f"unknown job {job!r}")
    seconds = time.perf_counter() - start
    peak = _peak_rss_bytes()
    print(json.dumps({"seconds": round(seconds, 3), "baseline_rss_bytes": baseline,
                      "peak_rss_over_baseline_bytes": max(0, peak - baseline)}))


def _run_child(job: str, *args: str) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--child", job, *args], cwd=REPO,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{job} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _tensor_bytes(folder: Path) -> tuple[int, int]:
    """(total, largest) tensor bytes of the safetensors files in ``folder``, from headers."""
    from megatron_logra.convert.safetensors_io import SafetensorsFile

    sizes = [e.end - e.begin for path in folder.glob("*.safetensors")
             for e in SafetensorsFile(path).entries.values()]
    return sum(sizes), max(sizes, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", help="where to write the outputs (default: a temp dir)")
    parser.add_argument("--save", action="store_true",
                        help="also write benchmarks/results/convert.json and convert.md")
    args = parser.parse_args()
    from megatron_logra.convert.gguf import ensure_smollm2_hf

    hf = ensure_smollm2_hf()
    model_bytes, largest = _tensor_bytes(hf)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        ckpt, exported = Path(tmp) / "ckpt", Path(tmp) / "exported"
        print(f"[convert bench] {hf}: {model_bytes / 2**20:.0f} MiB of tensors, largest "
              f"{largest / 2**20:.0f} MiB", file=sys.stderr)
        report = {"benchmark": "convert", "model": "SmolLM2-135M-Instruct (fp32)",
                  "model_bytes": model_bytes, "largest_tensor_bytes": largest}
        jobs = {"hf_to_megatron": (str(hf), str(ckpt)),
                "megatron_to_hf": (str(ckpt), str(exported), str(hf)),
                "load_whole_model": (str(hf), "-")}
        for job, job_args in jobs.items():
            figures = _run_child(job, *job_args)
            peak = figures["peak_rss_over_baseline_bytes"]
            figures["rss_over_model_ratio"] = round(peak / model_bytes, 3)
            figures["rss_over_largest_tensor_ratio"] = round(peak / largest, 3)
            report[job] = figures
            print(f"[convert bench] {job}: {figures}", file=sys.stderr)
        report["exported_bytes"] = _tensor_bytes(exported)[0]
    streamed = [report[j]["peak_rss_over_baseline_bytes"] for j in ("hf_to_megatron",
                                                                   "megatron_to_hf")]
    whole = report["load_whole_model"]["peak_rss_over_baseline_bytes"]
    # the measure sees a whole model when one is held, and the converters stay far below it
    report["streaming_ok"] = whole >= 0.9 * model_bytes and all(p < 0.5 * whole for p in streamed)
    report["whole_model_over_streaming_ratio"] = round(whole / max(streamed), 2)
    if args.save:
        save("convert", report, markdown(report))
    print(json.dumps(report))


def markdown(report: dict) -> str:
    """Markdown: each direction's wall time and peak RSS over the interpreter's baseline,
    against the largest tensor, and what holding the whole model takes."""
    largest = report["largest_tensor_bytes"]
    lines = ["| job | time (s) | peak RSS over baseline (MiB) | / largest tensor |",
             "|---|---|---|---|"]
    for job, label in (("hf_to_megatron", "HF -> megatron (fp32)"),
                       ("megatron_to_hf", "megatron -> HF (bf16)"),
                       ("load_whole_model", "holding every tensor at once (reference)")):
        r = report[job]
        lines.append(f"| {label} | {r['seconds']:.1f} | {mib(r['peak_rss_over_baseline_bytes'])} "
                     f"| {r['rss_over_largest_tensor_ratio']:.1f} |")
    return "\n".join(lines) + (
        f"\n\n{report['model']}: {mib(report['model_bytes'])} MiB of tensors, the largest "
        f"{mib(largest)} MiB. Streaming (each converter under half the whole model's peak): "
        f"{'yes' if report['streaming_ok'] else '**no**'}; holding the whole model takes "
        f"{report['whole_model_over_streaming_ratio']}x the larger converter's peak.\n")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(*sys.argv[2:5])
    else:
        main()
