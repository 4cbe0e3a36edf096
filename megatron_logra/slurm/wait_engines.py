"""Wait until every vLLM server answers ``/health``: the Slurm job's step between starting
its engines and starting its trainer (``slurm.script``).

    python -m megatron_logra.slurm.wait_engines --timeout 1800 [--task-pid PID] URL [URL ...]

Exits 0 once every URL answers 200, 1 when ``--timeout`` seconds pass first (naming each
URL that does not answer and why) or at once when the engines' task (``--task-pid``, the
``srun`` that runs them) ends: a server that cannot start is said within seconds, not
after the timeout. A progress line every 30 s says who is still awaited. Standard library
only: it runs before anything else of the job.
"""

from __future__ import annotations

import argparse
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

POLL_S = 1.0
PROGRESS_S = 30.0


def health(url: str) -> str:
    """Empty when ``url``/health answers 200, else why not (for the messages)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5) as reply:
            return "" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as exc:
        return f"HTTP {exc.code}"
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return str(reason)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def wait(urls: list[str], timeout_s: float, task_pid: int | None = None, logs: str = "",
         poll_s: float = POLL_S, progress_s: float = PROGRESS_S) -> str:
    """Empty once every URL is healthy, else the failure (see the module doc)."""
    start = time.monotonic()
    next_progress = start + progress_s
    see = f"; see {logs}" if logs else ""
    while True:
        waiting = {url: why for url in urls if (why := health(url))}
        if not waiting:
            return ""
        elapsed = time.monotonic() - start
        if task_pid is not None and not alive(task_pid):
            return (f"the engines' task ended before every server answered /health "
                    f"({_list(waiting)}){see}")
        if elapsed > timeout_s:
            return (f"no healthy vLLM server after {timeout_s:g} s: {_list(waiting)}{see}; "
                    f"a longer start-up needs --engine-start-timeout")
        if time.monotonic() >= next_progress:
            print(f"[slurm] waiting for {len(waiting)} engine(s) ({elapsed:.0f} s): "
                  f"{_list(waiting)}", flush=True)
            next_progress += progress_s
        time.sleep(poll_s)


def _list(waiting: dict[str, str]) -> str:
    return ", ".join(f"{url} ({why})" for url, why in waiting.items())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m megatron_logra.slurm.wait_engines",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("urls", nargs="+", metavar="URL")
    p.add_argument("--timeout", type=float, required=True, help="seconds at most")
    p.add_argument("--task-pid", type=int, help="stop at once when this process ends")
    p.add_argument("--logs", default="", help="where the servers' logs are (for messages)")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    failed = wait(args.urls, args.timeout, args.task_pid, args.logs)
    if failed:
        print(f"[slurm] error: {failed}", file=sys.stderr, flush=True)
        return 1
    print(f"[slurm] {len(args.urls)} engine(s) healthy after {time.monotonic() - t0:.0f} s",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
