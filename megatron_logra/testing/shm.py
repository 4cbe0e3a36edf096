"""Shared memory a job left behind: the /dev/shm entries that appeared while it ran and
that no live process maps or holds open (entries of other jobs on the machine are in
use, so a busy machine does not fail the check)."""

from __future__ import annotations

import os
from pathlib import Path

SHM = Path("/dev/shm")


def shm_entries() -> set[str]:
    """The names in /dev/shm now (none where there is no /dev/shm)."""
    return set(os.listdir(SHM)) if SHM.is_dir() else set()


def leaked_shm(before: set[str]) -> list[str]:
    """The /dev/shm entries that appeared during the job and that no live process maps or
    holds open: what the job left (entries of other jobs on the machine are in use)."""
    if not SHM.is_dir():
        return []
    held = held_shm_inodes()
    leaked = []
    for name in set(os.listdir(SHM)) - before:
        try:
            if os.stat(SHM / name).st_ino not in held:
                leaked.append(name)
        except FileNotFoundError:
            pass
    return sorted(leaked)


def held_shm_inodes() -> set[int]:
    """Inodes of the /dev/shm files some live process maps or has open."""
    held = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            for line in (proc / "maps").read_text().splitlines():
                fields = line.split(None, 5)
                if len(fields) == 6 and fields[5].startswith(str(SHM) + "/"):
                    held.add(int(fields[4]))
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd).startswith(str(SHM) + "/"):
                    held.add(os.stat(fd).st_ino)
        except OSError:
            continue
    return held
