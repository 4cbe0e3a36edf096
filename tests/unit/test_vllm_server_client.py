"""The vLLM-server engine's pieces that need no server: the ``vllm.general_plugins``
entry point in a fresh vLLM process, the backend's typed init/update info, the checks of
``--rollout-engine-url`` at parse, vLLM's checksums predicted from HF tensors (against
vLLM's own digest function and its fused, sharded layout), and the client's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest
import torch

from megatron_logra.weight_sync.contract import EngineError, PushRefused
from megatron_logra.cli import parse_run_config

RL = ["--stage", "rl", "--prompts-per-step", "4", "--responses-per-prompt", "4",
      "--micro-batch-size", "4"]


def test_the_entry_point_registers_the_backend_in_a_fresh_vllm_process():
    """vLLM loads ``vllm.general_plugins`` itself; afterwards its factory knows ``mlogra``
    and resolves it to our engine class (what a server's workers do before loading)."""
    code = ("from vllm.plugins import load_general_plugins\n"
            "from vllm.distributed.weight_transfer.factory import "
            "WeightTransferEngineFactory as F\n"
            "assert 'mlogra' not in F._registry\n"
            "load_general_plugins()\n"
            "cls = F._registry['mlogra']()\n"
            "print(cls.__module__ + '.' + cls.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == (
        "megatron_logra.weight_sync.vllm_backend.MlograWeightTransferEngine")


def test_the_backends_init_and_update_info_are_checked():
    from megatron_logra.weight_sync.p2p import GroupAddress
    from megatron_logra.weight_sync.vllm_backend import MlograInitInfo, MlograUpdateInfo

    address = GroupAddress("127.0.0.1", 1234, "p/", 2, 2, "gloo")
    assert GroupAddress(**asdict(MlograInitInfo(**asdict(address)))) == address
    with pytest.raises(ValueError, match="backend 'mpi'"):
        MlograInitInfo("h", 1, "p/", 2, 2, "mpi")
    with pytest.raises(ValueError, match="0 workers"):
        MlograInitInfo("h", 1, "p/", 2, 0, "gloo")
    with pytest.raises(ValueError, match="rounds 0"):
        MlograUpdateInfo(rounds=0)


def test_the_server_url_is_checked_at_parse():
    url = ["--rollout-engine-url", "http://127.0.0.1:8000"]
    cfg = parse_run_config([*RL, *url], world_size=1)
    assert cfg.rl.rollout.engine_url == "http://127.0.0.1:8000"
    assert cfg.rl.rollout.engine_urls == ("http://127.0.0.1:8000",)
    assert cfg.rl.rollout.engines == 1 and cfg.rl.rollout.engine_url_wait_s == 60.0
    several = parse_run_config([*RL, "--rollout-engine-url",
                                "http://a:8001/, http://b.example:8002"], world_size=1)
    assert several.rl.rollout.engine_urls == ("http://a:8001", "http://b.example:8002")
    assert several.rl.rollout.engines == 2  # one engine per server, the prompts split
    for argv, why in (
            (["--rollout-engine-url", "127.0.0.1:8000"], "as http://HOST:PORT"),
            (["--rollout-engine-url", "http://host"], "as http://HOST:PORT"),
            ([*url, "--rollout-placement", "dedicated", "--rollout-devices", "1"],
             "runs where you started it: drop it")):
        with pytest.raises(ValueError, match=why):
            parse_run_config([*RL, *argv], world_size=1)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_checksums_are_vllms_digests_of_its_fused_sharded_parameters(tp):
    """The expected checksum of each worker's parameter equals vLLM's digest function
    (``compute_tensor_digests``) over the parameter built by hand the way vLLM fuses and
    shards it: qkv_proj = [q_t; k_t; v_t], gate_up_proj = [gate_t; up_t], o_proj and
    down_proj a column slice, the vocab a row slice padded to 64 with zero rows."""
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.hf_mapping import hf_param_shapes
    from megatron_logra.model.tiny_assets import tiny_hf_config
    from megatron_logra.weight_sync.checksums import ChecksumBuilder, checksum_key

    with tempfile.TemporaryDirectory() as d:
        cfg = tiny_hf_config(vocab_size=300, num_kv_heads=2)
        (Path(d) / "config.json").write_text(json.dumps(cfg))
        arch = load_arch(d)
    g = torch.Generator().manual_seed(0)
    hf = {n: torch.randn(s, generator=g).to(torch.bfloat16)
          for n, s in hf_param_shapes(arch).items()}
    builder = ChecksumBuilder(arch, tp)
    for name, value in hf.items():
        builder.add(name, value)
    hd, kv = arch.head_dim, arch.num_kv_heads
    for rank in range(tp):
        def rows(t):  # this rank's share of t's rows
            per = t.shape[0] // tp
            return t[rank * per:(rank + 1) * per]
        layer = "model.layers.0."
        q, k, v = (hf[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
        # KV heads: split over the ranks, or replicated when there are fewer than ranks
        heads = (range(rank * kv // tp, (rank + 1) * kv // tp) if kv >= tp
                 else [rank // (tp // kv)])
        k_t, v_t = (torch.cat([t[h * hd:(h + 1) * hd] for h in heads]) for t in (k, v))
        params = {
            f"{layer}self_attn.qkv_proj.weight": torch.cat([rows(q), k_t, v_t]),
            f"{layer}mlp.gate_up_proj.weight": torch.cat(
                [rows(hf[f"{layer}mlp.gate_proj.weight"]),
                 rows(hf[f"{layer}mlp.up_proj.weight"])]),
            f"{layer}mlp.down_proj.weight": hf[f"{layer}mlp.down_proj.weight"].chunk(tp, 1)[rank],
            f"{layer}self_attn.o_proj.weight": hf[f"{layer}self_attn.o_proj.weight"]
            .chunk(tp, 1)[rank],
            f"{layer}input_layernorm.weight": hf[f"{layer}input_layernorm.weight"]}
        padded = torch.zeros(-(-300 // 64) * 64, arch.hidden_size, dtype=torch.bfloat16)
        padded[:300] = hf["model.embed_tokens.weight"]
        params["model.embed_tokens.weight"] = padded.chunk(tp)[rank]
        module = torch.nn.Module()
        for i, (name, value) in enumerate(params.items()):
            module.register_parameter(f"p{i}", torch.nn.Parameter(value.clone(),
                                                                  requires_grad=False))
        digests = compute_tensor_digests(module)
        for i, name in enumerate(params):
            assert builder.expected[checksum_key(rank, name)] == digests[f"p{i}"], (rank, name)
    served = dict(builder.expected)
    assert builder.mismatched(served) == []
    served[checksum_key(tp - 1, "model.layers.0.mlp.gate_up_proj.weight")] = "0" * 64
    assert builder.mismatched(served) == ["model.layers.0.mlp.gate_proj.weight",
                                          "model.layers.0.mlp.up_proj.weight"]


class _FakeServer(BaseHTTPRequestHandler):
    """Answers like a vLLM server without its dev-mode routes, at weight version 3."""

    dev_mode = True
    posted: dict = {}  # path -> the last JSON body POSTed there

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        path = self.path.lstrip("/")
        if path == "health":
            return self._reply(200, {})
        if path == "v1/models":
            return self._reply(200, {"data": [{"id": "m"}]})
        if path == "version":
            return self._reply(200, {"version": "0.32.0"})
        if not self.dev_mode:
            return self._reply(404, {"detail": "Not Found"})
        if path == "get_world_size":
            return self._reply(200, {"world_size": 2})
        if path == "weight_info":
            return self._reply(200, {"weight_version": "3"})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
        size = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(size) if size else b""
        _FakeServer.posted[self.path.lstrip("/").split("?")[0]] = json.loads(body or b"null")
        return self._reply(200 if self.dev_mode else 404, {})

    def log_message(self, *args):
        pass


@pytest.fixture
def fake_server():
    httpd = HTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()


def test_the_client_refuses_what_the_server_cannot_take(fake_server):
    from megatron_logra.weight_sync.p2p import GroupAddress
    from megatron_logra.rollout.vllm_server import VllmServer

    url = f"http://127.0.0.1:{fake_server.server_port}"
    server = VllmServer(url, request_timeout_s=10)
    assert (server.world_size, server.model, server.version) == (2, "m", 3)
    with pytest.raises(PushRefused, match="on version 1, the server serves 3: push full"):
        server.expect("sketch-delta", base_version=1, version=2)
    with pytest.raises(EngineError, match="expects 1 engine workers.*has 2: set "
                                          "--rollout-tensor-parallel-size 2"):
        server.begin_join(GroupAddress("h", 1, "p/", 2, 1, "gloo"))
    with pytest.raises(EngineError, match="serves weights version 3, the trainer is at 4"):
        server.generate([], expected_version=4)
    _FakeServer.dev_mode = False
    try:
        with pytest.raises(EngineError, match="start it with VLLM_SERVER_DEV_MODE=1"):
            VllmServer(url, request_timeout_s=10)
    finally:
        _FakeServer.dev_mode = True
    with pytest.raises(EngineError, match="at http://127.0.0.1:9: no usable vLLM server after "
                                          "1 s: connection refused"):
        VllmServer("http://127.0.0.1:9", request_timeout_s=5, connect_timeout_s=1)


def test_the_transport_has_one_name_on_the_wire(fake_server):
    """What the client opens a push with reaches the backend's typed update info under the
    trainer's own word (``contract.Transport``), and a push in flight names it."""
    from megatron_logra.rollout.vllm_server import VllmServer
    from megatron_logra.weight_sync.contract import PushInFlight, Transport
    from megatron_logra.weight_sync.vllm_backend import MlograUpdateInfo

    server = VllmServer(f"http://127.0.0.1:{fake_server.server_port}", request_timeout_s=10)
    server.expect(Transport.SKETCH_DELTA, base_version=3, version=4)
    server.begin_receive(2)
    server.end_call()
    info = MlograUpdateInfo(**_FakeServer.posted["update_weights"]["update_info"])
    assert (info.transport, info.rounds, info.version) == (Transport.SKETCH_DELTA, 2, 4)
    with pytest.raises(PushInFlight, match="a sketch-delta push to version 4 is in flight"):
        server.generate([], expected_version=3)
