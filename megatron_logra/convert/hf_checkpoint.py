"""An HF model folder's safetensors weights, validated against its ``ModelArch``.

``HFCheckpoint(folder, arch)`` opens only the headers; it refuses, naming the file
and the fix, a folder whose index points to a missing shard, whose index and
shards disagree, that lacks a tensor the config needs (an untied config without
``lm_head.weight`` included: transformers would silently load a random head),
whose tensor shapes differ from what config.json implies, or that holds tensors
config.json does not describe. It is a ``TensorSource``: ``read`` returns only the
requested rows/columns, so each rank can read just its TP/PP shard.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from megatron_logra.convert.safetensors_io import CheckpointFormatError, SafetensorsFile
from megatron_logra.model.arch import ModelArch
from megatron_logra.model.hf_mapping import hf_param_shapes, megatron_from_hf
from megatron_logra.model.sharding import shard_ranges

INDEX = "model.safetensors.index.json"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers older exports saved; recomputed anyway


def _weight_files(folder: Path) -> dict[str, list[str] | None]:
    """{shard file: names the index assigns to it (None: no index)}."""
    index_path = folder / INDEX
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{index_path}: not a valid safetensors index ({exc!r}); "
                                        f"it needs a 'weight_map'") from None
        files: dict[str, list[str] | None] = {}
        for name, file in weight_map.items():
            files.setdefault(file, []).append(name)
        missing = [f for f in files if not (folder / f).is_file()]
        if missing:
            raise CheckpointFormatError(f"{index_path} names shard(s) missing from {folder}: "
                                        f"{missing}; copy the complete checkpoint")
        return files
    singles = sorted(p.name for p in folder.glob("*.safetensors"))
    if len(singles) == 1:
        return {singles[0]: None}
    if singles:
        raise CheckpointFormatError(f"{folder} holds {len(singles)} .safetensors files but no "
                                    f"{INDEX}; restore the index file")
    other = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    hint = (f" (found {other[:3]}: re-save it with transformers' save_pretrained("
            f"safe_serialization=True))" if other else "")
    raise CheckpointFormatError(f"{folder} holds no safetensors weights{hint}")


class HFCheckpoint:
    """A validated HF checkpoint folder; ``read(name, rows=, cols=)`` streams slices."""

    def __init__(self, folder: str | os.PathLike, arch: ModelArch):
        self.folder = Path(folder)
        self.arch = arch
        self._where: dict[str, SafetensorsFile] = {}
        for file, indexed in _weight_files(self.folder).items():
            shard = SafetensorsFile(self.folder / file)
            if indexed is not None:
                absent = [n for n in indexed if n not in shard.entries]
                if absent:
                    raise CheckpointFormatError(
                        f"{self.folder / INDEX} assigns {absent[:3]} to {file}, which does not hold "
                        f"them; the index and the shards come from different exports")
            for name in (indexed if indexed is not None else shard.entries):
                self._where[name] = shard
        self._validate()

    def _validate(self) -> None:
        arch, expected = self.arch, hf_param_shapes(self.arch)
        missing = [n for n in expected if n not in self._where]
        if "lm_head.weight" in missing:
            raise CheckpointFormatError(
                f"{self.folder}: config.json has tie_word_embeddings=false but the weights have no "
                f"lm_head.weight; if the head is tied to the embedding set tie_word_embeddings=true, "
                f"else restore lm_head.weight (transformers would load a random head)")
        if missing:
            raise CheckpointFormatError(f"{self.folder}: {len(missing)} tensor(s) config.json needs "
                                        f"are missing, e.g. {missing[:3]}; the checkpoint is "
                                        f"incomplete or belongs to another config")
        for name, shape in expected.items():
            entry = self._where[name].entries[name]
            if entry.shape != shape:
                raise CheckpointFormatError(
                    f"{self.folder}: {name} has shape {entry.shape} but config.json implies "
                    f"{shape}; config.json and the weights disagree")
            if not entry.dtype.is_floating_point:
                raise CheckpointFormatError(f"{self.folder}: {name} has dtype {entry.dtype}; "
                                            f"quantized checkpoints are not supported")
        unexpected = [n for n in self._where if n not in expected
                      and not n.endswith(_IGNORED_SUFFIXES)
                      and not (n == "lm_head.weight" and arch.tie_word_embeddings)]
        if unexpected:
            raise CheckpointFormatError(
                f"{self.folder}: the weights hold {len(unexpected)} tensor(s) config.json does not "
                f"describe, e.g. {sorted(unexpected)[:3]} (config.json says num_hidden_layers="
                f"{arch.num_layers}, tie_word_embeddings={arch.tie_word_embeddings}); config.json "
                f"and the weights disagree")

    def names(self) -> list[str]:
        """Every tensor name the folder holds."""
        return list(self._where)

    @property
    def files(self) -> list[Path]:
        return sorted({f.path for f in self._where.values()})

    def dtype(self) -> torch.dtype:
        return self._where["model.embed_tokens.weight"].entries["model.embed_tokens.weight"].dtype

    def read(self, name: str, rows: tuple[int, int] | None = None,
             cols: tuple[int, int] | None = None) -> torch.Tensor:
        return self._where[name].read(name, rows=rows, cols=cols)

    def megatron_shard(self, name: str, shape: tuple[int, ...], split: tuple[int, int] | None,
                       tp_rank: int, tp_size: int) -> torch.Tensor:
        """Rank ``tp_rank``'s shard of canonical megatron tensor ``name``, reading only it."""
        if split is None or tp_size == 1:
            return megatron_from_hf(self.arch, name, self)
        dim, stride = split
        ranges = shard_ranges(shape[dim], stride, tp_rank, tp_size)
        if dim == 0:
            return megatron_from_hf(self.arch, name, self, rows=ranges)
        if dim == 1 and stride == 1:
            return megatron_from_hf(self.arch, name, self, cols=ranges[0])
        raise NotImplementedError(f"{name}: partition dim {dim} with stride {stride}")


def is_hf_folder(path: str | os.PathLike) -> bool:
    """An HF model folder with weights (config.json + safetensors)."""
    folder = Path(path)
    return (folder / "config.json").is_file() and (
        (folder / INDEX).is_file() or any(folder.glob("*.safetensors")))


def load_hf_weights(model: list[torch.nn.Module], arch: ModelArch,
                    hf_dir: str | os.PathLike) -> None:
    """Fill this rank's model chunks from an HF folder, reading only this rank's TP slices of
    this pipeline stage's tensors straight from the safetensors files."""
    from megatron_logra.model.provider import assign_shard_values

    source = HFCheckpoint(hf_dir, arch)
    for chunk in model:
        assign_shard_values(chunk, arch, source.megatron_shard)
