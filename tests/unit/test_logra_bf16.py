"""bf16 precision modes of LoGRA, and reproducing an update in another process.

``--logra-master-weights none``: the trainer keeps bf16 weights only and applies
W <- SR(W - c D A) with counter-based stochastic rounding. A second Python process
given the same bf16 W and (D, c, seed) - nothing else - must produce bit-identical
weights, also when it holds the weight split in row or column blocks (other TP
layouts). Updates far below bf16 resolution must survive on average (unbiased),
where round-to-nearest would drop them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_logra.config import LograConfig, OptimizerConfig
from megatron_logra.logra.config import TARGETS
from megatron_logra.model.arch import load_arch
from megatron_logra.model.provider import ModelBuildConfig, unwrap
from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.runtime.device import init_runtime
from megatron_logra.runtime.parallel import ParallelConfig, initialize
from megatron_logra.testing.batches import random_microbatches
from megatron_logra.training.build import build_training_objects
from megatron_logra.training.step import forward_backward

RECEIVER = '''
import sys, torch
from megatron_logra.logra.low_rank_apply import apply_bf16_update
data = torch.load(sys.argv[1])
out = {}
for name, u in data.items():
    common = dict(rank=u["rank"], kind=u["kind"])
    whole = u["before"].clone()
    apply_bf16_update(whole, u["d"], u["coefficient"], u["seed"], global_rows=u["rows"],
                      col_offset=u["col_offset"], **common)
    # the same weight held as two column blocks and as two row blocks (other TP layouts)
    half_c, half_r = whole.shape[1] // 2, whole.shape[0] // 2
    cols = [u["before"][:, :half_c].clone(), u["before"][:, half_c:].clone()]
    for block, c0 in zip(cols, (0, half_c)):
        apply_bf16_update(block, u["d"], u["coefficient"], u["seed"], global_rows=u["rows"],
                          col_offset=u["col_offset"] + c0, **common)
    rows = [u["before"][:half_r].clone(), u["before"][half_r:].clone()]
    for block, r in zip(rows, (slice(0, half_r), slice(half_r, None))):
        apply_bf16_update(block, u["d"][r], u["coefficient"], u["seed"], global_rows=u["rows"][r],
                          col_offset=u["col_offset"], **common)
    out[name] = {"whole": whole, "cols": torch.cat(cols, 1), "rows": torch.cat(rows, 0)}
torch.save(out, sys.argv[2])
'''


def _one_update(tmp: Path, master: str, update_ratio: float):
    init_runtime()
    initialize(ParallelConfig(), 1, seed=3)
    # untied: the embedding's sketch then has the zero rows of unseen tokens
    arch = load_arch(write_tiny_model_dir(tmp / f"tiny-{master}", "llama",
                                          tie_word_embeddings=False))
    cfg = OptimizerConfig(name="logra", lr=1e-3, logra=LograConfig(
        rank=8, update_ratio=update_ratio, master_weights=master, targets=TARGETS))
    objs = build_training_objects(arch, ModelBuildConfig(bf16=True), cfg, seed=3, train_iters=2)
    objs.optimizer.keep_updates = True
    batch = random_microbatches(arch.vocab_size // 4, count=1, batch=2, seq=32, seed=1)
    objs.optimizer.zero_grad()
    forward_backward(objs.model, batch, seq_length=32, micro_batch_size=2,
                     vocab_size=arch.vocab_size)
    params = dict(unwrap(objs.model[0]).named_parameters())
    before = {s.name: params[s.name].detach().clone() for s in objs.optimizer.sketches.slots}
    assert objs.optimizer.step()[0]
    return objs, params, before


@pytest.fixture(scope="module")
def sr_run(tmp_path_factory):
    return _one_update(tmp_path_factory.mktemp("sr"), "none", 1e-5)


def test_another_process_reproduces_the_update_bit_exactly(sr_run, tmp_path):
    objs, params, before = sr_run
    sketches = objs.optimizer.sketches
    # the embedding's sketch has zero rows (tokens not in the batch): the trainer updates only
    # the others, the receiver all of them; the results must still agree bit for bit
    emb = objs.optimizer.last_updates["embedding.word_embeddings.weight"].d
    assert 0 < int((emb.abs().amax(1) > 0).sum()) < emb.shape[0] // 2
    payload = {}
    for slot in sketches.slots:
        u = objs.optimizer.last_updates[slot.name]
        assert params[slot.name].dtype == torch.bfloat16
        assert torch.equal(u.d, u.d.bfloat16().float())  # the payload is bf16
        payload[slot.name] = {"before": before[slot.name], "d": u.d, "coefficient": u.coefficient,
                              "seed": u.seed, "rows": slot.global_rows,
                              "col_offset": slot.col_offset, "rank": sketches.cfg.rank,
                              "kind": sketches.cfg.projection}
    torch.save(payload, tmp_path / "payload.pt")
    (tmp_path / "receiver.py").write_text(RECEIVER)
    proc = subprocess.run([sys.executable, str(tmp_path / "receiver.py"), str(tmp_path / "payload.pt"),
                           str(tmp_path / "out.pt")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(tmp_path / "out.pt")
    for name, views in got.items():
        for how, w in views.items():
            assert torch.equal(w, params[name].detach()), (name, how)


def test_sub_resolution_updates_survive_on_average(sr_run):
    """update_ratio 1e-5 is far below bf16's ~4e-3 relative step: the exact fp32 update's mean
    is recovered by the stochastically rounded weights, not lost as with round-to-nearest."""
    objs, params, before = sr_run
    from megatron_logra.logra.projection import projection_block

    dot = dot_nearest = norm = 0.0
    for slot in objs.optimizer.sketches.slots:
        u = objs.optimizer.last_updates[slot.name]
        w0 = before[slot.name].float()
        a = projection_block(u.seed, objs.optimizer.sketches.cfg.rank, (0, w0.shape[1]))
        exact = -u.coefficient * (u.d @ a)
        nearest = (w0 + exact).bfloat16().float() - w0
        got = params[slot.name].detach().float() - w0
        dot += float((got * exact).sum())
        dot_nearest += float((nearest * exact).sum())
        norm += float((exact * exact).sum())
    # W0 is on the bf16 grid, so round-to-nearest drops every element's change below half a
    # grid step; stochastic rounding keeps the expected change: projected onto the exact
    # update (all sketched weights together), its change has ratio ~1
    assert 0.8 < dot / norm < 1.2, dot / norm
    assert dot_nearest / norm < 0.5, dot_nearest / norm


def test_fp32_master_mode_keeps_a_master_and_rounds_from_it(tmp_path):
    objs, params, before = _one_update(tmp_path, "fp32", 1e-3)
    opt = objs.optimizer
    sizes = opt.state_bytes()
    assert sizes["masters"] == 4 * sum(p.numel() for p in opt.sketches.params)
    for slot, master in zip(opt.sketches.slots, opt.masters):
        assert master.dtype == torch.float32
        assert torch.equal(params[slot.name].detach(), master.bfloat16())
        assert not torch.equal(params[slot.name].detach(), before[slot.name])
