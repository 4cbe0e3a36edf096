"""Keep command-line output readable."""

from __future__ import annotations

import warnings


def quiet_library_warnings() -> None:
    """megatron-core warns about every optional CUDA extension it does not find (apex,
    TE) on import; torch DCP and transformers about deprecations we do not control.
    Our own warnings still show."""
    for module in ("megatron", "torch.distributed", "transformers"):
        warnings.filterwarnings("ignore", module=module)
