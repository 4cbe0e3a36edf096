"""Streaming safetensors I/O: read any row/column slice, write shard by shard.

The format is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
and the raw little-endian tensor bytes. Owning the reader and writer (instead
of ``safetensors.safe_open``'s mmap) keeps memory to what one call asks for:

* ``SafetensorsFile.read(name, rows=, cols=)`` reads only the requested rows
  (one contiguous byte range) or columns (one short range per row);
* ``StreamingShardWriter`` knows every tensor's name, shape and dtype up
  front, so it writes each shard's header first and then each tensor's bytes
  as soon as it is produced: it never holds more than the tensor in hand.

Every header is validated against the file size, so a truncated or corrupt
file fails with a message naming the file, not with garbage tensors.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
          "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
          "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class CheckpointFormatError(ValueError):
    """A checkpoint file or folder is malformed: the message names the file and the fault."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def row_bytes(self) -> int:
        return (self.end - self.begin) // self.shape[0] if self.shape and self.shape[0] else 0


class SafetensorsFile:
    """One .safetensors file; ``entries`` is validated at open, data read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.entries, self.metadata = _read_header(self.path)

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor ``name`` (or ``[rows[0]:rows[1]]`` of dim 0, ``[:, cols[0]:cols[1]]`` of dim 1)."""
        entry = self.entries[name]
        r0, r1 = rows if rows is not None else (0, entry.shape[0] if entry.shape else 1)
        if entry.shape and not 0 <= r0 <= r1 <= entry.shape[0]:
            raise IndexError(f"{name}: rows {r0}:{r1} outside shape {entry.shape}")
        if cols is not None:
            return self._read_columns(name, entry, (r0, r1), cols)
        with open(self.path, "rb") as f:
            if not entry.shape:
                return _from_bytes(_read_exact(f, entry.begin, entry.end - entry.begin, self.path),
                                   entry.dtype, ())
            start = entry.begin + r0 * entry.row_bytes
            data = _read_exact(f, start, (r1 - r0) * entry.row_bytes, self.path)
        return _from_bytes(data, entry.dtype, (r1 - r0, *entry.shape[1:]))

    def _read_columns(self, name: str, entry: TensorEntry, rows: tuple[int, int],
                      cols: tuple[int, int]) -> torch.Tensor:
        """Columns ``cols`` of rows ``rows``: one short read per row, so exactly the slice's
        bytes come off the disk (a row-parallel shard never reads its neighbours' columns)."""
        if len(entry.shape) < 2 or not 0 <= cols[0] <= cols[1] <= entry.shape[1]:
            raise IndexError(f"{name}: columns {cols} outside shape {entry.shape}")
        col_bytes = entry.row_bytes // entry.shape[1]
        width = (cols[1] - cols[0]) * col_bytes
        out = bytearray(width * (rows[1] - rows[0]))
        view = memoryview(out)
        with open(self.path, "rb") as f:
            for i, r in enumerate(range(rows[0], rows[1])):
                f.seek(entry.begin + r * entry.row_bytes + cols[0] * col_bytes)
                if f.readinto(view[i * width:(i + 1) * width]) != width:
                    raise CheckpointFormatError(f"{self.path}: truncated inside {name!r}")
        _count(len(out))
        return _from_bytes(out, entry.dtype, (rows[1] - rows[0], cols[1] - cols[0],
                                              *entry.shape[2:]))


BYTES_READ = [0]
"""Tensor bytes read so far by this process (tests check each rank reads only its shard)."""


def _count(n: int) -> None:
    BYTES_READ[0] += n


def _read_exact(f, offset: int, length: int, path: Path) -> bytearray:
    """``length`` bytes at ``offset`` read straight into one buffer (no second copy)."""
    f.seek(offset)
    data = bytearray(length)
    got = f.readinto(data)
    if got != length:
        raise CheckpointFormatError(f"{path}: truncated (wanted {length} bytes at {offset}, "
                                    f"got {got}); re-download or re-export the file")
    _count(length)
    return data


def _from_bytes(data: bytes | bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    buffer = data if isinstance(data, bytearray) else bytearray(data)
    return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _read_header(path: Path) -> tuple[dict[str, TensorEntry], dict]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointFormatError(f"{path}: {size} bytes, too short to be a safetensors file")
        (header_len,) = struct.unpack("<Q", raw)
        if header_len > min(size - 8, _MAX_HEADER):
            raise CheckpointFormatError(f"{path}: header length {header_len} exceeds the file "
                                        f"({size} bytes): the file is truncated or not safetensors")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointFormatError(f"{path}: corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: corrupt safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    data_start = 8 + header_len
    entries = {}
    for name, info in header.items():
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{path}: corrupt header entry for {name!r}: {info}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if end - begin != math.prod(shape) * itemsize or begin < 0:
            raise CheckpointFormatError(f"{path}: {name!r} declares shape {shape} {info['dtype']} "
                                        f"but spans {end - begin} bytes")
        if data_start + end > size:
            raise CheckpointFormatError(f"{path}: {name!r} ends at byte {data_start + end} but the "
                                        f"file has {size} bytes: the file is truncated")
        entries[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    return entries, metadata


# --------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def plan_shards(tensors: list[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Greedy, order-preserving split into shards of at most ``max_shard_bytes`` (a tensor larger
    than that gets a shard of its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def shard_file_name(index: int, count: int) -> str:
    if count == 1:
        return "model.safetensors"
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


class StreamingShardWriter:
    """Write ``tensors`` (in this order) into ``out_dir`` as HF-style sharded safetensors.

    Call ``write(name, tensor)`` once per planned tensor, in plan order, then
    ``close()``, which writes ``model.safetensors.index.json`` when there are
    several shards. Memory: the tensor being written.
    """

    def __init__(self, out_dir: str | os.PathLike, tensors: list[PlannedTensor],
                 max_shard_bytes: int, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(tensors, max_shard_bytes)
        self.metadata = {"format": "pt", **(metadata or {})}
        self._order = [t for shard in self.shards for t in shard]
        self._next = 0
        self._file = None
        self._shard = -1
        self.weight_map: dict[str, str] = {}

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self._order)

    def _open_shard(self, index: int) -> None:
        if self._file is not None:
            self._file.close()
        tensors = self.shards[index]
        header, offset = {}, 0
        for t in tensors:
            header[t.name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                              "data_offsets": [offset, offset + t.nbytes]}
            offset += t.nbytes
        header["__metadata__"] = self.metadata
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned
        name = shard_file_name(index, len(self.shards))
        self._file = open(self.out_dir / name, "wb")
        self._file.write(struct.pack("<Q", len(blob)) + blob)
        for t in tensors:
            self.weight_map[t.name] = name
        self._shard = index

    def shard_of_next(self) -> int:
        count = 0
        for i, shard in enumerate(self.shards):
            count += len(shard)
            if self._next < count:
                return i
        return len(self.shards)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise RuntimeError(f"{name}: every planned tensor is already written")
        planned = self._order[self._next]
        if name != planned.name:
            raise RuntimeError(f"got {name!r}, the plan expects {planned.name!r} next")
        if tuple(tensor.shape) != planned.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, planned {planned.shape}")
        shard = self.shard_of_next()
        if shard != self._shard:
            self._open_shard(shard)
        data = tensor.detach().to("cpu", planned.dtype).contiguous()
        if data.numel():  # the buffer protocol writes the bytes without another copy
            self._file.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._order):
            missing = [t.name for t in self._order[self._next:]][:5]
            raise RuntimeError(f"{len(self._order) - self._next} planned tensors were never "
                               f"written, e.g. {missing}")
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None
        if len(self.shards) > 1:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": self.weight_map}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
