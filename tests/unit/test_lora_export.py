"""A LoRA-trained checkpoint exports to HF (merged) and to PEFT (adapter) with the trainer's logits.

A tiny Qwen2 HF folder (untied, qkv bias, gated MLP) is fine-tuned for 3 updates with
``--peft lora`` and saved. ``megatron_to_hf`` then writes the merged model and, with
``adapter_out``, the adapter in PEFT's format. On the same token rows the per-token
logprobs of (a) the trainer's model after training, (b) transformers loading the merged
export and (c) ``peft.PeftModel`` loading the adapter onto the base folder agree within
1e-5 (fp32); the base alone differs by far more (the adapters moved), so the checks
would see an export that dropped them.
"""

from __future__ import annotations

import json

import pytest
import torch

TOLERANCE = 1e-5


def _logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    import transformers

    from megatron_logra.cli import parse_run_config
    from megatron_logra.convert.pipeline import megatron_to_hf
    from megatron_logra.model.logits import model_logits
    from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint
    from megatron_logra.training.sft import run_sft

    tmp = tmp_path_factory.mktemp("lora_export")
    base = write_tiny_hf_checkpoint(tmp / "base", "qwen2", seed=4)
    argv = ["--load", str(base), "--peft", "lora", "--lora-rank", "4", "--lora-alpha", "8",
            "--train-iters", "3", "--lr", "5e-2", "--global-batch-size", "4", "--seq-length",
            "64", "--dataset-size", "32", "--save", str(tmp / "ckpt"),
            "--output-dir", str(tmp / "run")]
    result = run_sft(parse_run_config(argv, world_size=1))
    arch = result.objects.arch
    tokens = torch.randint(0, arch.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    trainer = _logprobs(model_logits(result.objects.model, tokens, arch.vocab_size), tokens)
    megatron_to_hf(tmp / "ckpt", tmp / "merged", hf_config_from=base, dtype=torch.float32,
                   adapter_out=tmp / "adapter")

    def hf_logprobs(model) -> torch.Tensor:
        with torch.no_grad():
            return _logprobs(model.eval()(tokens).logits, tokens)

    load = transformers.AutoModelForCausalLM.from_pretrained
    return {"trainer": trainer, "tmp": tmp, "base_path": base, "hf_logprobs": hf_logprobs,
            "merged": hf_logprobs(load(tmp / "merged", dtype=torch.float32)),
            "base": hf_logprobs(load(base, dtype=torch.float32)), "load": load}


def test_merged_export_scores_as_the_trainer(exported):
    diff = (exported["merged"] - exported["trainer"]).abs().max().item()
    assert diff <= TOLERANCE, diff
    assert (exported["base"] - exported["trainer"]).abs().max().item() > 100 * TOLERANCE


def test_peft_loads_the_adapter_with_the_trainers_logits(exported):
    from peft import PeftModel

    base = exported["load"](exported["base_path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, exported["tmp"] / "adapter")
    diff = (exported["hf_logprobs"](model) - exported["trainer"]).abs().max().item()
    assert diff <= TOLERANCE, diff
    config = json.loads((exported["tmp"] / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8.0)
    assert sorted(config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


def test_adapter_out_refuses_a_checkpoint_without_adapters(exported, tmp_path):
    from megatron_logra.convert.pipeline import hf_to_megatron, megatron_to_hf

    plain = hf_to_megatron(exported["base_path"], tmp_path / "plain", dtype=torch.float32)
    with pytest.raises(ValueError, match="not trained with --peft lora"):
        megatron_to_hf(plain, tmp_path / "out", hf_config_from=exported["base_path"],
                       dtype=torch.float32, adapter_out=tmp_path / "adapter")


def test_lora_starts_from_a_base_megatron_checkpoint(exported, tmp_path):
    """--peft lora --load BASE_CKPT --finetune: the checkpoint has no adapters, so they keep
    their fresh values (B = 0) and the first loss is the base model's, as a dense run from
    the same checkpoint sees it."""
    from megatron_logra.cli import parse_run_config
    from megatron_logra.convert.pipeline import hf_to_megatron
    from megatron_logra.training.sft import run_sft

    plain = hf_to_megatron(exported["base_path"], tmp_path / "plain", dtype=torch.float32)
    common = ["--model-dir", str(exported["base_path"]), "--load", str(plain), "--finetune",
              "--train-iters", "1", "--global-batch-size", "4", "--seq-length", "64",
              "--dataset-size", "32"]
    dense = run_sft(parse_run_config([*common, "--output-dir", str(tmp_path / "d")], 1))
    lora = run_sft(parse_run_config([*common, "--peft", "lora", "--output-dir",
                                     str(tmp_path / "l")], 1))
    a, b = dense.records[0]["loss"], lora.records[0]["loss"]
    assert abs(a - b) <= 1e-6 * abs(a), (a, b)
