"""Device values read on the host: the package's one place for ``.item()`` and the like.

A value the host needs from a tensor (a flag all-reduced over the world, a token count,
a norm that picks a step size) is read with ``host_value(tensor, assume=...)``:
``tensor.tolist()`` (a Python number for a 0-d tensor, a list otherwise). ``assume``
states the value a trace without values takes in its place, the one that makes the run
do the most work (every row updated, every probe token kept, a finite step): a dry run
(``megatron_logra.dry_run``) traces the real code on tensors that have shapes but no
values, and answers each read with its ``assume`` (``answered_by``). Nothing else in the
package knows whether values exist.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

Reader = Callable[[torch.Tensor, object], object]
"""(tensor, assume) -> the value the host gets."""

_READER: Reader | None = None


def host_value(tensor: torch.Tensor, *, assume):
    """``tensor.tolist()`` (a Python scalar for a 0-d tensor), or the installed reader's
    answer (``assume`` in a dry run). ``assume`` has that same structure."""
    if _READER is not None:
        return _READER(tensor, assume)
    return tensor.tolist()


@contextlib.contextmanager
def answered_by(reader: Reader) -> Iterator[None]:
    """While inside, ``host_value`` asks ``reader`` instead of the tensor."""
    global _READER
    previous, _READER = _READER, reader
    try:
        yield
    finally:
        _READER = previous
