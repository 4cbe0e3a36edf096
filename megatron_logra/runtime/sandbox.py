"""Resource limits for a child process that runs task code (codeio's exec, verifiers).

reasoning-gym's codeio ``exec``s Python snippets while it generates items, and a
scorer is third-party code fed model output. Both run in a child process that calls
``enter_sandbox`` first, and each item or answer runs under ``time_limit``:

- **time**: ``time_limit(s)`` raises ``TimeLimitExceeded`` (a ``BaseException``, so a
  snippet's ``except Exception`` cannot swallow it) when the item takes longer;
- **memory**: the process's address space is capped (``RLIMIT_AS``): an allocation past
  it raises ``MemoryError`` in the snippet and the process lives on;
- **files**: an audit hook refuses every write, create, delete, rename or permission
  change outside the scratch directory (``PermissionError``), and a file written
  inside it is capped (``RLIMIT_FSIZE``). This guards against accidents, not a
  determined attacker (a snippet could still reach the OS through ``ctypes``).

Linux/POSIX only (``resource``, ``SIGALRM``), as the rest of the system.
"""

from __future__ import annotations

import os
import resource
import signal
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# audit events that change the file system: event -> which arguments are paths
_PATH_EVENTS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.rename": (0, 1),
                "os.truncate": (0,), "os.chmod": (0,), "os.chown": (0,), "os.utime": (0,),
                "os.symlink": (1,), "os.link": (1,), "shutil.rmtree": (0,),
                "shutil.copyfile": (1,), "os.chflags": (0,), "os.mkfifo": (0,),
                "os.mknod": (0,)}
_ALLOWED_DEVICES = ("/dev/null",)


@dataclass(frozen=True)
class SandboxLimits:
    memory_gib: float = 4.0  # address space of the whole child process
    file_mb: float = 64.0  # the largest file it may write (inside its scratch directory)
    threads: int = 1  # BLAS / OpenMP threads of numeric libraries it imports


class TimeLimitExceeded(BaseException):
    """An item ran past its time limit (``time_limit``)."""


def enter_sandbox(scratch: str, limits: SandboxLimits) -> None:
    """Confine this process (call it first in the child): work in ``scratch``, cap its
    memory and file sizes, and refuse file-system writes outside ``scratch``."""
    scratch = os.path.realpath(scratch)
    os.chdir(scratch)
    os.environ["TMPDIR"] = tempfile.tempdir = scratch
    os.environ["HOME"] = scratch
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(limits.threads)
    sys.dont_write_bytecode = True  # no __pycache__ next to the installed modules
    _cap(resource.RLIMIT_AS, int(limits.memory_gib * 2**30))
    _cap(resource.RLIMIT_FSIZE, int(limits.file_mb * 2**20))
    # a file written past RLIMIT_FSIZE raises OSError(EFBIG) instead of killing the process
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    sys.addaudithook(_write_guard(scratch))


def _cap(limit: int, value: int) -> None:
    _, hard = resource.getrlimit(limit)
    resource.setrlimit(limit, (value if hard == resource.RLIM_INFINITY else min(value, hard),
                               hard))


def _write_guard(scratch: str):
    def inside(path) -> bool:
        if isinstance(path, int):  # a descriptor this process already holds
            return True
        path = os.fsdecode(path)
        if path in _ALLOWED_DEVICES:
            return True
        real = os.path.realpath(path)
        return real == scratch or real.startswith(scratch + os.sep)

    def refuse(path) -> None:
        raise PermissionError(f"task code may not write outside its scratch directory "
                              f"{scratch}: {os.fsdecode(path)!r}")

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in str(mode) for c in "wax+")) or \
                (mode is None and isinstance(flags, int) and flags & _WRITE_FLAGS)
            if writes and path is not None and not inside(path):
                refuse(path)
        elif event in _PATH_EVENTS:
            for i in _PATH_EVENTS[event]:
                if i < len(args) and args[i] is not None and not inside(args[i]):
                    refuse(args[i])

    return hook


@contextmanager
def time_limit(seconds: float):
    """Raise ``TimeLimitExceeded`` in this (main) thread after ``seconds`` of wall time."""
    def expire(signum, frame):
        raise TimeLimitExceeded(f"over its time limit of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
