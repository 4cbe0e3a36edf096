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

Then, first in the launch, the trainer command printed under it (its flags as printed,
with ``MOVE_FURTHER`` added) is pointed at server B alone (``server_worker.py``): the
start-up push (full), two RL updates pushed as sketch deltas (D and a seed per sketched
weight, through vLLM's ``/update_weights`` into the ``mlogra`` backend on each server
worker), a push whose delta base the server no longer serves (its version changed behind
the trainer's back: the push goes full), and a forced full push. After every push the
server's weights equal the trainer's bit for bit by vLLM's own checksums, its logprobs
agree with the trainer's (bf16 on both sides: 2e-2, against movements of ~0.2 that a
stale server would show), the server reports the trainer's version, and its
generated-token counter grew by exactly the tokens of the rollouts the trainer received.
The two-server runs above come after it, their start-up pushes full.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
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
# added to the single-server trainer's flags: its updates move the weights far enough
# that a stale server's logprobs would differ by well over LOGPROB_TOLERANCE (at the
# default ratio, 6e-5, the move is below bf16's resolution)
MOVE_FURTHER = ["--logra-update-ratio", "2e-2"]
LOGPROB_TOLERANCE = 2e-2  # bf16 trainer vs bf16 server, measured ~5e-3


def _server_words(command: DocCommand) -> tuple[dict, list[str]]:
    """A server command's environment and argv with its port taken out."""
    return command.env, command.run_argv(**{"--port": "PORT"})


def _trainer_flags(command: DocCommand, model: Path, urls: str) -> list[str]:
    """A docs trainer command's launcher flags as printed, with ``MODEL_DIR`` and the
    test's server URLs put in and ``--output-dir`` left out (the worker gives each run
    its own)."""
    argv = command.run_argv(MODEL_DIR=str(model), **{"--rollout-engine-url": urls})
    flags = argv[argv.index("launch/pretrain_rl.py") + 1:]
    k = flags.index("--output-dir")
    return [*flags[:k], *flags[k + 2:]]


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


@dataclass(frozen=True)
class Launched:
    result: dict  # the worker's: {"single": ..., "tp2": ..., "dp2": ...}
    stdout: str  # the trainer's
    urls: list[str]  # servers A and B
    fresh: dict  # server B before any push, and what the fixture read from the docs


@pytest.fixture(scope="module")
def launch(tmp_path_factory) -> Launched:
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
        single_trainer = next(c for c in doc_commands(USAGE_MD.read_text(),
                                                      SINGLE_SERVER_SECTION)
                              if "launch/pretrain_rl.py" in c.argv)
        spec = {"urls": _trainer_flags(trainer, model, ",".join(urls)),
                "single": [*_trainer_flags(single_trainer, model, urls[1]),
                           *MOVE_FURTHER]}
        fresh["single_rank"] = int(single_trainer.flag("--logra-rank"))
        fresh["width"] = json.loads((model / "config.json").read_text())["hidden_size"]
        (tmp / "spec.json").write_text(json.dumps(spec))
        out = tmp / "result.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", str(WORKER), str(out), str(tmp / "run"),
               str(tmp / "spec.json")]
        env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1",
                   ENGINE_URLS_KILL_PGID=str(procs[1].pid))
        proc = subprocess.run(cmd, cwd=WORKER.parent, env=env, capture_output=True,
                              text=True, timeout=1500)
        (tmp / "trainer.out").write_text(proc.stdout + proc.stderr)
        logs = "".join((tmp / f"server-{k}.log").read_text()[-2000:] for k in range(2))
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:] + logs
        return Launched(json.loads(out.read_text()), proc.stdout, urls, fresh)
    finally:
        for p in procs:
            if p.poll() is None:
                stop_server(p)


def test_the_single_server_docs_command_serves_a_folder_without_weights(launch):
    fresh = launch.fresh
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
    result = launch.result[layout]
    assert result["urls"] == launch.urls
    for update in result["updates"]:
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
    result = launch.result[layout]
    assert result["server_tp"] == [1, 2]  # each server's own size, read from it
    assert result["start_mismatches"] == [0, 0]
    assert len(result["updates"]) == 2
    for update in result["updates"]:
        assert update["transport"] == "sketch-delta", update
        assert update["mismatches"] == [0, 0], update  # vLLM's checksums, per server
        assert update["checksum_mismatches"] == 0 and update["restarts"] == 0, update


def test_a_killed_server_is_named_by_its_url_and_the_run_stops(launch):
    stdout, (url_a, url_b) = launch.stdout, launch.urls
    dp2 = launch.result["dp2"]
    assert f"engine 1 ({url_b})" in dp2["after_kill"]
    assert "failed 3 times" in dp2["after_kill"]
    assert url_a not in dp2["after_kill"]
    assert dp2["stop_s"] < 120  # 4 waits of 5 s and the tries, not 10 min
    assert f"{url_b} does not answer (connection refused" in stdout
    assert "--rollout-engine-url-wait-s" in stdout
    failures = [line for line in stdout.splitlines()
                if "failed" in line and not line.startswith("[engine urls]")]
    assert failures and all(url_a not in line for line in failures)


# --- the single-server trainer (docs/usage.md's first trainer command) into server B ---

def test_the_server_holds_the_trainers_weights_bit_for_bit_after_every_push(launch):
    result = launch.result["single"]
    labels = [c["label"] for c in result["checks"]]
    assert labels == ["start", "update 1", "update 2", "version changed", "forced full"]
    for check in result["checks"]:
        assert check["mismatches"] == 0, check  # vLLM's checksums = the trainer's
        assert check["server_version"] == check["version"], check
        assert check["logprob_diff"] < LOGPROB_TOLERANCE, check
    assert result["moved"] > 10 * LOGPROB_TOLERANCE  # a stale server would fail the above


def test_updates_travel_as_sketch_deltas_at_a_fraction_of_a_full_push(launch):
    by_label = {c["label"]: c for c in launch.result["single"]["checks"]}
    assert by_label["start"]["transport"] == "full"
    full = by_label["forced full"]["bytes"]
    assert by_label["forced full"]["transport"] == "full" and full > 0
    rank, width = launch.fresh["single_rank"], launch.fresh["width"]
    assert rank < width / 4, (rank, width)  # else the bound below says little
    for label in ("update 1", "update 2"):
        assert by_label[label]["transport"] == "sketch-delta"
        # D (out x r) per sketched weight in place of W (out x in): about r / in of a full
        # push, plus the embedding's rows and the message headers
        assert by_label[label]["bytes"] < 1.2 * rank / width * full


def test_a_delta_on_a_base_the_server_does_not_serve_goes_full(launch):
    """The server's version was set behind the trainer's back: the delta is not sent, a
    full push goes instead, and the server is exact again."""
    checks = launch.result["single"]["checks"]
    changed = next(c for c in checks if c["label"] == "version changed")
    assert changed["transport"] == "full"
    assert changed["mismatches"] == 0


def test_the_single_servers_rollouts_came_from_it(launch):
    for rollout in launch.result["single"]["rollouts"]:
        assert rollout["server_tokens"] == rollout["sample_tokens"] > 0
