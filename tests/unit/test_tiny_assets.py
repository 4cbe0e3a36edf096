"""The embedded tiny model folder (``megatron_logra/assets/tiny-llama``) and its tokenizer.

The committed folder equals what ``write_tiny_model_dir`` generates, file for file; the
byte-level tokenizer round-trips any UTF-8 text (one id per byte, fixed special ids);
its chat template is ChatML, with special tokens as single ids.
"""

import filecmp

from megatron_logra.data.tokenizer import load_tokenizer
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT, write_tiny_model_dir


def test_committed_default_matches_generator(tmp_path):
    write_tiny_model_dir(tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in EMBEDDED_DEFAULT.iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path, EMBEDDED_DEFAULT, names, shallow=False)
    assert not mismatch and not errors


def test_byte_level_tokenizer_round_trips_any_text():
    tok = load_tokenizer(EMBEDDED_DEFAULT)
    text = "Calculate ( 56 + -33 ) - 84. ünïcødé ✓\n\ttabs"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.eos_token_id == 258 and tok.pad_token_id == 256


def test_chat_template_is_chatml():
    tok = load_tokenizer(EMBEDDED_DEFAULT)
    assert tok.prompt("2+2?") == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(tok.prompt("hi"))
    assert ids[0] == 257 and 258 in ids  # special tokens are single ids
