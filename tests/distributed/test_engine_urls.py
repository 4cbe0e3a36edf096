"""Several vLLM servers by URL (``--rollout-engine-url URL_A,URL_B``), end to end.

Two servers are started on this host as docs/usage.md's "Several servers" prints them
(the two server commands parsed out of the markdown, ``testing.docs_commands``: one at
TP1 and one at TP2, bf16, ``--load-format dummy`` on a folder with config and tokenizer
only), and the
trainer command printed under them is run, its flags as printed, through
``engine_urls_worker.py`` at TP2 and at DP2 in one torchrun launch (two LoGRA updates
each). Checked:

- the prompts are split over both servers as over local replicas: each server's
  generated- and prompt-token counters grew by exactly the tokens of its contiguous half
  of the samples (server A the first half, B the second; the prompts' lengths tell the
  halves apart);
- every update went to both servers as a sketch delta, and after the start-up push and
  every update vLLM's checksums on each server equal the trainer's (0 mismatches), with
  no restarts: the trainer sliced its shards for each server's own TP size (1 and 2);
- in the DP2 run server B is killed before a third update: the trainer names B's URL at
  once (connection refused), waits the short wait for it (``--rollout-engine-url-wait-s
  5``), and after 3 failed tries stops with an error naming B's URL and not A's, in well
  under the 10 min of the old start-up wait.

Before the trainer starts, server B, still on the dummy weights it started with, stands
for docs/usage.md's single-server command ("A vLLM server as the rollout engine"): that
command is checked to be B's word for word (the port aside), and then it serves a folder
without weights (without ``--load-format dummy`` vLLM stops with "Cannot find any model
weights"): ``/health`` answers 200, a completion of a token-id prompt returns exactly
the tokens asked for, and the trainer's own probe (``rollout.server_probe``, what
``--rollout-engine-url`` waits with) finds it a usable vLLM with the RL routes and this
package's weight-transfer backend. (The token counters checked below are read before
each update, so this completion is not counted.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from megatron_logra.model.tiny_assets import write_tiny_model_dir
from megatron_logra.rollout.server_probe import probe
from megatron_logra.runtime.device import free_port
from megatron_logra.testing.docs_commands import (USAGE_MD, DocCommand, doc_commands,
                                                  docs_server_commands, start_doc_server,
                                                  stop_server, wait_healthy)

pytestmark = [pytest.mark.distributed, pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "distributed" / "engine_urls_worker.py"

SECTION = "Several servers"
SINGLE_SERVER_SECTION = "A vLLM server as the rollout engine"


def _server_words(command: DocCommand) -> tuple[dict, list[str]]:
    """A server command's environment and argv with its port taken out."""
    return command.env, command.run_argv(**{"--port": "PORT"})


def _serve_without_weights(url: str) -> dict:
    """What a fresh server (dummy weights, nothing pushed yet) answers: the trainer's
    probe, and the token ids of a 6-token completion of a token-id prompt."""
    seen = probe(url, timeout_s=30.0)
    served = requests.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    out = requests.post(f"{url}/v1/completions", timeout=120, json={
        "model": served, "prompt": [5, 6, 7, 8], "max_tokens": 6, "min_tokens": 6,
        "temperature": 1.0, "seed": 3, "return_token_ids": True}).json()
    return {"usable": seen.usable, "reason": seen.reason,
            "token_ids": out["choices"][0]["token_ids"]}


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> tuple[dict, str, list[str], dict]:
    tmp = tmp_path_factory.mktemp("urls")
    model = write_tiny_model_dir(tmp / "model")
    commands = doc_commands(USAGE_MD.read_text(), SECTION)
    servers = [c for c in commands if c.is_vllm_server]
    trainer, = [c for c in commands if "launch/pretrain_rl.py" in c.argv]
    assert len(servers) == 2 and all(c.background for c in servers)
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = []
    try:
        for k, (command, port) in enumerate(zip(servers, ports)):
            procs.append(start_doc_server(command, model, port, tmp / f"server-{k}.log"))
        for proc, url, k in zip(procs, urls, range(2)):
            wait_healthy(proc, url, tmp / f"server-{k}.log")
        fresh = _serve_without_weights(urls[1])
        fresh["log"] = (tmp / "server-1.log").read_text()
        fresh["servers"] = servers
        fresh["weight_files"] = [f for f in os.listdir(model)
                                 if f.endswith((".safetensors", ".bin"))]
        docs_urls = ",".join(f"http://127.0.0.1:{c.flag('--port')}" for c in servers)
        assert trainer.flag("--rollout-engine-url") == docs_urls
        argv = trainer.run_argv(MODEL_DIR=str(model),
                                **{"--rollout-engine-url": ",".join(urls)})
        flags = argv[argv.index("launch/pretrain_rl.py") + 1:]
        k = flags.index("--output-dir")
        flags = [*flags[:k], *flags[k + 2:]]  # the worker's, one per layout
        out = tmp / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(WORKER), str(out), str(tmp / "run"), *flags]
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1",
                   ENGINE_URLS_KILL_PGID=str(procs[1].pid))
        proc = subprocess.run(cmd, cwd=WORKER.parent, env=env, capture_output=True,
                              text=True, timeout=900)
        (tmp / "trainer.out").write_text(proc.stdout + proc.stderr)
        logs = "".join((tmp / f"server-{k}.log").read_text()[-2000:] for k in range(2))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:] + logs
        return json.loads(out.read_text()), proc.stdout, urls, fresh
    finally:
        for p in procs:
            if p.poll() is None:
                stop_server(p)


def test_the_single_server_docs_command_serves_a_folder_without_weights(launch):
    fresh = launch[3]
    single = docs_server_commands(SINGLE_SERVER_SECTION)[0]  # the section's first
    assert single.flag("--load-format") == "dummy"
    assert single.env["VLLM_SERVER_DEV_MODE"] == "1" and not single.background
    assert _server_words(single) == _server_words(fresh["servers"][1])  # server B
    assert fresh["weight_files"] == []  # config + tokenizer only
    assert fresh["usable"], fresh["reason"]
    assert len(fresh["token_ids"]) == 6, fresh["token_ids"]
    assert "Cannot find any model weights" not in fresh["log"]


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_the_prompts_are_split_over_both_servers_in_order(launch, layout):
    result, _, urls, _ = launch
    assert result[layout]["urls"] == urls
    for update in result[layout]["updates"]:
        tokens, prompts = update["sample_tokens"], update["prompt_tokens"]
        half = (len(tokens) + 1) // 2  # split_evenly: the first part one longer when odd
        assert update["server_tokens"] == [sum(tokens[:half]), sum(tokens[half:])], update
        # the prompts' lengths differ: these tell which samples went where
        assert update["server_prompt_tokens"] == [sum(prompts[:half]),
                                                  sum(prompts[half:])], update
        assert sum(prompts[:half]) != sum(prompts[half:])  # else the check above is blind
        assert min(update["server_tokens"]) > 0


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_sketch_deltas_leave_both_servers_equal_to_the_trainer(launch, layout):
    result = launch[0][layout]
    assert result["server_tp"] == [1, 2]  # each server's own size, read from it
    assert result["start_mismatches"] == [0, 0]
    assert len(result["updates"]) == 2
    for update in result["updates"]:
        assert update["transport"] == "sketch-delta", update
        assert update["mismatches"] == [0, 0], update  # vLLM's checksums, per server
        assert update["checksum_mismatches"] == 0 and update["restarts"] == 0, update


def test_a_killed_server_is_named_by_its_url_and_the_run_stops(launch):
    result, stdout, (url_a, url_b), _ = launch
    dp2 = result["dp2"]
    assert f"engine 1 ({url_b})" in dp2["after_kill"]
    assert "failed 3 times" in dp2["after_kill"]
    assert url_a not in dp2["after_kill"]
    assert dp2["stop_s"] < 120  # 4 waits of 5 s and the tries, not 10 min
    assert f"{url_b} does not answer (connection refused" in stdout
    assert "--rollout-engine-url-wait-s" in stdout
    failures = [line for line in stdout.splitlines()
                if "failed" in line and not line.startswith("[engine urls]")]
    assert failures and all(url_a not in line for line in failures)
