"""SFT data (``data/sft.py``, ``data/tasks.py``, ``data/tokenizer.py``) against hand-built cases.

Collation shifts labels by one, masks the loss to the answer tokens (and EOS) only,
pads and truncates to ``--seq-length`` and builds a causal mask; encoding applies the
chat template and appends EOS; the sample order is a function of the step (each epoch
covers every sample once) and DP ranks partition the global batch exactly; task
mixtures follow their weights and reasoning-gym items are deterministic per seed; a
sentencepiece ``tokenizer.model`` round-trips text and is picked up from a folder.
"""

import pytest
import torch

from megatron_logra.data.sft import EncodedSample, SFTBatches, answer_tokens, collate, encode_sft
from megatron_logra.data.tasks import TaskItem, generate_items, mixture_counts
from megatron_logra.data.tokenizer import SentencePieceTokenizer, load_tokenizer
from megatron_logra.model.tiny_assets import EMBEDDED_DEFAULT


def test_collate_masks_only_answer_tokens():
    sample = EncodedSample(tokens=[10, 11, 12, 20, 21, 2], num_prompt_tokens=3)
    mb = collate([sample], seq_length=8, pad_id=0)
    assert mb["tokens"][0].tolist() == [10, 11, 12, 20, 21, 0, 0, 0]
    assert mb["labels"][0, :5].tolist() == [11, 12, 20, 21, 2]
    # positions whose label is an answer token (20, 21, eos)
    assert mb["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0]
    assert mb["attention_mask"].shape == (1, 1, 8, 8)
    assert mb["attention_mask"][0, 0, 0, 1] and not mb["attention_mask"][0, 0, 1, 0]


def test_collate_truncates_long_samples():
    sample = EncodedSample(tokens=list(range(1, 20)), num_prompt_tokens=2)
    mb = collate([sample], seq_length=8, pad_id=0)
    assert mb["tokens"][0].tolist() == list(range(1, 9))
    assert mb["labels"][0].tolist() == list(range(2, 10))
    assert mb["loss_mask"][0].sum() == 7


def test_encode_uses_chat_template_and_eos():
    tok = load_tokenizer(EMBEDDED_DEFAULT)
    enc = encode_sft(tok, TaskItem("t", "1+1?", "2", 0))
    assert tok.decode(enc.tokens[: enc.num_prompt_tokens]).endswith("assistant\n")
    assert enc.tokens[enc.num_prompt_tokens:] == tok.encode("2") + [tok.eos_token_id]


def _batches(n=10, gbs=4):
    samples = [EncodedSample([i + 1, i + 2, i + 3], 1) for i in range(n)]
    return SFTBatches(samples, global_batch_size=gbs, micro_batch_size=1, seq_length=4,
                      pad_id=0, seed=3)


def test_sample_order_is_a_function_of_step():
    a, b = _batches(), _batches()
    assert [a.global_indices(s) for s in range(6)] == [b.global_indices(s) for s in range(6)]
    # one epoch covers each sample once (10 samples, batches of 4 cross the epoch boundary)
    first_epoch = sum((a.global_indices(s) for s in range(3)), [])[:10]
    assert sorted(first_epoch) == list(range(10))


def test_dp_ranks_partition_the_global_batch():
    data = _batches(gbs=4)
    whole = torch.cat([mb["tokens"] for mb in data.microbatches(2, 0, 1)])
    parts = torch.cat([mb["tokens"] for r in range(2) for mb in data.microbatches(2, r, 2)])
    assert torch.equal(whole, parts)


def test_updates_pad_to_their_longest_sample_not_to_seq_length():
    from megatron_logra.data.sft import padded_length

    assert [padded_length(n, 64) for n in (1, 16, 17, 40, 63, 200)] == [16, 16, 32, 48, 64, 64]
    short = EncodedSample(list(range(10)), 4)  # 9 (input, label) positions -> 16
    long = EncodedSample(list(range(30)), 4)  # 29 -> 32
    data = SFTBatches([short, long], global_batch_size=2, micro_batch_size=1, seq_length=192,
                      pad_id=0, seed=3)
    assert data.step_length(0) == 32
    # both DP ranks pad to the global batch's longest, whichever sample each holds
    shapes = {tuple(mb["tokens"].shape) for r in range(2) for mb in data.microbatches(0, r, 2)}
    assert shapes == {(1, 32)}
    # the padded tail is inert: same tokens, labels and loss mask as collate at seq_length
    for mb, full in zip(data.microbatches(0, 0, 1),
                        (collate([data.samples[i]], 192, 0) for i in data.global_indices(0))):
        for key in ("tokens", "labels", "loss_mask"):
            assert torch.equal(mb[key], full[key][:, :32]) and not full[key][:, 32:].any()


def test_mixture_counts_follow_weights():
    assert mixture_counts((("a", 1.0), ("b", 3.0)), 10) in ([3, 7], [2, 8])
    assert sum(mixture_counts((("a", 1.0), ("b", 1.0), ("c", 1.0)), 10)) == 10


def test_reasoning_gym_items_are_deterministic():
    a = generate_items((("basic_arithmetic", 1.0), ("letter_counting", 1.0)), 6, seed=5)
    b = generate_items((("basic_arithmetic", 1.0), ("letter_counting", 1.0)), 6, seed=5)
    assert a == b and {x.task for x in a} == {"basic_arithmetic", "letter_counting"}


def test_sentencepiece_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"Calculate {i} + {i * 3} = {i * 4}." for i in range(300)))
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "sp"),
                                   vocab_size=64, model_type="bpe", eos_id=2, pad_id=3,
                                   bos_id=1, unk_id=0)
    tok = load_tokenizer(EMBEDDED_DEFAULT, tmp_path / "sp.model")
    assert isinstance(tok, SentencePieceTokenizer)
    assert tok.decode(tok.encode("Calculate 7 + 21 = 28.")) == "Calculate 7 + 21 = 28."
    assert tok.eos_token_id == 2 and tok.pad_token_id == 3
    # a folder with only tokenizer.model is picked up too
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "tokenizer.model").write_bytes((tmp_path / "sp.model").read_bytes())
    assert isinstance(load_tokenizer(tmp_path / "only"), SentencePieceTokenizer)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(tmp_path)


def test_samples_without_an_answer_token_are_left_out_and_none_left_is_an_error():
    """--seq-length too short for the prompts used to train on 0 tokens and log loss nan;
    a sample whose prompt fills --seq-length is left out (counted), none left is refused."""
    fits = EncodedSample([1, 2, 3, 4], 2)  # prompt 2, answer 2: 2 loss tokens at seq 4
    cut = EncodedSample([1, 2, 3, 4, 5, 6, 7], 5)  # prompt 5: none at seq 4
    data = SFTBatches([fits, cut, fits], global_batch_size=2, micro_batch_size=1,
                      seq_length=4, pad_id=0, seed=3)
    assert data.dropped == 1 and data.samples == [fits, fits]
    assert all(sum(answer_tokens(data.samples[i], 4) for i in data.global_indices(s)) == 4
               for s in range(5))
    with pytest.raises(ValueError, match="--seq-length 4 keeps no answer token.*at least 6"):
        SFTBatches([cut], global_batch_size=1, micro_batch_size=1, seq_length=4, pad_id=0,
                   seed=3)


def test_sft_with_a_seq_length_below_every_prompt_stops_with_the_setting(tmp_path):
    """The run a new user tried: --seq-length 5 on the tiny model's gcd prompts."""
    import subprocess
    import sys
    from pathlib import Path

    launch = Path(__file__).resolve().parents[2] / "launch" / "pretrain_rl.py"
    proc = subprocess.run([sys.executable, str(launch), "--stage", "sft", "--task", "gcd",
                           "--seq-length", "5", "--train-iters", "2", "--dataset-size", "20",
                           "--global-batch-size", "2", "--micro-batch-size", "2",
                           "--output-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0
    assert "--seq-length 5 keeps no answer token" in proc.stdout + proc.stderr
    assert "loss nan" not in proc.stdout
