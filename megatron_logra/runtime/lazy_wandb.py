"""wandb, kept out of megatron-core's own imports.

megatron-core imports wandb at import time whenever it is installed
(``megatron/core/timers.py``, ``inference/contexts/dynamic_context.py``) to log its own
timers, which this project never asks it to; that import costs ~0.5 s in every process
(every torchrun rank). ``keep_out_of_megatron()``, called by the command-line entry
points (``launch/pretrain_rl.py``, ``checkpoints_tools``) before megatron-core is first
imported (importing ``megatron_logra`` alone installs nothing), installs an import hook that answers "not installed" to
an ``import wandb`` made by megatron's modules only (megatron then keeps ``wandb =
None``); every other import of wandb (``--wandb-project``, a user's own code) is untouched.
"""

from __future__ import annotations

import importlib.abc
import sys


class _NoWandbForMegatron(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "wandb":
            return None
        frame = sys._getframe(1)
        while frame is not None:  # who imports: megatron-core's modules get "not installed"
            if frame.f_globals.get("__name__", "").startswith("megatron.core"):
                raise ModuleNotFoundError("wandb is kept out of megatron-core's imports",
                                          name="wandb")
            frame = frame.f_back
        return None


def keep_out_of_megatron() -> None:
    """Install the hook (once per process)."""
    if not any(isinstance(f, _NoWandbForMegatron) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoWandbForMegatron())
