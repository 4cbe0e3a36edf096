"""The vLLM server command of docs/usage.md ("A vLLM server as the rollout engine") runs as
printed: it is parsed out of the markdown (``testing.docs_commands``; only ``MODEL_DIR``
and the port are put in), started on a model folder with config and tokenizer only (the
folder a user has before the trainer's first push; without ``--load-format dummy`` vLLM
stops with "Cannot find any model weights"), and then: ``/health`` answers 200, a
completion of a token-id prompt returns exactly the tokens asked for, and the trainer's
own probe (``rollout.server_probe``, what ``--rollout-engine-url`` waits with) finds it a
usable vLLM with the RL routes and this package's weight-transfer backend.
"""

from __future__ import annotations

import os

import pytest
import requests

from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.rollout.server_probe import probe
from megatron_logra.runtime.device import free_port
from megatron_logra.testing.docs_commands import (docs_server_commands, start_doc_server,
                                                  stop_server, wait_healthy)

pytestmark = [pytest.mark.vllm]

SECTION = "A vLLM server as the rollout engine"


def test_the_docs_server_command_serves_a_folder_without_weights(tmp_path):
    command = docs_server_commands(SECTION)[0]
    assert command.flag("--load-format") == "dummy"
    assert command.env["VLLM_SERVER_DEV_MODE"] == "1"
    model = write_tiny_model_dir(tmp_path / "model")  # config + tokenizer, no weights
    assert not [f for f in os.listdir(model) if f.endswith((".safetensors", ".bin"))]
    port, log = free_port(), tmp_path / "server.log"
    url = f"http://127.0.0.1:{port}"
    proc = start_doc_server(command, model, port, log)
    try:
        wait_healthy(proc, url, log)
        seen = probe(url, timeout_s=30.0)
        assert seen.usable, seen.reason
        served = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        out = requests.post(f"{url}/v1/completions", timeout=120, json={
            "model": served, "prompt": [5, 6, 7, 8], "max_tokens": 6, "min_tokens": 6,
            "temperature": 1.0, "seed": 3, "return_token_ids": True}).json()
        assert len(out["choices"][0]["token_ids"]) == 6, out
    finally:
        stop_server(proc)
    assert "Cannot find any model weights" not in log.read_text()
