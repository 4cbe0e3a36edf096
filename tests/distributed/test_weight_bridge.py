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
match the trainer's to bf16 precision. Every layout also runs over the direct channel
(each trainer rank sends each vLLM worker its own pieces), with one engine restart;
PP2's engine then runs behind an engine host (``bridge.engine_host``, a process of its
own standing for another node), reached over its socket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_logra.runtime.device import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "bridge_worker.py"


KEY = "bridge-test-key"


@contextmanager
def _engine_host(tmp: Path):
    """An engine host (``bridge.engine_host``) in a process of its own, standing for
    another node: HOST:PORT once it listens."""
    address = f"127.0.0.1:{free_port()}"
    log = tmp / "engine_host.log"
    env = dict(os.environ, MEGATRON_LOGRA_ENGINE_KEY=KEY, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1", TMPDIR=str(tmp))
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "megatron_logra.bridge.engine_host",
                                 "--listen", address], env=env, stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while "listening" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield address
    finally:
        proc.terminate()  # its engine dies with it (PR_SET_PDEATHSIG)
        proc.wait(60)


def _launch(world: int, tmp: Path, remote_engine: str = "") -> dict:
    out = tmp / f"bridge{world}.json"
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               BRIDGE_REMOTE_ENGINE=remote_engine, MEGATRON_LOGRA_ENGINE_KEY=KEY)
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
        if world == 2:  # its pp2_direct layout's engine runs behind an engine host
            with _engine_host(tmp) as address:
                results.update(_launch(world, tmp, address))
        else:
            results.update(_launch(world, tmp))
    return results


LAYOUTS = ["tp1", "tp2", "pp2", "tp2pp2", "tp2pp2_engine_tp2"]


@pytest.mark.parametrize("channel", ["pipe", "direct"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_transport_is_bit_exact(layouts, layout, channel):
    """Both channels leave the engine holding the trainer's weights bit for bit after
    every push, so they give identical engine weights. The direct layouts lose their
    engine once: it restarts on dummy weights, rejoins and is resynced in full."""
    got = layouts[layout if channel == "pipe" else f"{layout}_direct"]
    assert got["transports"] == ["sparse-delta", "sketch-delta", "sketch-delta", "full"], got
    assert got["differing"] == [[]] * 4, got
    assert got["fingerprint_mismatches"] == 0
    assert got["refused"] and got["serving_after_refusal"]
    assert got["logprob_diff"] < 0.05, got  # bf16 engine vs bf16 trainer forward
    assert got["restarts"] == (1 if channel == "direct" else 0), got
    assert got["remote_engine"] == (layout == "pp2" and channel == "direct"), got


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_direct_channel_sends_each_worker_only_its_pieces(layouts, layout):
    """A direct full push is the model once (a TP2 engine: plus the norms and KV heads
    both workers hold, and ~100 bytes of header per message), not once per worker as the
    pipe's broadcast to the workers; its deltas stay a fraction of it."""
    pipe, direct = layouts[layout], layouts[f"{layout}_direct"]
    full = direct["full_bytes"]
    assert full == pipe["full_bytes"]
    assert full <= direct["bytes"][3] < 1.1 * full, direct["bytes"]
    assert direct["bytes"][1] < 0.3 * full and direct["bytes"][0] < 1.1 * full, direct["bytes"]


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
