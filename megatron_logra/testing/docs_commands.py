"""The shell commands docs/usage.md prints, parsed out of the markdown as they stand, so a
test runs them as a user would (no copy in the tests to drift from the docs).

``doc_commands(markdown, section)``: the commands of the ```` ```bash ```` blocks under a
``## section`` heading, each a ``DocCommand`` (its leading ``VAR=value`` assignments and
its argv, continuation lines joined, comments dropped, split as the shell splits them).
``DocCommand.run_argv(**placeholders)`` puts values in for the docs' placeholders
(``MODEL_DIR``, a port...) and nothing else. ``start_doc_server`` runs a server command
so, ``wait_healthy`` waits for its ``/health``, ``stop_server`` ends it.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

USAGE_MD = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"


@dataclass(frozen=True)
class DocCommand:
    env: dict[str, str]  # the VAR=value words before the command
    argv: list[str]
    background: bool  # the line ends with " &"

    @property
    def is_vllm_server(self) -> bool:
        return self.argv[:3] == ["python", "-m", SERVER_MODULE]

    def flag(self, name: str) -> str | None:
        """The value after ``name`` in the argv (None: absent)."""
        return self.argv[self.argv.index(name) + 1] if name in self.argv else None

    def run_argv(self, python: str = sys.executable, **values: str) -> list[str]:
        """The argv with ``python`` for the word ``python`` and each placeholder (a word
        equal to a key of ``values``, or a flag's value given as ``--flag=value`` keys
        such as ``{"--port": "8123"}``) replaced."""
        out, argv = [], list(self.argv)
        for k, word in enumerate(argv):
            if k and argv[k - 1] in values and argv[k - 1].startswith("--"):
                out.append(values[argv[k - 1]])
            elif word in values and not word.startswith("--"):
                out.append(values[word])
            elif k == 0 and word == "python":
                out.append(python)
            else:
                out.append(word)
        return out


def section_text(markdown: str, section: str) -> str:
    """The text under the ``## section`` (or ``###``) heading, up to the next heading of
    that level or above (a ``#`` line inside a code block is no heading)."""
    lines, fence, start, level = markdown.splitlines(), False, None, 0
    for k, line in enumerate(lines):
        if line.startswith("```"):
            fence = not fence
            continue
        m = None if fence else re.match(r"^(#+) (.*)$", line)
        if m is None:
            continue
        if start is not None and len(m.group(1)) <= level:
            return "\n".join(lines[start:k])
        if start is None and m.group(2).strip() == section:
            start, level = k + 1, len(m.group(1))
    if start is None:
        raise ValueError(f"no heading {section!r} in the markdown")
    return "\n".join(lines[start:])


def doc_commands(markdown: str, section: str) -> list[DocCommand]:
    """Every command of the bash blocks under ``section`` (see the module doc)."""
    blocks = re.findall(r"```bash\n(.*?)```", section_text(markdown, section), re.S)
    commands = []
    for block in blocks:
        joined = re.sub(r"\\\n", " ", block)  # continuation lines
        for line in joined.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            background = line.endswith("&")
            words = shlex.split(line.rstrip("&"), comments=True)
            env = {}
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                key, _, value = words.pop(0).partition("=")
                env[key] = value
            commands.append(DocCommand(env, words, background))
    return commands


def docs_server_commands(section: str, markdown_path: Path = USAGE_MD) -> list[DocCommand]:
    """The vLLM server commands under ``section`` of docs/usage.md."""
    return [c for c in doc_commands(Path(markdown_path).read_text(), section)
            if c.is_vllm_server]


def start_doc_server(command: DocCommand, model_dir, port: int, log_path) -> subprocess.Popen:
    """``command`` (a vLLM server's) as a user runs it, its ``MODEL_DIR`` and ``--port``
    filled, in a session of its own (``stop_server``), output to ``log_path``."""
    env = dict(os.environ, **command.env)
    argv = command.run_argv(MODEL_DIR=str(model_dir), **{"--port": str(port)})
    return subprocess.Popen(argv, env=env, stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(proc: subprocess.Popen, url: str, log_path, timeout_s: float = 300.0) -> None:
    """Return once ``url/health`` answers 200; AssertionError with the log's tail if the
    server exits or does not answer in ``timeout_s``."""
    import requests

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the server command exited ({proc.returncode}):\n"
                                 + Path(log_path).read_text()[-4000:])
        try:
            if requests.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise AssertionError(f"no /health at {url} in {timeout_s} s:\n"
                         + Path(log_path).read_text()[-4000:])


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session, SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
