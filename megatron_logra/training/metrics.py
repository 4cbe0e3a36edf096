"""metrics.jsonl (one JSON object per update) and the human progress line, rank 0 only.

``sinks`` (``training.log_sinks``: TensorBoard, W&B) get every record written here.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from megatron_logra.training.throughput import progress_parts


class MetricsLog:
    def __init__(self, output_dir: str | Path, enabled: bool, resume_step: int = 0,
                 sinks: list | None = None):
        """``resume_step``: the update a resumed run restarts after (0: a fresh run, which
        starts a new file). A resumed run keeps the records up to that update and drops
        later ones, which a run that stopped after its last checkpoint had written and
        will now write again."""
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not resume_step and self.path.exists():
                self.path.unlink()
            elif self.path.exists():
                kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
                tmp = self.path.with_suffix(".jsonl.tmp")
                tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
                tmp.replace(self.path)
        self.start = time.time()
        self.sinks = list(sinks or [])

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def progress(self, record: dict, total_steps: int) -> None:
        if not self.enabled:
            return
        elapsed = time.time() - self.start
        parts = [f"step {record['step']}/{total_steps}"]
        for key, fmt in (("reward_mean", "{:.3f}"), ("eval_pass@1", "{:.3f}"),
                         ("kl_pred", "{:.2e}"), ("kl_realized", "{:.2e}"), ("alpha", "{:.3g}"),
                         ("loss", "{:.4f}"), ("lr", "{:.2e}"), ("grad_norm", "{:.3f}"),
                         ("tokens", "{:d}"), ("step_time_s", "{:.2f}s")):
            if record.get(key) is not None:
                parts.append(f"{key} " + fmt.format(record[key]))
        parts += progress_parts(record)
        parts.append(f"mem {record['peak_mem_bytes'] / 2**20:.0f}MiB")
        parts.append(f"elapsed {elapsed:.0f}s")
        print(" | ".join(parts), file=sys.stdout, flush=True)


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
