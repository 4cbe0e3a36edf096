"""HF transformers logits vs the megatron model loaded from a checkpoint, at any TP/PP.

Every rank builds its shard and loads the checkpoint through dist_checkpointing
(so this checks the conversion *and* the resharding); one rank of the last
pipeline stage also runs the HF model (the full model, fp32, on CPU) on the same
tokens. HF weights are first rounded to the dtype the checkpoint stores, so a
bf16 conversion is compared against the same bf16 weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

SAMPLE_TEXTS = (
    "The capital of France is Paris. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Question: what is 17 + 25? Answer: 42. Question: what is 3 * 14? Answer:",
)


@dataclass(frozen=True)
class VerifyResult:
    max_abs_diff: float
    tolerance: float
    tokens: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def sample_tokens(hf_dir: str | Path, vocab_size: int, rows: int = 2, length: int = 24) -> torch.Tensor:
    """[rows, length] token ids: the sample texts (one of them through the chat template),
    tokenized by the model's tokenizer, concatenated and cut into equal rows."""
    from megatron_logra.data.tokenizer import load_tokenizer

    tok = load_tokenizer(hf_dir)
    ids: list[int] = tok.encode(tok.prompt(SAMPLE_TEXTS[-1]))
    for text in SAMPLE_TEXTS:
        ids += tok.encode(text)
    while len(ids) < rows * length:
        ids += ids
    tokens = torch.tensor(ids[: rows * length]).reshape(rows, length)
    return tokens.clamp(max=vocab_size - 1)


def hf_reference_logits(hf_dir: str | Path, tokens: torch.Tensor,
                        weight_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """transformers' fp32 logits [b, s, V] with weights rounded to ``weight_dtype``."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = model.to(weight_dtype).float().eval()
    with torch.no_grad():
        return model(tokens).logits.float()


def _stored_dtype(ckpt_dir: Path) -> torch.dtype:
    from megatron_logra.convert.megatron_dcp import CheckpointReader

    md = CheckpointReader(ckpt_dir).metadata.state_dict_metadata
    return md["embedding.word_embeddings.weight"].properties.dtype


def logits_max_diff(model: list[torch.nn.Module], arch, hf_dir: str | Path,
                    weight_dtype: torch.dtype, device: torch.device,
                    reference: dict | None = None) -> tuple[float, int]:
    """(max |megatron logits - HF logits|, number of tokens) on the sample tokens, the same on
    every rank. ``model`` is this rank's loaded chunk list; one rank of the last stage runs
    transformers (its logits cached in ``reference`` by (folder, dtype) when given)."""
    from megatron_logra.model.logits import model_logits

    tokens = sample_tokens(hf_dir, arch.vocab_size)
    logits = model_logits(model, tokens, arch.vocab_size)
    reporter = (parallel_state.is_pipeline_last_stage()
                and parallel_state.get_tensor_model_parallel_rank() == 0
                and parallel_state.get_data_parallel_rank() == 0)
    diff = torch.tensor(-1.0, dtype=torch.float64)
    if reporter:
        key = (str(hf_dir), weight_dtype)
        ref = reference.get(key) if reference is not None else None
        if ref is None:
            ref = hf_reference_logits(hf_dir, tokens, weight_dtype)
            if reference is not None:
                reference[key] = ref
        diff.fill_(float((logits - ref).abs().max()))
    if dist.is_initialized() and dist.get_world_size() > 1:
        diff = diff.to(device)
        dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return float(diff), tokens.numel()


def check_logits_parity(hf_dir: str | Path, ckpt: str | Path, *, tensor_model_parallel_size: int = 1,
                      pipeline_model_parallel_size: int = 1, tolerance: float = 1e-4) -> VerifyResult:
    """Run on every rank (torchrun) or in one process; every rank returns the same result."""
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig, build_gpt_model
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize
    from megatron_logra.checkpoint.layout import resolve_load_dir
    from megatron_logra.checkpoint.load import load_model_weights

    rt = init_runtime()
    layout = ParallelConfig(tensor_model_parallel_size, pipeline_model_parallel_size)
    arch = load_arch(hf_dir)
    arch.check_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)
    ckpt_dir = resolve_load_dir(ckpt)
    initialize(layout, rt.world_size, seed=0)
    model = [build_gpt_model(arch, ModelBuildConfig(), seed=0)]
    load_model_weights(ckpt_dir, model, arch)
    diff, tokens = logits_max_diff(model, arch, hf_dir, _stored_dtype(ckpt_dir), rt.device)
    return VerifyResult(diff, tolerance, tokens, tensor_model_parallel_size,
                        pipeline_model_parallel_size)


def report(result: VerifyResult) -> str:
    return json.dumps({"max_abs_diff": result.max_abs_diff, "tolerance": result.tolerance,
                       "ok": result.ok, "tokens": result.tokens,
                       "tensor_model_parallel_size": result.tensor_model_parallel_size,
                       "pipeline_model_parallel_size": result.pipeline_model_parallel_size})
