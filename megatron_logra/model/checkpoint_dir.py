"""The checkpoint folder layout, shared by training (save, resume) and conversion.

Layout::

    SAVE/latest                 text: name of the newest complete checkpoint
    SAVE/iter_0000010/          dist_checkpointing files + megatron_logra.json
    SAVE/iter_0000020.partial/  a save in progress (or one that crashed: ignored)

``training.checkpointing`` writes such folders (atomically) with the optimizer;
``convert`` writes weights-only ones; both read them through this module, which sits
below both.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megatron.core import dist_checkpointing

from megatron_logra.model.provider import unwrap

LATEST = "latest"
META = "megatron_logra.json"
FORMAT_VERSION = 1

def iter_dir_name(step: int) -> str:
    return f"iter_{step:07d}"


def resolve_load_dir(path: str | os.PathLike) -> Path:
    """A checkpoint folder from either SAVE (follows ``latest``) or one ``iter_*`` folder."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"{root} does not exist")
    if (root / META).is_file():
        return root
    latest = root / LATEST
    if latest.is_file():
        target = root / latest.read_text().strip()
        if not (target / META).is_file():
            raise ValueError(f"{latest} points to {target.name}, which is not a complete checkpoint")
        return target
    if (root / "config.json").is_file():
        raise ValueError(f"{root} is an HF model folder, not a Megatron checkpoint: convert it with "
                         f"'python -m checkpoints_tools.hf_to_megatron --hf-dir {root} --out CKPT' "
                         f"(the trainer's --load takes it directly)")
    raise ValueError(f"{root} holds no checkpoint (no {LATEST} file and no {META})")


def read_meta(ckpt_dir: str | os.PathLike) -> dict:
    return json.loads((Path(ckpt_dir) / META).read_text())


def model_sharded_state_dict(model) -> dict:
    return unwrap(model[0]).sharded_state_dict()


def check_arch(meta: dict, arch, ckpt: Path) -> None:
    saved_arch = meta.get("arch")
    if saved_arch is not None and saved_arch != arch.to_dict():
        diff = {k: (saved_arch.get(k), v) for k, v in arch.to_dict().items()
                if saved_arch.get(k) != v}
        raise ValueError(f"checkpoint {ckpt} was saved for another model: (saved, now) = {diff}; "
                         f"pass the --model-dir it was trained with")


def load_model_weights(load: str | os.PathLike, model: list, arch) -> dict:
    """Load only the weights of checkpoint ``load`` into ``model`` (this rank's chunks, any
    TP/PP layout); returns the checkpoint's meta."""
    ckpt = resolve_load_dir(load)
    meta = read_meta(ckpt)
    check_arch(meta, arch, ckpt)
    loaded = dist_checkpointing.load({"model": model_sharded_state_dict(model)}, str(ckpt))
    unwrap(model[0]).load_state_dict(loaded["model"], strict=True)
    return meta
