"""The checkpoint folder layout, shared by training (save, resume) and conversion.

Layout::

    SAVE/latest                 text: name of the newest complete checkpoint
    SAVE/iter_0000010/          dist_checkpointing files + megatron_logra.json +
                                manifest.json (every file's size and CRC32, written last)
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

from megatron_logra.model import checkpoint_verify
from megatron_logra.model.provider import unwrap

LATEST = "latest"
META = "megatron_logra.json"
FORMAT_VERSION = 2  # 2: with manifest.json (model.checkpoint_verify); 1: without

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


def checkpoint_problems(ckpt: Path, rank: int = 0, world_size: int = 1) -> list[str]:
    """What is wrong with this rank's share of a checkpoint's files against its manifest
    (``model.checkpoint_verify``; every file with the defaults). A checkpoint of format 1
    (written before manifests) has nothing to check."""
    try:
        meta = read_meta(ckpt)
    except (OSError, ValueError) as exc:
        return [f"{ckpt / META} is unreadable ({type(exc).__name__})"] if rank == 0 else []
    if int(meta.get("format_version", 1)) < 2:
        return []
    return checkpoint_verify.check(ckpt, rank, world_size)


def require_intact(ckpt: Path) -> None:
    """Raise ValueError naming every damaged file (one process checks them all)."""
    problems = checkpoint_problems(ckpt)
    if problems:
        raise ValueError(f"checkpoint {ckpt} is damaged: " + "; ".join(problems))


def model_sharded_state_dict(model) -> dict:
    return unwrap(model[0]).sharded_state_dict()


def check_arch(meta: dict, arch, ckpt: Path) -> None:
    saved_arch = meta.get("arch")
    if saved_arch is not None and saved_arch != arch.to_dict():
        diff = {k: (saved_arch.get(k), v) for k, v in arch.to_dict().items()
                if saved_arch.get(k) != v}
        raise ValueError(f"checkpoint {ckpt} was saved for another model: (saved, now) = {diff}; "
                         f"pass the --model-dir it was trained with")


def without_missing_added_params(ckpt: Path, model: list, arch,
                                 model_sd: dict) -> tuple[dict, set[str]]:
    """``model_sd`` less the parameters a customization added (LoRA's adapters) that the
    checkpoint does not hold (a base model's checkpoint to start from: they keep their
    fresh values); returns (what to load, the state-dict keys left out)."""
    from megatron_logra.model.hf_mapping import megatron_param_names
    from megatron_logra.model.provider import canonical_param_names

    base = set(megatron_param_names(arch))
    added = {local.rsplit(".", 1)[-1]
             for local, canon in canonical_param_names(model[0], arch).items()
             if canon not in base}
    if not added:
        return model_sd, set()
    stored = set(dist_checkpointing.load_tensors_metadata(str(ckpt)))
    left_out = {k for k, v in model_sd.items() if k.rsplit(".", 1)[-1] in added
                and not any(key == v.key or key.startswith(f"{v.key}.") for key in stored)}
    return {k: v for k, v in model_sd.items() if k not in left_out}, left_out


def load_state_checked(model: list, state: dict, left_out: set[str]) -> None:
    """``load_state_dict`` of this rank's chunk: strict, except for the ``left_out`` keys."""
    missing, unexpected = unwrap(model[0]).load_state_dict(state, strict=False)
    wrong = [k for k in missing if k not in left_out] + list(unexpected)
    if wrong:
        raise KeyError(f"checkpoint and model differ in {wrong[:5]}")


def load_model_weights(load: str | os.PathLike, model: list, arch) -> dict:
    """Load only the weights of checkpoint ``load`` into ``model`` (this rank's chunks, any
    TP/PP layout); returns the checkpoint's meta. Added parameters (LoRA's adapters) the
    checkpoint lacks keep their values."""
    ckpt = resolve_load_dir(load)
    require_intact(ckpt)
    meta = read_meta(ckpt)
    check_arch(meta, arch, ckpt)
    model_sd, left_out = without_missing_added_params(ckpt, model, arch,
                                                     model_sharded_state_dict(model))
    loaded = dist_checkpointing.load({"model": model_sd}, str(ckpt))
    load_state_checked(model, loaded["model"], left_out)
    return meta
