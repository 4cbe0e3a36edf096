"""Weight sync into a real vLLM engine: full, sparse-delta and sketch-delta, bit-exact.

Launches ``weight_sync_worker.py`` at world sizes 1, 2 and 4: trainer TP1 and PP2 into a vLLM
TP1 engine, and TP2 x PP2 (both splits at once) into a vLLM TP2 engine (a TP2 trainer's
sketch deltas into TP1 engines: ``test_async_rollouts.py``); bf16 weights, LoGRA in SR mode
(``--logra-master-weights none``) on every target (qkv, proj, fc1, fc2, and the tied
embedding, split over the stages at PP2); a bf16 engine. Four updates are pushed as
sparse-delta (each sender's changed elements), sketch-delta (each rank sends only its
own rows of D; the engine regenerates A and applies the update in place to its live, sharded parameters),
sketch-delta, full. After every push every parameter the server holds equals the
trainer's bit for bit (vLLM's checksums); a delta on the wrong base version is refused
with the previous version still serving; the engine's logprobs
match the trainer's to bf16 precision. The engine is vLLM's own server (each trainer
rank sends each server worker its own pieces, through vLLM's weight-transfer routes and
this project's ``mlogra`` backend; the server's weights checked by vLLM's checksums),
which trainer rank 0 starts and which is killed once on the way at TP1 and at TP2 x PP2
into a TP2 server; PP2 goes into a server
the test starts (``--rollout-engine-url``, standing for another node).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest

from megatron_logra.runtime.device import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "weight_sync_worker.py"


@contextmanager
def _server(tmp: Path):
    """vLLM's server on a tiny model (TP1, bf16) as a user starts it (docs/usage.md), in a
    process of its own standing for another node: (URL, model folder)."""
    from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint

    model = write_tiny_hf_checkpoint(tmp / "server_model")
    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", MLOGRA_LIVE_WEIGHTS="1",
               VLLM_ENABLE_V1_MULTIPROCESSING="0", TMPDIR=str(tmp))
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "96",
            "--enforce-eager", "--kv-cache-memory-bytes", "256M", "--max-num-seqs", "64",
            "--max-num-batched-tokens", "6144", "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", '{"backend": "mlogra"}']
    with open(tmp / "server.log", "w") as sink:
        proc = subprocess.Popen(argv, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        yield f"http://127.0.0.1:{port}", model
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def _launch(world: int, tmp: Path, server: tuple[str, Path] | None = None) -> dict:
    out = tmp / f"weight_sync{world}.json"
    url, model = server or ("", "")
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1",
               WEIGHT_SYNC_ENGINE_URL=url, WEIGHT_SYNC_MODEL_DIR=str(model))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), str(WORKER), str(out), str(tmp / "runs")]
    proc = subprocess.run(cmd, cwd=WORKER.parent, env=env, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("weight_sync")
    results = {}
    for world in (1, 2, 4):
        if world == 2:  # its pp2 layout's engine is a server the test started
            with _server(tmp) as server:
                results.update(_launch(world, tmp, server))
        else:
            results.update(_launch(world, tmp))
    return results


LAYOUTS = ["tp1", "pp2", "tp2pp2_engine_tp2"]
KILLED = ("tp1", "tp2pp2_engine_tp2")  # weight_sync_worker.KILLED


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_transport_is_bit_exact(layouts, layout):
    """After every push the server holds the trainer's weights bit for bit (vLLM's
    checksums). TP1 and TP2 x PP2 into a TP2 server lose their server once (rank 0 started
    it): a fresh one starts on dummy weights, joins and is resynced in full; PP2 goes into
    the test's server."""
    got = layouts[layout]
    assert got["transports"] == ["sparse-delta", "sketch-delta", "sketch-delta", "full"], got
    assert got["differing"] == [[]] * 4, got
    assert got["checksum_mismatches"] == 0
    assert got["refused"] and got["serving_after_refusal"]
    assert got["logprob_diff"] < 0.05, got  # bf16 engine vs bf16 trainer forward
    assert got["restarts"] == (1 if layout in KILLED else 0), got
    assert got["remote_engine"] == (layout == "pp2"), got


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_worker_receives_only_its_pieces(layouts, layout):
    """A full push is the model once (a TP2 server: plus the norms and KV heads both
    workers hold, and ~100 bytes of header per message), not once per worker; its deltas
    stay a fraction of it."""
    got = layouts[layout]
    full = got["full_bytes"]
    assert full <= got["bytes"][3] < 1.1 * full, got["bytes"]
    assert got["bytes"][1] < 0.3 * full and got["bytes"][0] < 1.1 * full, got["bytes"]


def test_deltas_send_a_fraction_of_the_weights(layouts):
    """Sketch delta: rank 16 of in >= 128 for the sketched weights (+ the trained small
    tensors in full; frozen ones are not sent), the same at TP1 and PP2 into a TP1 engine
    (each stage sends its own rows); into a TP2 engine more (measured 213 kB against 181
    kB: each worker holds columns of the row-parallel weights, proj and fc2, and needs
    all rows of their D), still a fraction. Sparse delta: the
    bf16 elements that changed, a tensor dense when that is smaller."""
    tp1 = layouts["tp1"]
    for name in LAYOUTS:
        got = layouts[name]
        sparse, sketch, full = got["bytes"][0], got["bytes"][1], got["full_bytes"]
        if not name.endswith("_engine_tp2"):
            assert sketch == pytest.approx(tp1["bytes"][1], rel=0.02), (name, got["bytes"])
        assert full == tp1["full_bytes"]
        # this test's steps are large (norm ratio 2e-2): most bf16 elements change, and
        # such tensors go dense; never more than the full push plus headers
        assert sketch < 0.2 * full and sparse < 1.1 * full, (name, got["bytes"])
