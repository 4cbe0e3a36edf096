"""Read TensorBoard and W&B logs back with the libraries' own formats, for the tests.

TensorBoard: its ``EventAccumulator``. W&B: the offline run file ``run-ID.wandb`` is a
LevelDB-style log of W&B's own protobuf ``Record`` messages (``wandb.proto``); wandb 0.31
reads it only in its Go core, so the 30-line block reader is here, the messages are
decoded by wandb's own schema.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """{tag: {step: value}} of every scalar in the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def tensorboard_text(log_dir: str | Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    event = acc.Tensors(f"{tag}/text_summary")[0]
    return event.tensor_proto.string_val[0].decode()


def wandb_records(run_file: str | Path) -> list:
    """The ``wandb_internal_pb2.Record`` messages of an offline run file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{run_file}: not a W&B run file"
    pos, pending, chunks = 7, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == _FULL:
            chunks.append(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            chunks.append(pending + chunk)
    records = []
    for chunk in chunks:
        record = pb.Record()
        record.ParseFromString(chunk)
        records.append(record)
    return records


def wandb_run(save_dir: str | Path) -> tuple[dict, list[dict]]:
    """(config, history rows) of the one offline run under ``save_dir/wandb``; a resumed
    run's later files follow the first."""
    files = sorted(Path(save_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no offline W&B run under {save_dir}/wandb"
    config, history = {}, []
    for f in files:
        for record in wandb_records(f):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config.update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "history":
                history.append({item.key or ".".join(item.nested_key):
                                json.loads(item.value_json) for item in record.history.item})
    return config, history


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-30)


def check_logs_match(metrics: list[dict], tb_dir: str | Path | None,
                     wandb_dir: str | Path | None) -> int:
    """Assert that every scalar of ``metrics`` (metrics.jsonl's records) is in TensorBoard
    (float32: relative 1e-6) and W&B (exact, strings included) at its step, and nothing
    else is; returns the number of values compared."""
    expected = {(r["step"], k): v for r in metrics for k, v in r.items()
                if k != "step" and isinstance(v, (int, float, str))}
    compared = 0
    if tb_dir is not None:
        tb = tensorboard_scalars(tb_dir)
        got = {(step, tag): v for tag, steps in tb.items() for step, v in steps.items()}
        numeric = {key: v for key, v in expected.items() if not isinstance(v, str)}
        assert got.keys() == numeric.keys(), (set(got) ^ set(numeric))
        for key, v in numeric.items():
            assert _close(got[key], float(v)), (key, got[key], v)
        compared += len(got)
    if wandb_dir is not None:
        _, history = wandb_run(wandb_dir)
        got = {(row["_step"], k): v for row in history for k, v in row.items()
               if not k.startswith("_")}
        assert got.keys() == expected.keys(), (set(got) ^ set(expected))
        for key, v in expected.items():
            assert got[key] == v or (isinstance(v, float) and _close(got[key], v)), \
                (key, got[key], v)
        compared += len(got)
    return compared
