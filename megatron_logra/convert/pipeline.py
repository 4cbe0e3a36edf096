"""HF folder <-> megatron-core checkpoint, streaming (memory ~ one layer tensor, not the model).

* ``hf_to_megatron``: validates the HF folder (``HFCheckpoint``), then writes
  ``OUT/iter_0000000`` + ``OUT/latest`` in megatron-core's torch_dist format, chunk by
  chunk, reading only the HF rows each chunk needs. It loads at any TP/PP/DP with
  ``dist_checkpointing`` (the trainer's ``--load``, ``verify``).
* ``megatron_to_hf``: reads a converted or trained checkpoint (any layout it was
  saved at) one parameter at a time and writes HF safetensors shards as it goes,
  plus config.json (dtype set), generation config and tokenizer files copied from
  ``--hf-config-from``.

Both build the result in a temporary folder renamed into place at the end.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from megatron_logra.checkpoint.load import open_checkpoint
from megatron_logra.checkpoint.meta import CheckpointMeta
from megatron_logra.checkpoint.save import commit_checkpoint
from megatron_logra.convert.hf_checkpoint import HFCheckpoint
from megatron_logra.convert.megatron_dcp import CheckpointReader, checkpoint_layout, write_checkpoint
from megatron_logra.convert.output_dir import atomic_output_dir
from megatron_logra.convert.safetensors_io import PlannedTensor, StreamingShardWriter
from megatron_logra.model.arch import ModelArch, load_arch
from megatron_logra.model.hf_mapping import (
    hf_from_megatron,
    megatron_from_hf,
    megatron_param_names,
    megatron_param_shape,
)
from megatron_logra.runtime.progress import Progress

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
              "added_tokens.json", "chat_template.jinja", "chat_template.json")
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

Log = Callable[[str], None]


def _print(msg: str) -> None:
    print(msg, flush=True)


def _init_single_process() -> None:
    """megatron's parallel state at TP=1/PP=1 in this process (needed to lay out keys)."""
    from megatron.core import parallel_state

    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    if (parallel_state.model_parallel_is_initialized()
            and parallel_state.get_tensor_model_parallel_world_size() == 1
            and parallel_state.get_pipeline_model_parallel_world_size() == 1):
        return
    rt = init_runtime()
    if rt.world_size != 1:
        raise RuntimeError("the converters run in one process; do not launch them with torchrun")
    initialize(ParallelConfig(), 1, seed=0)


def hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, *, dtype: torch.dtype,
                   overwrite: bool = False, log: Log = _print) -> Path:
    """Convert; returns ``out``. Raises ``CheckpointFormatError``/``UnsupportedModelError``/
    ``OutputExistsError`` (before writing anything) on bad input."""

    t0 = time.perf_counter()
    arch = load_arch(hf_dir)
    source = HFCheckpoint(hf_dir, arch)
    _init_single_process()
    layout = checkpoint_layout(arch)
    log(f"[hf_to_megatron] {hf_dir}: {arch.family}, {arch.num_layers} layers, "
        f"{len(source.files)} safetensors file(s) -> {len(layout.chunks)} chunks, {dtype}")
    progress = Progress("hf_to_megatron", len(layout.chunks), "chunks")

    def on_chunk(done: int, total: int, chunk) -> None:
        progress.update(done, chunk.param)

    meta = CheckpointMeta(step=0, arch=arch.to_dict(), weights_only=True,
                          source={"tool": "checkpoints_tools.hf_to_megatron",
                                  "hf_dir": str(Path(hf_dir).absolute()),
                                  "dtype": HF_DTYPE_NAMES[dtype]})
    with progress, atomic_output_dir(out, overwrite) as tmp:
        commit_checkpoint(tmp, meta, lambda ckpt: write_checkpoint(
            ckpt, layout, lambda c: megatron_from_hf(arch, c.param, source, rows=[c.rows]),
            dtype, on_chunk))
    log(f"[hf_to_megatron] wrote {out} in {time.perf_counter() - t0:.1f}s")
    return Path(out)


def export_config(hf_config_from: Path, dtype: torch.dtype) -> dict:
    cfg = json.loads((hf_config_from / "config.json").read_text())
    cfg["dtype"] = HF_DTYPE_NAMES[dtype]
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = HF_DTYPE_NAMES[dtype]
    return cfg


def _planned_hf_tensors(arch: ModelArch, dtype: torch.dtype) -> list[PlannedTensor]:
    planned = []
    for name in megatron_param_names(arch):
        meta = torch.empty(megatron_param_shape(arch, name), device="meta")
        planned += [PlannedTensor(hf, tuple(t.shape), dtype)
                    for hf, t in hf_from_megatron(arch, name, meta)]
    return planned


def megatron_to_hf(ckpt: str | os.PathLike, out: str | os.PathLike, *,
                   hf_config_from: str | os.PathLike, dtype: torch.dtype,
                   overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                   adapter_out: str | os.PathLike | None = None, log: Log = _print) -> Path:
    """Export a megatron checkpoint (SAVE dir or one iter_* folder) as an HF folder. A
    LoRA-trained checkpoint exports its merged weights W + (alpha / r) B A, and with
    ``adapter_out`` also its adapter in PEFT's format (``convert.lora_export``)."""
    from megatron_logra.convert import lora_export

    t0 = time.perf_counter()
    hf_config_from = Path(hf_config_from)
    arch = load_arch(hf_config_from)
    _init_single_process()
    ckpt_dir, meta = open_checkpoint(ckpt, arch)
    lora = lora_export.lora_of_checkpoint(meta)
    if adapter_out is not None and lora is None:
        raise ValueError(f"--adapter-out: {ckpt_dir} was not trained with --peft lora, it "
                         f"holds no adapter; drop --adapter-out")
    reader = CheckpointReader(ckpt_dir)
    build = None
    if lora is not None:
        from megatron_logra.lora.model_spec import LoraAdapters
        from megatron_logra.model.provider import ModelBuildConfig

        build = ModelBuildConfig(customization=LoraAdapters(lora))
    layout = checkpoint_layout(arch, build)
    adapted = lora_export.adapted_weights(layout.params())

    def read(name: str) -> torch.Tensor:
        return reader.read_param(layout, name)

    planned = _planned_hf_tensors(arch, dtype)
    with atomic_output_dir(out, overwrite) as tmp:
        writer = StreamingShardWriter(tmp, planned, max_shard_bytes)
        log(f"[megatron_to_hf] {ckpt_dir} -> {len(writer.shards)} shard(s), "
            f"{writer.total_bytes / 1e6:.1f} MB {dtype}")
        names = megatron_param_names(arch)
        with Progress("megatron_to_hf", len(names), "parameters") as progress:
            for done, name in enumerate(names, 1):
                full = lora_export.merged_param(read, name, lora, adapted)
                for hf_name, tensor in hf_from_megatron(arch, name, full):
                    writer.write(hf_name, tensor)
                del full
                shard = min(writer.shard_of_next() + 1, len(writer.shards))
                progress.update(done, f"shard {shard}/{len(writer.shards)}")
        writer.close()
        (tmp / "config.json").write_text(json.dumps(export_config(hf_config_from, dtype),
                                                    indent=2) + "\n")
        copied = [f for f in SIDE_FILES if (hf_config_from / f).is_file()]
        for name in copied:
            shutil.copy2(hf_config_from / name, tmp / name)
        if not any(f.startswith("tokenizer") for f in copied):
            log(f"[megatron_to_hf] note: {hf_config_from} has no tokenizer files to copy")
        if adapted:
            log(f"[megatron_to_hf] merged the LoRA adapters of {len(adapted)} weights "
                f"(alpha / r = {lora.alpha / lora.rank:g})")
    if adapter_out is not None:
        with atomic_output_dir(adapter_out, overwrite) as tmp:
            targets = lora_export.write_peft_adapter(tmp, arch, read, adapted, lora,
                                                     str(hf_config_from.absolute()), dtype)
        log(f"[megatron_to_hf] wrote the PEFT adapter ({', '.join(targets)}) to {adapter_out}")
    log(f"[megatron_to_hf] wrote {out} in {time.perf_counter() - t0:.1f}s")
    return Path(out)
