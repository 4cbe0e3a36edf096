"""The checkpoint folder layout: names and selection, pure path work.

Layout::

    SAVE/latest                 text: name of the newest complete checkpoint
    SAVE/iter_0000010/          dist_checkpointing files + megatron_logra.json (``meta``)
                                + manifest.json (every file's size and CRC32, written last)
    SAVE/iter_0000020.partial/  a save in progress (or one that crashed: ignored)
    SAVE/iter_0000010.old/      the previous copy of a step saved again, while the new one
                                is moved in place (removed right after)

``checkpoint.save`` writes such folders, ``checkpoint.load`` opens them; training and the
converters (``convert.pipeline``) both go through them.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

LATEST = "latest"
META = "megatron_logra.json"
FORMAT_VERSION = 3  # 3: resumable parts by name (checkpoint.state); 2: with manifest.json
                    # (checkpoint.manifest); 1: without
PARTIAL, OLD = ".partial", ".old"


def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def is_complete(path: Path) -> bool:
    """A checkpoint folder whose save got as far as its meta (``manifest`` checks the rest)."""
    return path.is_dir() and (path / META).is_file()


def selected_name(root: Path) -> str | None:
    """The folder name ``root/latest`` selects (None without one)."""
    latest = root / LATEST
    return latest.read_text().strip() if latest.is_file() else None


def select(root: Path, name: str) -> None:
    """Point ``root/latest`` at ``name`` (replaced atomically)."""
    tmp = root / (LATEST + ".tmp")
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)


def resolve_load_dir(path: str | os.PathLike) -> Path:
    """A checkpoint folder from either SAVE (follows ``latest``) or one ``iter_*`` folder."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if (root / META).is_file():
        return root
    name = selected_name(root)
    if name is not None:
        if not is_complete(root / name):
            raise ValueError(f"{root / LATEST} points to {name}, which is not a complete "
                             f"checkpoint")
        return root / name
    if (root / "config.json").is_file():
        raise ValueError(f"{root} is an HF model folder, not a Megatron checkpoint: convert it with "
                         f"'python -m checkpoints_tools.hf_to_megatron --hf-dir {root} --out CKPT' "
                         f"(the trainer's --load takes it directly)")
    raise ValueError(f"{root} holds no checkpoint (no {LATEST} file and no {META})")


def resume_candidates(root: Path) -> list[Path]:
    """The ``iter_*`` folders of ``root`` to resume from, best first: the selected one, then
    the others newest first (partial and old copies left out)."""
    selected = selected_name(root) or ""
    return sorted((p for p in root.glob("iter_*") if p.is_dir()
                   and not p.name.endswith((PARTIAL, OLD))),
                  key=lambda p: (p.name == selected, p.name), reverse=True)


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` (>= 1) complete checkpoints of ``root``, never the
    one ``latest`` selects; returns the deleted folders."""
    selected = selected_name(root)
    done = sorted((p for p in root.glob("iter_*") if is_complete(p)
                   and not p.name.endswith((PARTIAL, OLD))), key=lambda p: p.name)
    deleted = [p for p in done[:-keep] if p.name != selected] if keep >= 1 else []
    for path in deleted:
        shutil.rmtree(path)
    return deleted
