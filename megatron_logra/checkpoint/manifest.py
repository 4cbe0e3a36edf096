"""A checkpoint's manifest: every file with its size and CRC32, written last, checked before use.

``manifest_entries(dir, files)`` are the files' records; ``verify(ckpt_dir, files)`` checks the
listed files of a checkpoint against ``MANIFEST`` and returns the problems found, each
naming the file (missing, truncated or grown, corrupt, or the manifest itself missing or
unreadable). The files are split over the ranks (``files_for_rank``) so that a large
checkpoint is hashed in parallel, on save and on load. Pure file work: no torch.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

MANIFEST = "manifest.json"
_CHUNK = 8 * 2**20


def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def checkpoint_files(ckpt_dir: Path) -> list[str]:
    """Every file of the checkpoint (relative paths, sorted), the manifest left out."""
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST)


def files_for_rank(files: list[str], rank: int, world_size: int) -> list[str]:
    return files[rank::world_size]


def manifest_entries(ckpt_dir: Path, files: list[str]) -> dict[str, dict]:
    """{file: {"bytes", "crc32"}} of ``files``."""
    return {name: {"bytes": (ckpt_dir / name).stat().st_size, "crc32": crc32(ckpt_dir / name)}
            for name in files}


def write_manifest(ckpt_dir: Path, entries: dict[str, dict]) -> None:
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"files": dict(sorted(entries.items()))}, indent=0))
    os.replace(tmp, ckpt_dir / MANIFEST)


def read_manifest(ckpt_dir: Path) -> dict[str, dict]:
    """The manifest's files; raises ValueError naming the manifest when it is missing or
    unreadable."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path} is missing: the save did not finish")
    try:
        return json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is corrupt ({type(exc).__name__})") from None


def check(ckpt_dir: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """Problems of this rank's share of the checkpoint's files (all of them by default),
    the manifest's own included."""
    try:
        manifest = read_manifest(ckpt_dir)
    except ValueError as exc:
        return [str(exc)] if rank == 0 else []
    return verify(ckpt_dir, files_for_rank(sorted(manifest), rank, world_size), manifest)


def verify(ckpt_dir: Path, files: list[str], manifest: dict[str, dict]) -> list[str]:
    """Problems of ``files`` (a subset of the manifest's), each naming its file."""
    problems = []
    for name in files:
        path, want = ckpt_dir / name, manifest[name]
        if not path.is_file():
            problems.append(f"{path} is missing")
            continue
        size = path.stat().st_size
        if size != want["bytes"]:
            problems.append(f"{path} has {size} bytes, {want['bytes']} were written "
                            f"({'truncated' if size < want['bytes'] else 'grown'})")
        elif crc32(path) != want["crc32"]:
            problems.append(f"{path} is corrupt (CRC32 differs from the one written)")
    return problems
