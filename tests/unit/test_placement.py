"""Where the rollout engine runs (``rollout.placement``): each placement's plan on GPU and
CPU nodes, and every refusal naming the flags and the fix."""

import pytest

from megatron_logra.rollout.placement import parse_devices, plan_placement
from megatron_logra.cli import parse_run_config

GPUS8 = list(range(8))


def _gpu(mode: str, devices: str = "", tp: int = 2, local: int = 6, visible=None):
    return plan_placement(mode, devices, engine_tp=tp, cuda=True, node_devices=GPUS8,
                          local_world_size=local, visible=visible)


def test_device_lists_and_ranges_parse():
    assert parse_devices("6,7") == (6, 7)
    assert parse_devices("4-7") == (4, 5, 6, 7)
    assert parse_devices("0, 2-3") == (0, 2, 3)
    assert parse_devices("") == ()
    for bad, why in (("6,6", "distinct"), ("a", "not an id"), ("-1", "not an id"),
                     ("3-x", "not an id")):
        with pytest.raises(ValueError, match=why):
            parse_devices(bad)


def test_dedicated_gpus_beside_the_trainer():
    """Trainer on GPUs 0-5 (6 local ranks), engine TP2 on 6-7: the engine process sees only
    them, translated through node 0's own CUDA_VISIBLE_DEVICES."""
    plan = _gpu("dedicated", "6,7")
    assert plan.devices == (6, 7) and plan.env == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert plan.trainer_cores is None and not plan.sleep_mode
    remapped = _gpu("dedicated", "6,7", visible="1,3,4,5,8,9,12,13")
    assert remapped.env == {"CUDA_VISIBLE_DEVICES": "12,13"}


def test_dedicated_gpus_refused_when_shared_missing_or_miscounted():
    with pytest.raises(ValueError, match=r"GPUs \[5\] are used by node 0's trainer ranks"):
        _gpu("dedicated", "5,6")
    with pytest.raises(ValueError, match=r"\[8, 9\] do not exist on node 0 \(visible GPUs: "
                                         r"0-7\)"):
        _gpu("dedicated", "8,9")
    with pytest.raises(ValueError, match="3 GPUs for 2 engine ranks"):
        _gpu("dedicated", "5-7", local=5)
    with pytest.raises(ValueError, match="needs --rollout-devices"):
        _gpu("dedicated")


def test_dedicated_cores_on_cpu_split_between_engine_and_trainer():
    cores = list(range(8))
    plan = plan_placement("dedicated", "4-7", engine_tp=2, cuda=False, node_devices=cores,
                          local_world_size=2)
    assert plan.devices == (4, 5, 6, 7) and plan.trainer_cores == (0, 1, 2, 3)
    assert plan.env == {"VLLM_CPU_OMP_THREADS_BIND": "4,5|6,7"}  # a run per engine rank
    with pytest.raises(ValueError, match="leaves no core to the trainer"):
        plan_placement("dedicated", "0-7", engine_tp=1, cuda=False, node_devices=cores,
                       local_world_size=2)
    with pytest.raises(ValueError, match="1 cores for --rollout-tensor-parallel-size 2"):
        plan_placement("dedicated", "7", engine_tp=2, cuda=False, node_devices=cores,
                       local_world_size=2)


def test_colocated_sleeps_on_gpus_and_says_why_not_on_cpu():
    assert _gpu("colocated").sleep_mode
    cpu = plan_placement("colocated", "", engine_tp=1, cuda=False, node_devices=[0, 1],
                         local_world_size=2)
    assert not cpu.sleep_mode and "no sleep mode on CPU" in cpu.note
    assert plan_placement("inherit", "", engine_tp=1, cuda=False, node_devices=[0, 1],
                          local_world_size=2) == type(cpu)("inherit")
    with pytest.raises(ValueError, match="--rollout-devices is for --rollout-placement "
                                         "dedicated"):
        _gpu("colocated", "6,7")


def test_flags_reach_the_config_and_are_checked_at_parse():
    rl = ["--stage", "rl", "--prompts-per-step", "4", "--responses-per-prompt", "4",
          "--micro-batch-size", "4"]
    cfg = parse_run_config([*rl, "--rollout-placement", "dedicated", "--rollout-devices",
                            "6,7"], world_size=1)
    assert (cfg.rl.rollout.placement, cfg.rl.rollout.devices) == ("dedicated", "6,7")
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        parse_run_config([*rl, "--rollout-placement", "elsewhere"], world_size=1)
    for argv, why in ((["--rollout-placement", "dedicated"], "needs --rollout-devices"),
                      (["--rollout-devices", "1"], "is for --rollout-placement dedicated"),
                      (["--rollout-placement", "dedicated", "--rollout-devices", "6-x"],
                       "not an id")):
        with pytest.raises(ValueError, match=why):
            parse_run_config([*rl, *argv], world_size=1)


def test_optimizer_cpu_offload_reaches_megatron_on_cuda_and_is_refused_on_cpu(monkeypatch):
    """Colocated runs free GPU memory for the engine with megatron-core's CPU offload of
    Adam's state: the flags become its OptimizerConfig; on CPU there is nothing to move."""
    import torch

    from megatron_logra.training import build

    cfg = parse_run_config(["--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5",
                            "--use-distributed-optimizer"], world_size=1).optimizer
    with pytest.raises(ValueError, match="this run is on CPU.*drop it"):
        build.megatron_optimizer_config(cfg, bf16=True)
    monkeypatch.setattr(build, "current_device", lambda: torch.device("cuda", 0))
    with pytest.raises(ValueError, match="needs Transformer Engine"):
        build.megatron_optimizer_config(cfg, bf16=True)
    # with TE (the GPU extra): megatron's config reads TE's version
    from megatron.core.optimizer import optimizer_config

    monkeypatch.setattr(build, "transformer_engine_available", lambda: True)
    monkeypatch.setattr(optimizer_config, "is_te_min_version", lambda *a, **k: True)
    mcfg = build.megatron_optimizer_config(cfg, bf16=True)
    assert (mcfg.optimizer_cpu_offload, mcfg.optimizer_offload_fraction) == (True, 0.5)
    # Megatron-LM runs its offload inside the precision-aware optimizer only
    assert mcfg.use_precision_aware_optimizer and mcfg.use_distributed_optimizer
    plain = parse_run_config([], world_size=1).optimizer
    assert not build.megatron_optimizer_config(plain, bf16=True).optimizer_cpu_offload
    assert not build.megatron_optimizer_config(plain, bf16=True).use_precision_aware_optimizer
    with pytest.raises(ValueError, match="needs --use-distributed-optimizer"):
        parse_run_config(["--optimizer-cpu-offload"], world_size=1)  # OptimizerConfig's rule
    # predicted-KL control scales the GPU copy of the update only: refused with offload
    rl = ["--stage", "rl", "--kl-control", "predicted", "--use-distributed-optimizer"]
    with pytest.raises(ValueError, match="kl-control predicted with --optimizer-cpu-offload"):
        parse_run_config([*rl, "--optimizer-cpu-offload"], world_size=1)


def test_replicas_each_get_their_own_share_of_dedicated_devices():
    from megatron_logra.rollout.placement import split_replicas

    whole = plan_placement("dedicated", "4-7", engine_tp=2, cuda=True, node_devices=GPUS8,
                           local_world_size=4, visible="0,1,2,3,10,11,12,13", replicas=2)
    shares = split_replicas(whole, 2, 2, cuda=True, node_devices=GPUS8)
    assert [s.devices for s in shares] == [(4, 5), (6, 7)]
    assert [s.env for s in shares] == [{"CUDA_VISIBLE_DEVICES": "10,11"},
                                       {"CUDA_VISIBLE_DEVICES": "12,13"}]
    cpu = plan_placement("dedicated", "2-5", engine_tp=1, cuda=False, node_devices=list(range(6)),
                         local_world_size=2, replicas=2)
    shares = split_replicas(cpu, 2, 1, cuda=False, node_devices=list(range(6)))
    assert [s.engine_cores for s in shares] == [(2, 3), (4, 5)]
    assert [s.env for s in shares] == [{"VLLM_CPU_OMP_THREADS_BIND": "2,3"},
                                       {"VLLM_CPU_OMP_THREADS_BIND": "4,5"}]
    assert all(s.trainer_cores == (0, 1) for s in shares)


def test_replica_layouts_refused_with_the_fix():
    from megatron_logra.rollout.placement import split_replicas

    with pytest.raises(ValueError, match="3 GPUs for 4 engine ranks"):
        plan_placement("dedicated", "5-7", engine_tp=2, cuda=True, node_devices=GPUS8,
                       local_world_size=4, replicas=2)
    cpu = plan_placement("dedicated", "2-4", engine_tp=1, cuda=False, node_devices=list(range(6)),
                         local_world_size=2, replicas=2)
    with pytest.raises(ValueError, match="3 cores for --rollout-replicas 2 x"):
        split_replicas(cpu, 2, 1, cuda=False, node_devices=list(range(6)))
    with pytest.raises(ValueError, match="give each engine GPUs of its own"):
        split_replicas(_gpu("inherit"), 2, 2, cuda=True, node_devices=GPUS8)
    colocated = split_replicas(_gpu("colocated"), 2, 2, cuda=True, node_devices=GPUS8)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in colocated] == ["0,1", "2,3"]
    assert all(s.sleep_mode for s in colocated)
    inherit_cpu = plan_placement("inherit", "", engine_tp=1, cuda=False, node_devices=[0, 1],
                                 local_world_size=2)
    assert split_replicas(inherit_cpu, 2, 1, cuda=False, node_devices=[0, 1]) == [inherit_cpu] * 2


def test_engines_get_physical_gpu_ids_under_a_partial_allocation():
    """A job given physical GPUs 4 and 5 (Slurm: CUDA_VISIBLE_DEVICES=4,5) sees them as 0 and
    1; the engine process reads its CUDA_VISIBLE_DEVICES as physical ids, so each visible
    index is translated back, on the dedicated and on the colocated path alike."""
    from megatron_logra.rollout.placement import split_replicas

    two = [0, 1]
    dedicated = plan_placement("dedicated", "1", engine_tp=1, cuda=True, node_devices=two,
                               local_world_size=1, visible="4,5")
    assert dedicated.devices == (1,) and dedicated.env == {"CUDA_VISIBLE_DEVICES": "5"}
    colocated = plan_placement("colocated", "", engine_tp=1, cuda=True, node_devices=two,
                               local_world_size=2, visible="4,5", replicas=2)
    shares = split_replicas(colocated, 2, 1, cuda=True, node_devices=two, visible="4,5")
    assert [s.devices for s in shares] == [(0,), (1,)]  # visible indices (trainer ranks')
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in shares] == ["4", "5"]  # physical ids
    # one colocated engine inherits rank 0's list whole: TP rank i on visible GPU i
    alone = split_replicas(plan_placement("colocated", "", engine_tp=2, cuda=True,
                                          node_devices=two, local_world_size=2,
                                          visible="4,5"), 1, 2, cuda=True, node_devices=two,
                           visible="4,5")
    assert alone[0].env == {} and alone[0].devices == ()
    # the list may name GPUs by UUID; without one the indices are the physical ids
    uuids = split_replicas(colocated, 2, 1, cuda=True, node_devices=two,
                           visible="GPU-aa, GPU-bb")
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in uuids] == ["GPU-aa", "GPU-bb"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in split_replicas(
        colocated, 2, 1, cuda=True, node_devices=two)] == ["0", "1"]
    with pytest.raises(ValueError, match=r"not in node 0's CUDA_VISIBLE_DEVICES=4 "):
        split_replicas(colocated, 2, 1, cuda=True, node_devices=two, visible="4")
