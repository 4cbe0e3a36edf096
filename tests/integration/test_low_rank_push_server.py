"""The sketch-delta backend for any trainer, end to end, as docs/weight-sync.md shows it.

The test takes the two code blocks of the page's "Any trainer" section: the server
command (bash), run as printed with the model folder and a free port put in (vLLM's own
server at TP1 in bf16 on a tiny model with weights), and the trainer (python), run as
printed (``runpy``, its ``sys.argv`` the folder and the server's URL): a plain HF
PyTorch model whose update of every projection is W -= B A, pushed as B and A through
``weight_sync.low_rank_push`` three times. Then: the example printed no checksum
mismatch; vLLM's checksums, asked again here, equal the trainer's weights' and differ
from the server's start for every projection; the server serves version 2; the
trainer's weights are W0 - sum of its B A in fp32, to bf16's stochastic rounding (one
ulp per update), against movements of ~0.03 that a lost update would leave.
"""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from megatron_logra.runtime.device import free_port
from megatron_logra.testing.docs_commands import (docs_server_commands, start_doc_server,
                                                  stop_server, wait_healthy)
from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint

pytestmark = [pytest.mark.vllm]

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "weight-sync.md"
SECTION = "## Any trainer: low-rank pushes from a plain PyTorch model"


def doc_blocks() -> tuple[str, str]:
    """The section's bash block (the server) and python block (the trainer)."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", 1)]
    blocks = dict(re.findall(r"```(bash|python)\n(.*?)```", section, flags=re.S))
    return blocks["bash"], blocks["python"]


def test_the_example_is_at_most_about_40_lines():
    _, example = doc_blocks()
    assert len(example.strip().splitlines()) <= 40


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("low_rank")
    model = write_tiny_hf_checkpoint(tmp / "model")
    port = free_port()
    (command,) = docs_server_commands(SECTION.removeprefix("## "), markdown_path=DOC)
    assert "MODEL_DIR" in command.argv and command.flag("--port") == "8000"
    log = tmp / "server.log"
    server = start_doc_server(command, model, port, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(server, url, log)
        yield model, url, log
    finally:
        stop_server(server)


def test_the_docs_trainer_keeps_the_server_equal_to_its_weights(served, monkeypatch, capsys):
    from safetensors.torch import load_file

    from megatron_logra.rollout.vllm_server import VllmServer

    model, url, log = served
    server = VllmServer(url)
    start = server.checksums()
    _, example = doc_blocks()
    script = model.parent / "any_trainer.py"
    script.write_text(example)
    monkeypatch.setattr(sys, "argv", [str(script), str(model), url])
    run = runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out
    assert "checksum mismatches []" in printed and "version 2:" in printed, \
        printed + log.read_text()[-3000:]
    push, weights, history = run["push"], run["weights"], run["history"]
    assert push.mismatches(weights) == []  # vLLM's checksums, asked again
    assert server.version == 2
    moved = {k.split(":")[-1].split(".", 3)[-1] for k, v in server.checksums().items()
             if start.get(k) != v}  # e.g. self_attn.qkv_proj.weight
    assert {"self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
            "mlp.down_proj.weight"} <= moved, moved
    w0 = load_file(str(model / "model.safetensors"))
    names = set(history[0])
    assert names and all(n.endswith("_proj.weight") for n in names)
    for name in names:
        want = w0[name].to(torch.bfloat16).float()
        for factors in history:
            b, a = factors[name]
            want = want - b @ a
        got = weights[name].float()
        assert float((got - w0[name]).abs().max()) > 1e-2, name  # it did move
        # one ulp (2^-7 of the value at most) per update, of values up to |W| + 0.1
        assert bool(((got - want).abs() <= 3 * 2 ** -7 * (want.abs() + 0.1)).all()), name
