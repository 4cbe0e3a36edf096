"""Low-rank updates from any trainer into a vLLM server running this package's backend.

A trainer that is not this one (a plain PyTorch model with HF parameter names, one
process) whose update of a linear weight W [out, in] is ``W -= B A`` (B [out, r],
A [r, in]: LoRA-style factors, a projected gradient step, ...) pushes those factors, not
W, into a ``vllm serve`` started with ``--weight-transfer-config '{"backend": "mlogra"}'``
(docs/weight-sync.md, "Any trainer"). The same wire and worker code as LoGRA's
sketch-delta push, with A carried (``sketch_rows.EXPLICIT``) instead of regenerated from
a seed:

    updates = low_rank_updates(arch, {"model.layers.0.self_attn.q_proj.weight": (B, A)},
                               seed=step)
    apply_low_rank(arch, weights, updates)        # the trainer's own W -= B A
    push = LowRankPush(server, model_dir)         # server: a contract.PushTarget
    version = push.push(updates)                  # the server applies the same update

``apply_low_rank`` is the very code the server's workers run on their pieces of each
weight (``sketch_rows.apply_updates_into``), so both sides round alike and the server's
weights stay equal to the trainer's bit for bit (``LowRankPush.mismatches``: vLLM's own
checksums against the trainer's weights): fp32 weights take W - B A in fp32; bf16 weights
take it with stochastic rounding keyed by ``seed``, row and column. The server must
start from the trainer's weights (the same checkpoint), as the first delta's base.

The trainer's side is one process (group rank 0 of the weight group; the server's TP
workers are ranks 1..tp), over gloo through host memory. A delta on a base version the
server does not serve is refused (``contract.PushRefused``) before anything is sent.
"""

from __future__ import annotations

import os

import torch

from megatron_logra.model.arch import ModelArch, load_arch
from megatron_logra.model.hf_mapping import hf_param_shapes, hf_sources, row_segments
from megatron_logra.runtime.device import free_port
from megatron_logra.weight_sync.checksums import ChecksumBuilder
from megatron_logra.weight_sync.contract import PushTarget, Transport
from megatron_logra.weight_sync.messages import Outbox, add_updates
from megatron_logra.weight_sync.p2p import (GroupAddress, join_group, message_device,
                                            open_store, send_message, wait_all)
from megatron_logra.weight_sync.sketch_rows import (EXPLICIT, RowsUpdate, apply_updates,
                                                    encode_rows)

Factors = dict[str, tuple[torch.Tensor, torch.Tensor]]
"""{HF weight name: (B [out, r], A [r, in])}: that weight's update is W -= B A."""


def low_rank_updates(arch: ModelArch, factors: Factors, seed: int = 0) -> list[RowsUpdate]:
    """The sketch updates of ``factors`` (HF names of 2-D weights; B and A in any float
    dtype, A sent in fp32): each weight's rows in the server's canonical row order
    (``hf_mapping.row_segments``: q, k, v and gate, up each their own rows of the fused
    parameter). ``seed``: the stochastic rounding's key where the weights are bf16 (use
    a fresh one per update). ValueError names a weight the model does not have or
    factors whose shapes do not chain."""
    shapes, sources = hf_param_shapes(arch), hf_sources(arch)
    out = []
    for name, (b, a) in factors.items():
        if name not in shapes or len(shapes[name]) != 2:
            raise ValueError(f"low-rank update of {name!r}: not a 2-D weight of this model "
                             f"(HF names, e.g. model.layers.0.self_attn.q_proj.weight)")
        rows, cols = shapes[name]
        if b.dim() != 2 or a.dim() != 2 or b.shape[0] != rows or a.shape[1] != cols \
                or b.shape[1] != a.shape[0]:
            raise ValueError(f"low-rank update of {name} [{rows}, {cols}]: B "
                             f"{tuple(b.shape)} and A {tuple(a.shape)} must be [{rows}, r] "
                             f"and [r, {cols}]")
        canonical, offset, picked, d = sources[name], 0, [], []
        for seg in row_segments(arch, canonical):
            if seg.hf_name == name:
                picked.append(torch.arange(offset, offset + seg.rows))
                d.append(b[seg.start:seg.stop])
            offset += seg.rows
        out.append(RowsUpdate(canonical, encode_rows(torch.cat(picked)),
                              torch.cat(d).contiguous(), 1.0, int(seed), a.shape[0], EXPLICIT,
                              a.detach().to(torch.float32).contiguous()))
    return out


def apply_low_rank(arch: ModelArch, weights: dict[str, torch.Tensor],
                   updates: list[RowsUpdate]) -> set[str]:
    """The trainer's own step: W -= B A in place on its HF tensors ``weights`` (those the
    updates touch, at least), rounded as the server rounds; the names changed."""
    with torch.no_grad():
        return apply_updates(arch, weights, updates)


class LowRankPush:
    """The trainer's side of low-rank pushes into one vLLM server (see the module doc)."""

    def __init__(self, engine: PushTarget, model_dir: str, *, engine_tp: int = 1,
                 host: str | None = None, timeout_s: float = GroupAddress.timeout_s):
        """Joins the server's workers (blocks until they joined). ``engine``: the
        server's client (``rollout.vllm_server.VllmServer(url)``); ``model_dir``: an HF
        folder of the model the server serves (its config.json); ``engine_tp``: the
        server's --tensor-parallel-size; ``host``: where the server's workers reach this
        process (default ``MASTER_ADDR`` or 127.0.0.1)."""
        self.engine = engine
        self.arch = load_arch(model_dir)
        self.tp = engine_tp
        self.version = engine.version  # the base of the first delta
        self.address = GroupAddress(host or os.environ.get("MASTER_ADDR", "127.0.0.1"),
                                    free_port(), "mlogra-low-rank/", 1, self.tp, "gloo",
                                    timeout_s)
        self.store = open_store(self.address, master=True)
        engine.begin_join(self.address)
        self.group = join_group(self.address, 0, self.store)
        engine.end_call()
        self.device = message_device(self.group, None)
        self.sent = 0  # bytes pushed so far

    def push(self, updates: list[RowsUpdate]) -> int:
        """The server applies ``updates`` (``low_rank_updates``) on its current version,
        which becomes the next one; returns that version. ``PushRefused`` (nothing
        applied) when the server no longer serves the version of the last push;
        ``EngineError`` when it fails."""
        version = self.version + 1
        self.engine.expect(Transport.SKETCH_DELTA, base_version=self.version, version=version)
        self.engine.begin_receive(1)
        boxes = [Outbox() for _ in range(self.tp)]
        add_updates(boxes, self.arch, updates)
        works = []
        for worker, box in enumerate(boxes):
            meta, tensors = box.pack(torch.float32, self.device)
            posted, size = send_message(self.group, 1 + worker, meta, tensors, self.device)
            works += posted
            self.sent += size
        wait_all(works, self.address.timeout_s)
        self.engine.end_call()
        self.engine.commit(version)
        self.version = version
        return version

    def mismatches(self, weights: dict[str, torch.Tensor]) -> list[str]:
        """The HF tensors the server holds otherwise than ``weights`` (every tensor of the
        model, in the server's dtype), by vLLM's own checksums (empty: equal)."""
        expected = ChecksumBuilder(self.arch, self.tp)
        for name in hf_param_shapes(self.arch):
            expected.add(name, weights[name].detach())
        return expected.mismatched(self.engine.checksums())
