"""Write a folder all-or-nothing: build it beside the target, rename it into place at the end."""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


class OutputExistsError(ValueError):
    pass


def check_output_dir(out: str | os.PathLike, overwrite: bool, flag: str = "--out") -> Path:
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise OutputExistsError(f"{flag} {path} is a file; name a folder")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise OutputExistsError(f"{flag} {path} is not empty; pass --overwrite to replace it, or "
                                f"choose a new folder")
    return path


@contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool) -> Iterator[Path]:
    """Yields a temporary sibling folder; on success it replaces ``out`` (``out`` is left
    untouched on failure, and the temporary folder removed)."""
    final = check_output_dir(out, overwrite).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.partial-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = final.with_name(f".{final.name}.old-{os.getpid()}")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    if old.exists():
        shutil.rmtree(old)
