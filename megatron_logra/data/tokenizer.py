"""Tokenizers: an HF folder (tokenizer.json / tokenizer_config.json) or a sentencepiece model.

Both expose the small interface the trainer needs: ``encode``, ``decode``,
``eos_token_id``, ``pad_token_id`` and ``prompt(question)`` (the chat template
when the tokenizer has one, else the plain question).
"""

from __future__ import annotations

from pathlib import Path


class TextTokenizer:
    eos_token_id: int
    pad_token_id: int
    has_chat_template: bool = False

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def prompt(self, question: str) -> str:
        """Text that precedes the model's answer."""
        return question + "\n"


class HFTokenizer(TextTokenizer):
    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        if self.tok.eos_token_id is None:
            raise ValueError(f"tokenizer in {model_dir} defines no eos_token")
        self.eos_token_id = int(self.tok.eos_token_id)
        pad = self.tok.pad_token_id
        self.pad_token_id = int(pad if pad is not None else self.eos_token_id)
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def prompt(self, question: str) -> str:
        if not self.has_chat_template:
            return super().prompt(question)
        return self.tok.apply_chat_template([{"role": "user", "content": question}],
                                            tokenize=False, add_generation_prompt=True)


class SentencePieceTokenizer(TextTokenizer):
    def __init__(self, model_file: str | Path):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=str(model_file))
        if self.sp.eos_id() < 0:
            raise ValueError(f"sentencepiece model {model_file} has no eos piece")
        self.eos_token_id = int(self.sp.eos_id())
        self.pad_token_id = int(self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_token_id)

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


def load_tokenizer(model_dir: str | Path, tokenizer_model: str | Path | None = None) -> TextTokenizer:
    """``tokenizer_model`` (sentencepiece) wins; else the folder's HF tokenizer, else its tokenizer.model."""
    if tokenizer_model:
        return SentencePieceTokenizer(tokenizer_model)
    folder = Path(model_dir)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return HFTokenizer(folder)
    if (folder / "tokenizer.model").is_file():
        return SentencePieceTokenizer(folder / "tokenizer.model")
    raise FileNotFoundError(f"{folder} has no tokenizer.json, tokenizer_config.json or "
                            f"tokenizer.model; pass --tokenizer-model FILE")
