"""Where the traced code is: the innermost frames of a stack outside torch, the dry run and
``runtime.host_read`` (the machinery), as "path:line function" with paths relative to the
package's parent or to site-packages. Every check of the dry run names its site this way.
"""

from __future__ import annotations

import os
import traceback

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron_logra/
_HERE = os.path.dirname(os.path.abspath(__file__))  # megatron_logra/dry_run/
_HOST_READ = os.path.join(_PACKAGE, "runtime", "host_read.py")


def is_machinery(path: str) -> bool:
    """Whether a frame's file is torch's or the dry run's own (never a call site)."""
    path = os.path.abspath(path)
    return (path.startswith(_HERE) or path == _HOST_READ
            or f"{os.sep}torch{os.sep}" in path)


def call_site() -> str:
    """"path:line function" of the innermost frame of the current stack outside torch, the
    dry run and ``runtime.host_read`` (paths relative to the package's parent or to
    site-packages)."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not is_machinery(frame.filename):
            return f"{short_path(frame.filename)}:{frame.lineno} {frame.name}"
    return "?"


def call_stack(depth: int = 16) -> list[str]:
    """The ``depth`` innermost frames of the current stack outside torch and the dry run,
    innermost first ("path:line function")."""
    out = []
    for frame in reversed(traceback.extract_stack()[:-1]):
        if not is_machinery(frame.filename):
            out.append(f"{short_path(frame.filename)}:{frame.lineno} {frame.name}")
            if len(out) == depth:
                break
    return out


def short_path(path: str) -> str:
    path = os.path.abspath(path)
    for root in ("site-packages" + os.sep, os.path.dirname(_PACKAGE)):
        if root in path:
            return path.split(root, 1)[1].lstrip(os.sep)
    return path
