"""The memory model (``megatron_logra.memory``, printed by benchmarks/memory_plan.py): its
tensor inventory, its layouts against the CLI's, the engine's share and the placements."""

import math
import re
from pathlib import Path

import pytest

from megatron_logra.cli import ConfigError, parse_run_config
from megatron_logra.memory.inventory import ROLES, model_of, rank_params
from megatron_logra.memory.forecast import (GIB, cli_accepts, engine_share, placements,
                                              sync_bytes)
from megatron_logra.memory.rank_bytes import model_state, plan
from megatron_logra.memory.shapes import shape_dir

REPO = Path(__file__).resolve().parents[2]


def _numel(blocks):
    return sum(b.numel for b in blocks)


def test_the_27b_config_loads_and_counts_27b_parameters():
    arch, params = model_of("qwen3-27b")
    assert arch.family == "qwen3" and arch.qk_norm and not arch.tie_word_embeddings
    total = sum(math.prod(p.shape) for p in params)
    assert 27.0e9 < total < 27.5e9, total
    # per layer: q/k/v/o, gate/up/down, two RMSNorms and the q/k norms; plus embedding,
    # output layer and the final norm
    h, hd, f = arch.hidden_size, arch.head_dim, arch.ffn_hidden_size
    layer = ((arch.num_attention_heads + 2 * arch.num_kv_heads) * hd * h
             + h * arch.num_attention_heads * hd + 3 * h * f + 2 * h + 2 * hd)
    assert total == arch.num_layers * layer + 2 * arch.padded_vocab_size * h + h


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (4, 2), (8, 1), (2, 2)])
def test_rank_blocks_cover_the_model_once_over_tp_and_pp(tp, pp):
    """Summed over stages and TP ranks, the blocks are the whole model plus what megatron
    replicates over TP (the norms): nothing lost, nothing split twice."""
    arch, params = model_of("qwen3-27b")
    total = sum(math.prod(p.shape) for p in params)
    replicated = sum(math.prod(p.shape) for p in params if p.split_dim is None)
    got = sum(tp * _numel(rank_params("qwen3-27b", tp, pp, s)) for s in range(pp))
    assert got == total + (tp - 1) * replicated


def test_a_tied_embedding_has_a_copy_on_the_last_stage_only_with_pipelines():
    one = rank_params("smollm2-135m", 1, 1, 0)
    assert [b.role for b in one].count("embedding") == 1 and "output" not in [b.role for b in one]
    last = rank_params("smollm2-135m", 1, 2, 1)
    assert [b.role for b in last].count("output") == 1


@pytest.mark.parametrize("shape", ["qwen2.5-1.5b", "qwen2.5-7b", "qwen3-27b"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2), (4, 1), (8, 1), (1, 4), (4, 2)])
def test_projected_layouts_are_the_ones_the_cli_accepts(shape, tp, pp):
    """The projection lists a layout for a method exactly when the trainer's command line
    on 8 ranks takes it (the model must split that way; LoGRA's qkv sketch needs TP <= kv
    heads)."""
    model = shape_dir(shape)
    for method, flags in (("dense_adam", ["--optimizer", "adam"]),
                          ("logra", ["--optimizer", "logra"]), ("lora", ["--peft", "lora"])):
        try:
            parse_run_config(["--model-dir", model, "--tensor-model-parallel-size", str(tp),
                              "--pipeline-model-parallel-size", str(pp), *flags], world_size=8)
            accepted = True
        except ConfigError:
            accepted = False
        assert cli_accepts(shape, tp, pp, method) == accepted, method


def test_dense_adam_shards_only_its_optimizer_over_dp():
    blocks = rank_params("smollm2-135m", 1, 1, 0)
    n = _numel(blocks)
    norms = sum(b.numel for b in blocks if b.role == "norm")
    assert 0 < norms == 61 * 576  # two per layer and the final one, kept in fp32
    for dp in (1, 2, 4):
        state = model_state(blocks, dp, method="dense_adam")
        # bf16 weights (fp32 norms), fp32 grads, fp32 main + moments sharded over DP
        assert state["total"] == 2 * n + 2 * norms + 4 * n + 12 * n / dp
        logra = model_state(blocks, dp, method="logra", master="fp32")
        assert logra["grads"] == logra["dense_optimizer"] == 0  # untargeted frozen
        assert logra["logra_masters"] == pytest.approx(
            4 * sum(b.numel for b in blocks if b.role in ROLES) / dp)


def test_sync_projection_counts_the_model_megatron_builds():
    """The projected bytes per push (benchmarks/sync.py's) come from the same inventory:
    a full push is every parameter in bf16; a sketch delta r bf16 + an 8-byte index per
    sketched row plus the small tensors in full."""
    _, params = model_of("qwen3-27b")
    got = sync_bytes("qwen3-27b", 256)
    assert got["full_bytes"] == 2 * sum(math.prod(p.shape) for p in params)
    rows = sum(p.shape[0] for p in params if p.role not in ("norm", "other"))
    small = sum(math.prod(p.shape) for p in params if p.role in ("norm", "other"))
    assert got["sketch_delta_bytes"] == rows * (2 * 256 + 8) + 2 * small
    assert 0.03 < got["sync_bytes_ratio"] < 0.05


def test_the_engine_share_and_what_each_placement_fits():
    """The engine's bytes per GPU by hand (27B: bf16 weights over its TP, the rollout
    batch's KV with the KV heads split, the overhead), and the placement rules: a
    dedicated engine leaves the trainer 8 - TP GPUs; colocated, the trainer's model state
    and the awake engine share each GPU."""
    arch, params = model_of("qwen3-27b")
    n = sum(math.prod(p.shape) for p in params)
    for tp in (2, 8):
        share = engine_share("qwen3-27b", tp)
        kv_heads = max(arch.num_kv_heads / tp, 1)
        kv = 2 * 2 * arch.num_layers * kv_heads * arch.head_dim * 128 * 4096
        assert share["weights"] == 2 * n / tp and share["kv_cache"] == kv
        assert share["total"] == 2 * n / tp + kv + 2 * GIB
    got = placements([141.0], models=("27B",),
                     variants=("logra_none",))["27B"]["logra_none"]["141gib"]
    limit = 0.9 * 141 * GIB
    for pair in got["dedicated"]:  # "engine TP4 + TP1 PP1 DP4"
        e, tp, pp, dp = (int(x) for x in re.findall(r"\d+", pair))
        assert tp * pp * dp == 8 - e
        assert engine_share("qwen3-27b", e)["total"] <= limit
        assert plan("qwen3-27b", tp, pp, dp, method="logra", master="none")["peak"] <= limit
    for pair in got["colocated"]:
        e, tp, pp, dp = (int(x) for x in re.findall(r"\d+", pair))
        assert tp * pp * dp == 8
        trainer = plan("qwen3-27b", tp, pp, dp, method="logra", master="none")
        assert trainer["model_state"] + engine_share("qwen3-27b", e)["total"] <= limit
    assert got["dedicated"] and got["colocated"]


@pytest.mark.parametrize("method,variant,fits_on", [
    ("logra", "logra_fp32_master", (80.0, 141.0)), ("dense", "dense_adam", (141.0,))])
def test_the_27b_recipes_place_the_engine_where_the_plan_fits(method, variant, fits_on):
    """recipes/paper/{dense,logra}-27b.yaml: their engine placement, engine TP, KV cache
    and trainer layout are a pair the memory plan says fits on 8 GPUs of the sizes named
    (a TP1 engine beside the trainer, the old default, needs ~300 GiB: it never fits), and
    the launcher's placement check on a CUDA node of 8 accepts them."""
    from megatron_logra.rollout.placement import plan_placement

    recipe = REPO / "recipes" / "paper" / f"{method}-27b.yaml"
    model = Path(shape_dir("qwen3-27b"))  # the plan's own shape (assets/qwen3-27b)
    cfg = parse_run_config(["--config", str(recipe), "--model-dir", str(model)], world_size=8)
    rl, par = cfg.rl, cfg.parallel
    engine = engine_share("qwen3-27b", rl.rollout.tensor_parallel_size)
    # the recipe's KV cache is the plan's: the whole rollout batch at once
    assert rl.rollout.kv_cache_gib * GIB >= engine["kv_cache"]
    pair = (f"engine TP{rl.rollout.tensor_parallel_size} + TP{par.tensor_model_parallel_size} "
            f"PP{par.pipeline_model_parallel_size} DP{par.data_parallel_size(8)}")
    fitting = placements([80.0, 141.0], models=("27B",), variants=(variant,))
    for gib in (80.0, 141.0):
        fits = pair in fitting["27B"][variant][f"{gib:g}gib"][rl.rollout.placement]
        assert fits == (gib in fits_on), (pair, gib)
    placement = plan_placement(rl.rollout.placement, rl.rollout.devices,
                               engine_tp=rl.rollout.tensor_parallel_size, cuda=True,
                               node_devices=list(range(8)), local_world_size=8)
    assert placement.sleep_mode
