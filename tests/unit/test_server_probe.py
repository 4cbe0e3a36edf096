"""The trainer's wait for a vLLM server the user runs (``rollout.server_probe``), against
real sockets and HTTP servers on this host: each way a URL can fail is named at once
(connection refused, a listener that never answers, an HTTP server that is not vLLM,
vLLM without its RL routes, vLLM without this package's weight-transfer backend, vLLM
still starting), what waiting cannot fix fails at once, what it can is waited for with a
line at once and progress lines, and the error after the wait names the URL, the reason
and the flag that sets the wait. A real vLLM server's answers are checked usable in
tests/distributed/test_engine_urls.py (the docs' server command, before any push).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_logra.rollout import server_probe
from megatron_logra.rollout.server_probe import WAIT_FLAG, probe, wait_for_server
from megatron_logra.weight_sync.contract import EngineError


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


class _Server:
    """An HTTP server on this host answering ``routes`` {path: (status, body)}; a path
    not there answers 404. ``ready_after``: /health answers 503 until then (a vLLM
    server still starting)."""

    def __init__(self, routes: dict, ready_after: float = 0.0):
        t0 = time.monotonic()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 (http.server's name)
                path = self.path.split("?")[0]
                status, body = routes.get(path, (404, "not found"))
                if path == "/health" and time.monotonic() - t0 < ready_after:
                    status = 503
                data = body if isinstance(body, str) else json.dumps(body)
                self.send_response(status)
                self.end_headers()
                self.wfile.write(data.encode())

            def log_message(self, *args):
                pass
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


VLLM = {"/health": (200, ""), "/version": (200, {"version": "0.32.0"}),
        "/get_world_size": (200, {"world_size": 1}),
        "/server_info": (200, {"vllm_config": {"weight_transfer_config": {"backend": "mlogra"}}})}


@pytest.fixture
def serve():
    servers = []

    def start(routes, **kw):
        servers.append(_Server(routes, **kw))
        return servers[-1].url
    yield start
    for s in servers:
        s.close()


def test_a_closed_port_is_connection_refused_waited_for_briefly_and_named():
    url, lines = f"http://127.0.0.1:{_closed_port()}", []
    seen = probe(url)
    assert not seen.usable and seen.transient and "connection refused" in seen.reason
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        wait_for_server(url, 1.0, out=lambda *a, **k: lines.append(a[0]))
    took = time.monotonic() - t0
    assert 1.0 <= took < 3.0  # the wait asked for, not the 600 s start-up wait
    assert url in str(err.value) and "connection refused" in str(err.value)
    assert WAIT_FLAG in str(err.value)
    assert lines and lines[0].startswith(f"rollout engine: {url} does not answer "
                                         f"(connection refused")  # said at once
    assert WAIT_FLAG in lines[0]


def test_a_listener_that_never_answers_is_a_timeout():
    with socket.socket() as s:  # the kernel accepts connections; nobody ever answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        t0 = time.monotonic()
        seen = probe(url, timeout_s=1.0)
        assert time.monotonic() - t0 < 3.0
        assert not seen.usable and seen.transient
        assert "accepts connections but sent no answer to GET /health in 1 s" in seen.reason
        with pytest.raises(EngineError, match="sent no answer.*" + WAIT_FLAG):
            wait_for_server(url, 1.0, out=lambda *a, **k: None)


def test_a_host_that_does_not_resolve_is_named():
    seen = probe("http://no-such-host.invalid:8000", timeout_s=2.0)
    assert not seen.usable and "does not resolve" in seen.reason


def test_an_http_server_that_is_not_vllm_fails_at_once(serve):
    url = serve({"/": (200, "<html>hello</html>"), "/health": (200, "ok")})
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        wait_for_server(url, 30.0, out=lambda *a, **k: None)
    assert time.monotonic() - t0 < 5.0  # not after the 30 s: waiting cannot fix it
    assert url in str(err.value) and "it is not vLLM" in str(err.value)


def test_vllm_without_its_rl_routes_fails_at_once_naming_the_variable(serve):
    url = serve({k: v for k, v in VLLM.items() if k != "/get_world_size"})
    seen = probe(url)
    assert not seen.usable and not seen.transient
    assert "vLLM 0.32.0 without its RL routes" in seen.reason
    with pytest.raises(EngineError, match="VLLM_SERVER_DEV_MODE=1"):
        wait_for_server(url, 30.0, out=lambda *a, **k: None)


@pytest.mark.parametrize("transfer, named", [(None, "'none'"), ({"backend": "nccl"}, "'nccl'")])
def test_vllm_without_this_packages_backend_fails_at_once(serve, transfer, named):
    url = serve({**VLLM, "/server_info": (200, {"vllm_config": {
        "weight_transfer_config": transfer}})})
    seen = probe(url)
    assert not seen.usable and not seen.transient
    assert f"weight-transfer backend {named}" in seen.reason
    assert """--weight-transfer-config '{"backend": "mlogra"}'""" in seen.reason


def test_a_usable_server_passes_at_once(serve):
    url = serve(VLLM)
    assert probe(url).usable
    lines = []
    wait_for_server(url, 5.0, out=lambda *a, **k: lines.append(a[0]))
    assert lines == []  # nothing to say


def test_a_starting_vllm_is_waited_for_with_progress_lines(serve, monkeypatch):
    monkeypatch.setattr(server_probe, "PROGRESS_S", 0.3)
    url, lines = serve(VLLM, ready_after=1.2), []
    first = probe(url)
    assert not first.usable and first.transient and "GET /health with 503" in first.reason
    wait_for_server(url, 10.0, out=lambda *a, **k: lines.append(a[0]))
    assert "does not answer" in lines[0] and "503" in lines[0]
    assert any(line.startswith(f"rollout engine: still waiting for {url}") for line in lines)
    assert lines[-1].startswith(f"rollout engine: {url} answers after")


def test_a_starting_vllm_that_never_gets_ready_fails_after_the_wait(serve):
    url = serve(VLLM, ready_after=1e9)
    with pytest.raises(EngineError) as err:
        wait_for_server(url, 1.0, out=lambda *a, **k: None)
    assert "no usable vLLM server after 1 s" in str(err.value)
    assert "503" in str(err.value) and WAIT_FLAG in str(err.value)
