"""Random token batches for train steps: what the tests and benchmarks feed megatron."""

from __future__ import annotations

import torch

from megatron_logra.model.logits import causal_inputs


def random_microbatches(vocab: int, *, count: int, batch: int, seq: int,
                        seed: int | torch.Generator,
                        mask_fraction: float | None = None) -> list[dict[str, torch.Tensor]]:
    """``count`` microbatches of uniform random tokens in [0, vocab), each a dict of
    tokens [batch, seq] and its causal inputs (``model.logits.causal_inputs``: position_ids
    [batch, seq], attention_mask [batch, 1, seq, seq]), labels [batch, seq] (the tokens
    shifted left by one, wrapping) and an fp32 loss_mask [batch, seq].

    ``seed``: an int seeds a new CPU generator; a generator is drawn from (and left
    advanced). Per microbatch the generator draws the tokens, then, only when
    ``mask_fraction`` is given, a uniform [batch, seq] whose entries below it are masked
    (loss_mask 0; ``mask_fraction=0.0`` draws it and masks nothing). Without it the mask
    is all ones. The draws' order is fixed: a caller's batches are the same run to run.
    """
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    out = []
    for _ in range(count):
        tokens = torch.randint(0, vocab, (batch, seq), generator=g)
        mb = causal_inputs(tokens)
        mb["labels"] = torch.roll(tokens, -1, dims=1)
        mb["loss_mask"] = (torch.ones(batch, seq) if mask_fraction is None else
                           (torch.rand(batch, seq, generator=g) >= mask_fraction).float())
        out.append(mb)
    return out
