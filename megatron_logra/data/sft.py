"""Supervised samples: prompt + reference answer, loss on the answer tokens only.

The order of samples is a pure function of (seed, update index), so every
layout sees the same global batch at every step and a resumed run continues
exactly. Each data-parallel rank takes its contiguous slice of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_logra.data.tasks import TaskItem
from megatron_logra.data.tokenizer import TextTokenizer


@dataclass(frozen=True)
class EncodedSample:
    tokens: list[int]  # prompt + answer + eos, untruncated
    num_prompt_tokens: int


def encode_sft(tokenizer: TextTokenizer, item: TaskItem) -> EncodedSample:
    prompt = tokenizer.encode(tokenizer.prompt(item.question))
    answer = tokenizer.encode(item.answer) + [tokenizer.eos_token_id]
    return EncodedSample(prompt + answer, len(prompt))


def padded_length(longest: int, seq_length: int) -> int:
    """The sequence length one update pads to: its longest sequence rounded up to a multiple
    of 16, at most ``seq_length``. Short samples do not pay for --seq-length of compute."""
    return min(seq_length, -(-longest // 16) * 16)


def collate(samples: list[EncodedSample], seq_length: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Microbatch tensors, all [b, s] except attention_mask [b, 1, s, s] (True = masked).

    labels[t] = tokens[t + 1]; loss_mask[t] = 1 where labels[t] is an answer token.
    Sequences longer than seq_length + 1 are truncated (their tail is lost).
    """
    b = len(samples)
    tokens = torch.full((b, seq_length), pad_id, dtype=torch.long)
    labels = torch.full((b, seq_length), pad_id, dtype=torch.long)
    loss_mask = torch.zeros((b, seq_length), dtype=torch.float32)
    for i, sample in enumerate(samples):
        ids = torch.tensor(sample.tokens[: seq_length + 1], dtype=torch.long)
        n = ids.numel() - 1
        tokens[i, :n] = ids[:n]
        labels[i, :n] = ids[1:]
        start = max(sample.num_prompt_tokens - 1, 0)
        loss_mask[i, start:n] = 1.0
    causal = torch.triu(torch.ones(seq_length, seq_length, dtype=torch.bool), diagonal=1)
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_length).unsqueeze(0).expand(b, -1).contiguous(),
        "attention_mask": causal.expand(b, 1, seq_length, seq_length).contiguous(),
    }


def batch_indices(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices into n items of update ``step`` (0-based): consecutive batches walk epochs of
    seeded permutations, a pure function of (n, batch_size, step, seed)."""
    start = step * batch_size
    out: list[int] = []
    orders: dict[int, list[int]] = {}
    while len(out) < batch_size:
        epoch, offset = divmod(start + len(out), n)
        if epoch not in orders:
            gen = torch.Generator().manual_seed(seed * 100003 + epoch)
            orders[epoch] = torch.randperm(n, generator=gen).tolist()
        take = min(batch_size - len(out), n - offset)
        out.extend(orders[epoch][offset: offset + take])
    return out


class SFTBatches:
    """The global batch of every update, and this DP rank's microbatches of it."""

    def __init__(self, samples: list[EncodedSample], *, global_batch_size: int,
                 micro_batch_size: int, seq_length: int, pad_id: int, seed: int):
        """Samples that keep no answer token within ``seq_length`` (their prompt fills it)
        are left out (``dropped`` counts them): a batch of them would train on nothing and
        log a NaN loss. None left is an error naming the setting."""
        if not samples:
            raise ValueError("no training samples")
        kept = [x for x in samples if answer_tokens(x, seq_length) > 0]
        if not kept:
            need = min(x.num_prompt_tokens for x in samples) + 1
            raise ValueError(f"--seq-length {seq_length} keeps no answer token of any sample "
                             f"(the shortest prompt takes {need - 1} tokens): raise "
                             f"--seq-length to at least {need}")
        self.dropped = len(samples) - len(kept)
        self.samples = kept
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.pad_id = pad_id
        self.seed = seed

    def global_indices(self, step: int) -> list[int]:
        """Sample indices of update ``step`` (0-based), walking epochs of permutations."""
        return batch_indices(len(self.samples), self.global_batch_size, step, self.seed)

    def step_length(self, step: int) -> int:
        """Padded length of update ``step``: from the whole global batch, so every rank (and
        every pipeline stage's p2p shape) agrees."""
        longest = max(len(self.samples[i].tokens) - 1 for i in self.global_indices(step))
        return padded_length(longest, self.seq_length)

    def microbatches(self, step: int, dp_rank: int, dp_size: int) -> list[dict[str, torch.Tensor]]:
        """This DP rank's microbatches of update ``step``, each [mbs, step_length(step)]."""
        indices = self.global_indices(step)
        per_rank = self.global_batch_size // dp_size
        mine = indices[dp_rank * per_rank: (dp_rank + 1) * per_rank]
        length = self.step_length(step)
        return [collate([self.samples[i] for i in mine[j: j + self.micro_batch_size]],
                        length, self.pad_id)
                for j in range(0, per_rank, self.micro_batch_size)]


def answer_tokens(sample: EncodedSample, seq_length: int) -> int:
    """Loss tokens ``sample`` keeps at ``seq_length`` (``collate``'s loss mask)."""
    return max(min(len(sample.tokens) - 1, seq_length) - max(sample.num_prompt_tokens - 1, 0), 0)
