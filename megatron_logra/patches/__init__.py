"""Every patch of megatron-core internals (besides the CPU-only shims in
``runtime/megatron_shims.py``). Each module says which function it replaces, why,
why results stay identical, and which megatron-core versions it supports."""

from megatron_logra.patches.checkpoint_writer_queue import apply as _apply_writer_queue
from megatron_logra.patches.dist_optimizer_step_state import apply as _apply_step_state
from megatron_logra.patches.forward_ad import apply as _apply_forward_ad


def apply_all() -> None:
    _apply_step_state()
    _apply_forward_ad()
    _apply_writer_queue()
