"""The streaming safetensors reader/writer against the reference ``safetensors`` library."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_logra.convert import safetensors_io as sio
from megatron_logra.convert.safetensors_io import (
    CheckpointFormatError,
    PlannedTensor,
    SafetensorsFile,
    StreamingShardWriter,
    plan_shards,
)


@pytest.fixture()
def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(7, 5, generator=g),
        "b.weight": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "c.bias": torch.randn(3, generator=g).to(torch.float16),
        "d.scalar": torch.tensor(2.5),
        "e.ids": torch.arange(10, dtype=torch.int64).reshape(2, 5),
    }


def test_reader_matches_reference_library(tmp_path, tensors):
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    f = SafetensorsFile(path)
    for name, ref in tensors.items():
        got = f.read(name)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        assert torch.equal(got, ref), name


def test_row_and_column_slices_read_only_their_bytes(tmp_path, tensors):
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    f = SafetensorsFile(path)
    a, b = tensors["a.weight"], tensors["b.weight"]
    before = sio.BYTES_READ[0]
    assert torch.equal(f.read("a.weight", rows=(2, 5)), a[2:5])
    assert sio.BYTES_READ[0] - before == 3 * 5 * 4
    before = sio.BYTES_READ[0]
    assert torch.equal(f.read("b.weight", rows=(1, 3), cols=(2, 5)), b[1:3, 2:5])
    assert sio.BYTES_READ[0] - before == 2 * 3 * 2
    assert f.read("a.weight", rows=(3, 3)).shape == (0, 5)
    with pytest.raises(IndexError, match="outside shape"):
        f.read("a.weight", rows=(5, 9))
    with pytest.raises(IndexError, match="columns"):
        f.read("a.weight", cols=(4, 6))


def test_streaming_writer_output_loads_with_reference_library(tmp_path, tensors):
    planned = [PlannedTensor(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = StreamingShardWriter(tmp_path, planned, max_shard_bytes=100)
    assert len(writer.shards) > 1
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == sum(p.nbytes for p in planned)
    assert set(index["weight_map"]) == set(tensors)
    for name, file in index["weight_map"].items():
        loaded = load_file(str(tmp_path / file))
        assert torch.equal(loaded[name], tensors[name]), name
        with open(tmp_path / file, "rb") as fh:  # data section starts 8-byte aligned
            assert int.from_bytes(fh.read(8), "little") % 8 == 0


def test_single_shard_has_no_index_and_casts_to_plan_dtype(tmp_path):
    t = torch.randn(4, 4)
    writer = StreamingShardWriter(tmp_path, [PlannedTensor("w", (4, 4), torch.bfloat16)], 1 << 30)
    writer.write("w", t)
    writer.close()
    assert not (tmp_path / "model.safetensors.index.json").exists()
    assert torch.equal(load_file(str(tmp_path / "model.safetensors"))["w"], t.to(torch.bfloat16))


def test_writer_refuses_out_of_plan_tensors(tmp_path):
    planned = [PlannedTensor("w", (2, 2), torch.float32), PlannedTensor("v", (2,), torch.float32)]
    writer = StreamingShardWriter(tmp_path, planned, 1 << 30)
    with pytest.raises(RuntimeError, match="expects 'w'"):
        writer.write("v", torch.zeros(2))
    with pytest.raises(ValueError, match="planned"):
        writer.write("w", torch.zeros(3, 2))
    writer.write("w", torch.zeros(2, 2))
    with pytest.raises(RuntimeError):
        writer.close()  # 'v' never written


def test_plan_shards_keeps_order_and_gives_big_tensors_their_own_shard():
    ts = [PlannedTensor(str(i), (n,), torch.float32) for i, n in enumerate([10, 10, 100, 5, 5])]
    shards = plan_shards(ts, max_shard_bytes=80)
    assert [[t.name for t in s] for s in shards] == [["0", "1"], ["2"], ["3", "4"]]


def test_truncated_file_is_refused_with_its_name(tmp_path, tensors):
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CheckpointFormatError, match="truncated") as err:
        SafetensorsFile(path)
    assert str(path) in str(err.value)
    path.write_bytes(data[:5])
    with pytest.raises(CheckpointFormatError, match="too short"):
        SafetensorsFile(path)


def test_corrupt_headers_are_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes((10**9).to_bytes(8, "little") + b"{}" + b"\0" * 16)
    with pytest.raises(CheckpointFormatError, match="header length"):
        SafetensorsFile(path)
    garbage = b"\xff\xfe not json"
    path.write_bytes(len(garbage).to_bytes(8, "little") + garbage)
    with pytest.raises(CheckpointFormatError, match="corrupt safetensors header"):
        SafetensorsFile(path)
    bad = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path.write_bytes(len(bad).to_bytes(8, "little") + bad + b"\0" * 16)
    with pytest.raises(CheckpointFormatError, match="spans 8 bytes"):
        SafetensorsFile(path)
