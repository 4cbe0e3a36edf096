"""Self-contained tiny model folders: an HF ``config.json`` plus a byte-level tokenizer.

Nothing here downloads anything. The byte-level tokenizer has one token per byte
(256, GPT-2 byte alphabet, no merges) plus the ChatML special tokens, so any text
round-trips and a tiny model can learn character-level tasks quickly.

``write_tiny_model_dir`` builds the folder the launcher uses by default
(``megatron_logra/assets/tiny-llama``) and the tiny Llama/Qwen2/Qwen3 folders the
tests use. ``python -m megatron_logra.model.tiny_assets`` regenerates the embedded
default; a test checks the committed copy matches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

# ChatML, as SmolLM2/Qwen use it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

EMBEDDED_DEFAULT = Path(__file__).resolve().parent.parent / "assets" / "tiny-llama"

_FAMILY_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# The tiny variants the conversion tests cover: every supported feature at least once
# (tied/untied heads, qkv bias, q/k norm, head_dim != hidden/heads, one kv head < TP).
TINY_VARIANTS: dict[str, tuple[str, dict]] = {
    "llama_tied": ("llama", {}),
    "llama_untied_kv1": ("llama", {"tie_word_embeddings": False, "num_kv_heads": 1}),
    "qwen2_tied": ("qwen2", {}),
    "qwen2_untied": ("qwen2", {"tie_word_embeddings": False}),
    "qwen3_hd48": ("qwen3", {"head_dim": 48, "tie_word_embeddings": False}),
}


def _byte_alphabet() -> list[str]:
    """GPT-2's reversible byte -> unicode map, in byte order (256 symbols)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return [mapping[b] for b in range(256)]


def byte_level_tokenizer_json() -> dict:
    """The ``tokenizer.json`` of a byte-level BPE without merges (vocab 259)."""
    vocab = {symbol: i for i, symbol in enumerate(_byte_alphabet())}
    added = [
        {"id": 256 + i, "content": tok, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False,
                          "trim_offsets": True, "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False,
                    "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": []},
    }


def tiny_hf_config(family: str = "llama", *, hidden_size: int = 128, num_layers: int = 4,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 384,
                   head_dim: int | None = None, tie_word_embeddings: bool = True,
                   vocab_size: int = 384, max_position_embeddings: int = 1024) -> dict:
    """An HF ``config.json`` dict for a tiny decoder of the given family."""
    if family not in _FAMILY_ARCH:
        raise ValueError(f"unknown tiny family {family!r}; choose one of {sorted(_FAMILY_ARCH)}")
    arch, model_type = _FAMILY_ARCH[family]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "hidden_act": "silu",
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        "vocab_size": vocab_size,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "dtype": "float32",
    }
    if family == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if family == "qwen3":
        cfg.update(head_dim=head_dim or hidden_size // num_heads, attention_bias=False)
    elif head_dim is not None:
        cfg["head_dim"] = head_dim
    if family in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=num_layers)
    # Token ids of the byte-level tokenizer: <|endoftext|>=256, <|im_start|>=257, <|im_end|>=258.
    cfg.update(bos_token_id=257, eos_token_id=258, pad_token_id=256)
    return cfg


def write_tokenizer_files(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json(), indent=1,
                                                       ensure_ascii=False) + "\n")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHATML_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1) + "\n")
    special = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=1) + "\n")


def write_tiny_model_dir(out_dir: str | Path, family: str = "llama", **arch) -> Path:
    """Create an HF model folder (config + tokenizer, no weights) for a tiny model."""
    out = Path(out_dir)
    write_tokenizer_files(out)
    (out / "config.json").write_text(json.dumps(tiny_hf_config(family, **arch), indent=1) + "\n")
    gen = {"bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 256}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=1) + "\n")
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else EMBEDDED_DEFAULT
    print(f"wrote {write_tiny_model_dir(target)}")
