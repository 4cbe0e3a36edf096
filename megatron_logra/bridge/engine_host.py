"""Run the rollout engine on a node of its own: a small server the trainer connects to.

    # on the engine's node (its GPUs all for vLLM), before the trainer starts:
    MEGATRON_LOGRA_ENGINE_KEY=<secret> python -m megatron_logra.bridge.engine_host \\
        --listen 0.0.0.0:29600
    # the trainer (every node): --rollout-engine-address ENGINE_NODE:29600
    #   --weight-sync-channel direct   (with the same MEGATRON_LOGRA_ENGINE_KEY)

Trainer rank 0 connects (``multiprocessing.connection``, authenticated with the shared
key) and sends the engine's settings and its model folder's small files (config and
tokenizer: no shared file system needed; the weights come with the first push, over
the direct channel). The host starts ``engine_server.serve`` on that connection in a
process of its own and goes back to listening. One engine at a time: a new connection
(the trainer restarting its engine) ends the running one first. The engine process
answers the same commands as one spawned beside rank 0, its messages pickled by value
(``protocol.ByValueConnection``); pushes go over the direct channel's group, which the
engine's workers join at trainer rank 0's ``MASTER_ADDR``.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import tempfile
from dataclasses import replace
from multiprocessing.connection import Client, Listener
from pathlib import Path

import torch.multiprocessing as tmp

from megatron_logra.bridge.engine_server import serve
from megatron_logra.bridge.protocol import ByValueConnection

KEY_ENV = "MEGATRON_LOGRA_ENGINE_KEY"


def engine_key() -> bytes:
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise ValueError(f"a rollout engine on another node needs a shared secret: set {KEY_ENV} "
                         f"to the same value on the trainer's and the engine's nodes")
    return key.encode()


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--rollout-engine-address {address!r}: expected HOST:PORT")
    return host, int(port)


def model_files(model_dir: str) -> dict[str, bytes]:
    """The engine folder's small files (config, tokenizer), which travel with the start."""
    return {f.name: f.read_bytes() for f in Path(model_dir).iterdir()
            if f.is_file() and not f.name.endswith((".safetensors", ".bin"))}


def connect(address: str, cfg, start_id: int):
    """Trainer rank 0: a connection to the engine host, the engine starting behind it."""
    conn = ByValueConnection(Client(split_address(address), authkey=engine_key()))
    conn.send((cfg, start_id, model_files(cfg.model_dir)))
    return conn


def host(listen: str) -> None:
    """Serve one engine at a time, each on its own connection (see the module doc)."""
    key = engine_key()
    ctx = tmp.get_context("spawn")
    running, workdir = None, None
    with Listener(split_address(listen), authkey=key) as listener:
        print(f"engine host listening on {listen}", flush=True)
        while True:
            conn = listener.accept()
            try:
                cfg, start_id, files = ByValueConnection(conn).recv()
            except (EOFError, OSError, pickle.UnpicklingError):
                conn.close()
                continue
            if running is not None:  # the trainer restarts its engine
                running.kill()
                running.join(30)
                shutil.rmtree(workdir, ignore_errors=True)
            workdir = tempfile.mkdtemp(prefix="engine-host-")
            for name, data in files.items():
                (Path(workdir) / name).write_bytes(data)
            running = ctx.Process(target=serve, args=(conn, replace(cfg, model_dir=workdir),
                                                      start_id))
            running.start()
            conn.close()  # the engine process holds its own copy
            print(f"engine {start_id} started (pid {running.pid})", flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--listen", default="0.0.0.0:29600", help="HOST:PORT to listen on")
    host(p.parse_args(argv).listen)


if __name__ == "__main__":
    main()
