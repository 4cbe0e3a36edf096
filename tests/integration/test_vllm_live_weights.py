"""Pushes written in place into a live vLLM server's fused, sharded parameters.

vLLM's own server (``rollout.server_process``, started as the trainer starts it, but on a
checkpoint: ``load_format="auto"``), bf16, at TP1 and TP2, on tiny models whose layouts
differ: Qwen2 with qkv bias, one KV head (replicated over the TP2 ranks), an untied
lm_head and a vocab that vLLM pads (300 -> 320, the second rank's slice part padding);
Qwen3 with q/k norms, head_dim 48 and a tied embedding. A bare sender (one "trainer
rank", the ``mlogra`` backend's group over gloo) stands in for the trainer. Checked
against references:

- vLLM's checksums of the checkpoint it loaded equal the ones ``weight_sync.checksums``
  predicts from the HF tensors: our placements (``weight_sync.vllm_layout``: qkv and
  gate/up fusion, replicated KV heads, vocab padding zeroed) are vLLM's own layout;
- after a sketch delta on every sketched weight (random rows, two in the vocab padding,
  which are ignored), vLLM's checksums equal the prediction from the same update applied
  to whole HF tensors (``apply_updates``: bit for bit, bf16 with stochastic rounding);
- the server generates with them: its logprobs follow transformers' on the updated
  weights (bf16 server: 0.05, measured 0.005-0.03) and move far from the ones before
  (0.68-1.85);
- while a push is open (started, not finished) scoring is refused, and the server
  serves again once it is finished; a killed TP2 server leaves nothing in /dev/shm.
"""

from __future__ import annotations

import time

import pytest
import torch

from megatron_logra.testing.shm import leaked_shm, shm_entries

pytestmark = pytest.mark.vllm

CASES = {"qwen2_kv1_tp1": ("qwen2", 1), "qwen2_kv1_tp2": ("qwen2", 2), "qwen3_tied_tp2": ("qwen3", 2)}
ARCH = {"qwen2": {"num_kv_heads": 1, "tie_word_embeddings": False, "vocab_size": 300},
        "qwen3": {"head_dim": 48, "tie_word_embeddings": True}}
SKETCHED = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
DTYPE = torch.bfloat16


def _updates(arch, gen: torch.Generator):
    from megatron_logra.weight_sync.sketch_rows import RowsUpdate, encode_rows
    from megatron_logra.model.hf_mapping import megatron_param_shape

    names = ["embedding.word_embeddings.weight"] + [
        f"decoder.layers.{i}.{s}" for i in range(arch.num_layers) for s in SKETCHED]
    out = []
    for k, name in enumerate(names):
        rows_total = megatron_param_shape(arch, name)[0]
        rows = torch.randperm(rows_total, generator=gen)[: rows_total // 2].sort().values
        if name.startswith("embedding") and arch.padded_vocab_size > arch.vocab_size:
            # two rows in the vocab padding: ignored by the receiver
            rows = torch.unique(torch.cat([rows, torch.tensor([arch.vocab_size,
                                                               arch.padded_vocab_size - 1])]))
        d = torch.randn(rows.numel(), 8, generator=gen)
        out.append(RowsUpdate(name, encode_rows(rows), d, 0.05, 1000 + k, 8, "rademacher"))
    return out


def _predicted(arch, tp: int, weights: dict[str, torch.Tensor]) -> dict[str, str]:
    from megatron_logra.weight_sync.checksums import ChecksumBuilder

    builder = ChecksumBuilder(arch, tp)
    for name, value in weights.items():
        builder.add(name, value)
    return builder.expected


def _push_sketch(server, updates: list, version: int, tp: int) -> bool:
    """Send ``updates`` to every worker as one trainer rank would (the ``mlogra``
    backend's group, gloo); returns whether scoring was refused while the push was open."""
    from megatron_logra.weight_sync.messages import Outbox
    from megatron_logra.weight_sync.p2p import GroupAddress, join_group, open_store, send_message, wait_all
    from megatron_logra.weight_sync.contract import PushInFlight
    from megatron_logra.runtime.device import free_port

    address = GroupAddress("127.0.0.1", free_port(), "live-test/", 1, tp, "gloo", 120.0)
    store = open_store(address, master=True)
    server.begin_join(address)
    group = join_group(address, 0, store)
    server.end_call()
    server.expect("sketch-delta", base_version=version - 1, version=version)
    try:
        server.prompt_logprobs([[1, 2, 3]])
        refused = False
    except PushInFlight:
        refused = True
    server.begin_receive(1)
    cpu = torch.device("cpu")
    for worker in range(tp):  # each worker applies the rows and columns it holds
        box = Outbox()
        box.updates = list(updates)
        meta, tensors = box.pack(DTYPE, cpu)
        works, _ = send_message(group, 1 + worker, meta, tensors, cpu)
        wait_all(works, 120)
    server.end_call()
    server.commit(version)
    return refused


def _transformers_logprobs(folder, weights, rows: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.load_state_dict({n: t.float() for n, t in weights.items()}, strict=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(rows).logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, rows[:, 1:, None]).squeeze(-1)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    from safetensors.torch import load_file

    from megatron_logra.rollout.config import EngineConfig
    from megatron_logra.rollout.types import ServerSpec
    from megatron_logra.weight_sync.sketch_rows import apply_updates
    from megatron_logra.model.arch import load_arch
    from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint
    from megatron_logra.rollout.vllm_server import VllmServer

    family, tp = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_hf_checkpoint(tmp / "hf", family, seed=3, **ARCH[family])
    arch = load_arch(folder)
    weights = {n: t.to(DTYPE) for n, t in load_file(folder / "model.safetensors").items()}
    shm_before = shm_entries()
    cfg = ServerSpec(str(folder), max_model_len=64, max_num_seqs=8, load_format="auto",
                     engine=EngineConfig(dtype="bfloat16", kv_cache_gib=0.05,
                                         tensor_parallel_size=tp))
    server = VllmServer.local(cfg, tmp / "server.log", cuda=False)
    try:
        loaded = server.checksums()
        server.assume_version(0)
        rows = torch.randint(0, 259, (3, 20), generator=torch.Generator().manual_seed(1))
        before = torch.tensor(server.prompt_logprobs(rows.tolist()), dtype=torch.float64)
        updates = _updates(arch, torch.Generator().manual_seed(7))
        refused_in_flight = _push_sketch(server, updates, 1, tp)
        after_push = server.checksums()
        served_version = server.version
        after = torch.tensor(server.prompt_logprobs(rows.tolist()), dtype=torch.float64)
        server.owner.kill()  # a crash: a TP2 server's shared-memory queues go with it, even so
    finally:
        server.close()
    for _ in range(40):
        leaked = leaked_shm(shm_before)
        if not leaked:
            break
        time.sleep(0.25)
    reference = {n: t.clone() for n, t in weights.items()}
    apply_updates(arch, reference, updates)
    return dict(loaded=loaded, predicted_loaded=_predicted(arch, tp, weights),
                after_push=after_push, predicted_after=_predicted(arch, tp, reference),
                changed=[n for n in weights if not torch.equal(weights[n], reference[n])],
                weights=weights, before=before, after=after, served_version=served_version,
                refused_in_flight=refused_in_flight, leaked_shm=leaked,
                expected=_transformers_logprobs(folder, reference, rows))


def _mismatched(served: dict[str, str], predicted: dict[str, str]) -> list[str]:
    return sorted(k for k, v in predicted.items() if served.get(k) != v)


def test_our_placements_are_vllms_layout(case):
    assert case["predicted_loaded"] and _mismatched(case["loaded"],
                                                    case["predicted_loaded"]) == []


def test_sketch_deltas_land_in_place_bit_for_bit(case):
    assert _mismatched(case["after_push"], case["predicted_after"]) == []
    assert len(case["changed"]) > len(case["weights"]) // 2  # the update moved them
    assert _mismatched(case["after_push"], case["predicted_loaded"])  # and vLLM saw it
    assert case["served_version"] == 1


def test_the_server_generates_with_the_updated_weights(case):
    err = float((case["after"] - case["expected"]).abs().max())
    moved = float((case["after"] - case["before"]).abs().max())
    print(f"server vs transformers {err:.3g}; moved {moved:.3g}")
    # bf16 server against transformers in fp32 on the same bf16 weights: measured
    # 0.005-0.03, where a server still on the old weights would be off by the movement
    # (0.68-1.85)
    assert err < 0.05 and moved > 0.3, (err, moved)


def test_scoring_is_refused_while_a_push_is_open(case):
    assert case["refused_in_flight"]


def test_a_killed_server_leaves_nothing_in_shared_memory(case):
    """vLLM's TP workers talk over shared-memory queues: when the server's main process is
    killed, its workers and resource tracker follow and the tracker unlinks them, instead
    of leaving them in /dev/shm as long as the trainer lives."""
    assert case["leaked_shm"] == []
