"""Weight sync into a real vLLM engine: full, sparse-delta and sketch-delta, bit-exact.

Launches ``bridge_worker.py`` at world sizes 1, 2 and 4: trainer TP1, TP2, PP2 and
TP2 x PP2, each into a vLLM TP1 engine, and TP2 x PP2 into a vLLM TP2 engine; bf16
weights, LoGRA in SR mode
(``--logra-master-weights none``) on every target (qkv, proj, fc1, fc2, and the tied
embedding, split over the stages at PP2); a bf16 engine. Four updates are pushed as
sparse-delta (each sender's changed elements), sketch-delta (each rank sends only its
own rows of D; the engine regenerates A and applies the update in place to its live, sharded parameters),
sketch-delta, full. After every push every HF tensor the engine holds equals the
trainer's bit for bit; the fingerprints never disagreed; a delta on the wrong base
version is refused with the previous version still serving; the engine's logprobs
match the trainer's to bf16 precision.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "bridge_worker.py"


def _launch(world: int, tmp: Path) -> dict:
    out = tmp / f"bridge{world}.json"
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), str(WORKER), str(out), str(tmp / "runs")]
    proc = subprocess.run(cmd, cwd=WORKER.parent, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("bridge")
    results = {}
    for world in (1, 2, 4):
        results.update(_launch(world, tmp))
    return results


LAYOUTS = ["tp1", "tp2", "pp2", "tp2pp2", "tp2pp2_engine_tp2"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_transport_is_bit_exact(layouts, layout):
    got = layouts[layout]
    assert got["transports"] == ["sparse-delta", "sketch-delta", "sketch-delta", "full"], got
    assert got["differing"] == [[]] * 4, got
    assert got["fingerprint_mismatches"] == 0
    assert got["refused"] and got["serving_after_refusal"]
    assert got["logprob_diff"] < 0.05, got  # bf16 engine vs bf16 trainer forward


def test_deltas_send_a_fraction_of_the_weights(layouts):
    """Sketch delta: rank 16 of in >= 128 for the sketched weights (+ the trained small
    tensors in full; frozen ones are not sent), about the same at every layout (each TP
    rank's rows are its own runs). Sparse delta: the bf16 elements that changed, a tensor
    dense when that is smaller."""
    trained, frozen = layouts["tp2pp2"], layouts["tp2pp2_engine_tp2"]
    assert frozen["bytes"][1] < trained["bytes"][1]  # the norms are not resent
    for name in LAYOUTS:
        got = layouts[name]
        ref = frozen if name.endswith("_engine_tp2") else trained
        sparse, sketch, full = got["bytes"][0], got["bytes"][1], got["bytes"][3]
        assert sketch == pytest.approx(ref["bytes"][1], rel=0.02), (name, got["bytes"])
        assert full == ref["full_bytes"] == got["full_bytes"]
        # this test's steps are large (norm ratio 2e-2): most bf16 elements change, and
        # such tensors go dense; never more than the full push plus names
        assert sketch < 0.2 * full and sparse < 1.01 * full, (name, got["bytes"])
