"""Is there a usable vLLM server at a URL, and if not, why: the trainer's wait for a server
the user runs (``--rollout-engine-url``).

``probe(url)`` asks once and says what it found (``Probe``): nothing listens (connection
refused), no answer in time (a firewall, a wrong host, or something that accepts and
never answers), the host does not resolve, an HTTP server that is not vLLM, vLLM still
starting or with a dead engine core (``/health`` 503), vLLM without the RL routes
(``VLLM_SERVER_DEV_MODE=1``), vLLM without this package's weight-transfer backend, or a
usable server. ``wait_for_server`` probes until the server is usable: a server that will
not become usable by waiting (not vLLM, no RL routes, no backend) fails at once; the
others are waited for up to ``wait_s``, with a line at the first failure and a progress
line every ``PROGRESS_S``, then an error naming the URL, the last reason and the flag
that sets the wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from megatron_logra.weight_sync.contract import EngineError

WAIT_FLAG = "--rollout-engine-url-wait-s"
PROGRESS_S = 10.0  # a waiting line this often
POLL_S = 0.5
BACKEND = "mlogra"  # this package's weight-transfer backend (weight_sync.vllm_plugin)


@dataclass(frozen=True)
class Probe:
    """One look at a URL: ``usable`` (a vLLM server this trainer can push to), else
    ``reason`` and whether waiting can help (``transient``)."""

    usable: bool
    reason: str = ""
    transient: bool = True


def probe(url: str, timeout_s: float = 5.0, http=None) -> Probe:
    """Ask the server at ``url`` once (each request bounded by ``timeout_s``)."""
    import requests

    http = http or requests
    url = url.rstrip("/")
    try:
        health = http.get(f"{url}/health", timeout=timeout_s)
    except requests.exceptions.ConnectTimeout:
        return Probe(False, f"no answer to a connection in {timeout_s:.0f} s (a wrong host, "
                            f"or a firewall between here and it?)")
    except requests.exceptions.ReadTimeout:
        return Probe(False, f"it accepts connections but sent no answer to GET /health in "
                            f"{timeout_s:.0f} s (not an HTTP server, or one that hangs)")
    except requests.exceptions.ConnectionError as exc:
        return Probe(False, _connection_error(exc))
    except requests.RequestException as exc:
        return Probe(False, f"GET /health failed: {exc}")
    version = _json(http, f"{url}/version", timeout_s)
    if not isinstance(version, dict) or "version" not in version:
        return Probe(False, f"an HTTP server answers (GET /health: {health.status_code}) but "
                            f"it is not vLLM (GET /version has no vLLM version): is the port "
                            f"the vLLM server's?", transient=False)
    vllm = f"vLLM {version['version']}"
    if health.status_code != 200:
        return Probe(False, f"{vllm} answers GET /health with {health.status_code} (still "
                            f"starting, or its engine core died: see the server's log)")
    world = _get(http, f"{url}/get_world_size", timeout_s)
    if world is not None and world.status_code == 404:
        return Probe(False, f"{vllm} without its RL routes (GET /get_world_size: 404): start "
                            f"it with VLLM_SERVER_DEV_MODE=1", transient=False)
    info = _json(http, f"{url}/server_info?config_format=json", max(timeout_s, 30.0))
    backend = _backend(info)
    if backend is not None and backend != BACKEND:
        return Probe(False, f"{vllm} with the weight-transfer backend {backend!r}, not this "
                            f"package's: start it with --weight-transfer-config "
                            f"'{{\"backend\": \"{BACKEND}\"}}' (megatron_logra installed "
                            f"beside vLLM registers it)", transient=False)
    return Probe(True)


def wait_for_server(url: str, wait_s: float, *, what: str = "rollout engine",
                    out=print) -> None:
    """Return once ``url`` is a usable vLLM server; raise ``EngineError`` at once for one
    that waiting cannot fix, else after ``wait_s`` (see the module doc)."""
    t0 = time.monotonic()
    deadline, next_line = t0 + wait_s, t0 + PROGRESS_S
    said = ""
    while True:
        seen = probe(url, timeout_s=min(5.0, max(wait_s / 4, 1.0)))
        if seen.usable:
            if said:
                out(f"{what}: {url} answers after {time.monotonic() - t0:.0f} s", flush=True)
            return
        if not seen.transient:
            raise EngineError(f"{what} at {url}: {seen.reason}")
        now = time.monotonic()
        if now >= deadline:
            raise EngineError(f"{what} at {url}: no usable vLLM server after {wait_s:.0f} s: "
                              f"{seen.reason}. Start it (docs/usage.md, \"A vLLM server as "
                              f"the rollout engine\"), check the URL, or wait longer with "
                              f"{WAIT_FLAG}")
        if not said:
            out(f"{what}: {url} does not answer ({seen.reason}); waiting up to "
                f"{wait_s:.0f} s ({WAIT_FLAG})", flush=True)
            said = seen.reason
        elif now >= next_line:
            out(f"{what}: still waiting for {url}, {now - t0:.0f}/{wait_s:.0f} s "
                f"({seen.reason})", flush=True)
            next_line = now + PROGRESS_S
        time.sleep(min(POLL_S, max(deadline - time.monotonic(), 0.0)))


def _connection_error(exc) -> str:
    text = str(exc)
    if "Connection refused" in text or "ConnectionRefused" in text:
        return "connection refused (nothing listens at that port: is the server started, " \
               "and the port right?)"
    if "Name or service not known" in text or "NameResolution" in text \
            or "nodename nor servname" in text or "Temporary failure in name" in text:
        return "the host name does not resolve (a typo in the host?)"
    if "timed out" in text:
        return "no answer to a connection (a wrong host, or a firewall?)"
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "it accepted the connection and closed it without an HTTP answer (not an " \
               "HTTP server?)"
    return f"connection failed: {text[:300]}"


def _get(http, url: str, timeout_s: float):
    import requests

    try:
        return http.get(url, timeout=timeout_s)
    except requests.RequestException:
        return None


def _json(http, url: str, timeout_s: float):
    r = _get(http, url, timeout_s)
    if r is None or r.status_code != 200:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def _backend(info) -> str | None:
    """The weight-transfer backend named in ``/server_info``'s JSON config (None: not
    told: an older vLLM, or the route is missing)."""
    if not isinstance(info, dict):
        return None
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        return None
    transfer = config.get("weight_transfer_config")
    if transfer is None:
        return "none"
    if isinstance(transfer, dict):
        return str(transfer.get("backend"))
    return None
