"""wandb, imported only where this project logs to it.

megatron-core imports wandb at import time whenever it is installed
(``megatron/core/timers.py``, ``inference/contexts/dynamic_context.py``) to log its own
timers, which this project never asks it to; that import costs ~0.5 s in every process
(every torchrun rank, every engine). ``keep_out_of_megatron()``, run when
``megatron_logra`` is imported, makes those imports find no wandb (megatron then keeps
``wandb = None``); ``import_wandb()`` lifts that and imports the real one, for
``--wandb-project`` and the tests that read W&B's files.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys


def keep_out_of_megatron() -> None:
    if "wandb" not in sys.modules:
        sys.modules["wandb"] = None  # "import wandb" raises ImportError until lifted


def wandb_installed() -> bool:
    """Whether wandb can be imported (looking past the block)."""
    if sys.modules.get("wandb") is not None:
        return True
    return importlib.machinery.PathFinder.find_spec("wandb") is not None


def import_wandb():
    """The wandb module (ImportError if it is not installed)."""
    if "wandb" in sys.modules and sys.modules["wandb"] is None:
        del sys.modules["wandb"]
    return importlib.import_module("wandb")
