"""The resumable state beside the weights and the optimizer: parts registered by name.

A stage registers each stateful part it owns (the learning-rate scheduler, RL's reward
baseline, the KL controller): anything with ``state_dict()`` and ``load_state_dict(d)``.
A checkpoint stores ``{name: part.state_dict()}`` as one common (rank 0) object. When a
run resumes, ``ResumableState`` holds the checkpoint's states and gives each part its own
as it registers; a part the checkpoint lacks keeps its fresh state (an SFT checkpoint
resumed by RL has no baseline), unless it is registered ``required``.
"""

from __future__ import annotations

from typing import Protocol


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ResumableState:
    """Named stateful parts, saved together; ``resumed``: the states of the checkpoint the
    run resumes from ({} for a fresh run)."""

    def __init__(self, resumed: dict | None = None, source: str = "the checkpoint"):
        self._parts: dict[str, Stateful] = {}
        self._resumed = flat_parts(resumed or {})
        self._source = source

    @property
    def resuming(self) -> bool:
        return bool(self._resumed)

    def register(self, name: str, part: Stateful, *, required: bool = False) -> None:
        """Add ``part``; when resuming, restore it from the checkpoint's state of ``name``
        (KeyError naming the part when a ``required`` one is missing)."""
        if name in self._parts:
            raise ValueError(f"a resumable part named {name!r} is registered already")
        self._parts[name] = part
        if name in self._resumed:
            part.load_state_dict(self._resumed[name])
        elif required and self.resuming:
            raise KeyError(f"{self._source} holds no {name} state to resume from")

    @property
    def names(self) -> list[str]:
        return list(self._parts)

    def state_dict(self) -> dict[str, dict]:
        return {name: part.state_dict() for name, part in self._parts.items()}


def flat_parts(state: dict) -> dict:
    """``state`` with the parts that format-2 checkpoints nest under "rl" (its "baseline"
    and "kl") under their names here ("rl_baseline", "kl_controller")."""
    if "rl" not in state:
        return state
    nested = state["rl"]
    flat = {k: v for k, v in state.items() if k != "rl"}
    flat.update({new: nested[old] for old, new in (("baseline", "rl_baseline"),
                                                   ("kl", "kl_controller")) if old in nested})
    return flat
