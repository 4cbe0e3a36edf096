"""Where the rollout engine runs (``--rollout-placement``, ``--rollout-devices``).

Pure planning, no vLLM and no device calls: ``plan_placement`` turns the flags and what
node 0 has into the engine process's environment and the trainer's share.

- ``inherit`` (the default): the engine inherits trainer rank 0's devices, as it always
  did (on a GPU node a TP-N engine lands on the node's first N visible GPUs, beside the
  trainer's ranks).
- ``dedicated``: the engine gets devices of its own on node 0 and the trainer's ranks
  never use them. On CUDA, ``--rollout-devices`` are indices of node 0's visible GPUs,
  one per engine TP rank, none of them one of the node's trainer ranks' GPUs (local rank
  i uses visible GPU i); the engine process sees only them (``CUDA_VISIBLE_DEVICES``).
  On CPU they are core ids: vLLM's threads are bound to them
  (``VLLM_CPU_OMP_THREADS_BIND``, split over the engine's TP ranks) and node 0's trainer
  ranks are kept off them (``os.sched_setaffinity``).
- ``colocated``: engine and trainer share devices and take turns. On CUDA the engine
  is started with vLLM's sleep mode: it releases its weights and KV cache (level 1:
  weights to host memory) while the trainer works, and takes them back to push and
  generate; the trainer frees its cached blocks before the engine wakes. vLLM has no
  sleep mode on CPU: there colocated behaves as inherit (said once at start-up).
On CUDA under ``inherit`` and ``colocated`` the engine's workers sit on trainer ranks'
GPUs, and NCCL refuses two members of one communicator on one GPU: the weight group is
then gloo, through host memory (``shares_trainer_gpus``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

PLACEMENTS = ("inherit", "dedicated", "colocated")


@dataclass(frozen=True)
class EnginePlacement:
    mode: str  # inherit | dedicated | colocated
    devices: tuple[int, ...] = ()  # the engine's GPUs (node 0's visible indices) or cores
    env: dict[str, str] = field(default_factory=dict)  # set in the engine process
    trainer_cores: tuple[int, ...] | None = None  # CPU dedicated: node 0's trainer cores
    sleep_mode: bool = False  # colocated on CUDA: vLLM's sleep/wake between phases
    note: str = ""  # said once at start-up (colocated on CPU)
    # CUDA, inherit or colocated: the engine's workers on trainer ranks' GPUs, so the
    # weight group is gloo through host memory (NCCL refuses two members on one GPU)
    shares_trainer_gpus: bool = False

    @property
    def engine_cores(self) -> tuple[int, ...]:
        """CPU, dedicated: the cores the engine process is bound to (else none)."""
        return self.devices if self.trainer_cores else ()


def parse_devices(spec: str) -> tuple[int, ...]:
    """``"6,7"`` or ``"4-7"`` or ``"0,2-3"`` -> (ids...); refused when malformed."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        first, dash, last = part.partition("-")
        try:
            ids = range(int(first), int(last) + 1) if dash else [int(first)]
        except ValueError:
            raise ValueError(f"--rollout-devices {spec!r}: {part!r} is not an id or a range "
                             f"like 6-7") from None
        out.extend(ids)
    if any(i < 0 for i in out) or len(set(out)) != len(out):
        raise ValueError(f"--rollout-devices {spec!r}: ids must be distinct and >= 0")
    return tuple(out)


def check_placement_flags(mode: str, devices_spec: str) -> tuple[int, ...]:
    """The ids of ``--rollout-devices`` when the flag pair makes sense (parsing checks it;
    the devices themselves are checked at start-up), else ValueError with the fix."""
    if mode not in PLACEMENTS:
        raise ValueError(f"--rollout-placement {mode!r}: choose {', '.join(PLACEMENTS)}")
    devices = parse_devices(devices_spec)
    if mode != "dedicated" and devices:
        raise ValueError(f"--rollout-devices is for --rollout-placement dedicated (got "
                         f"{mode})")
    if mode == "dedicated" and not devices:
        raise ValueError("--rollout-placement dedicated needs --rollout-devices (the engine's "
                         "GPUs, e.g. 6,7, or on CPU its cores, e.g. 6-7)")
    return devices


def plan_placement(mode: str, devices_spec: str, *, engine_tp: int, cuda: bool,
                   node_devices: list[int], local_world_size: int,
                   visible: str | None = None,
                   remote_engine: bool = False, replicas: int = 1) -> EnginePlacement:
    """The engine's placement on node 0, or ValueError naming the flags and the fix.

    ``node_devices``: CUDA: range(visible GPU count); CPU: the cores node 0's processes
    may run on (``os.sched_getaffinity``). ``local_world_size``: trainer ranks on node 0.
    ``visible``: node 0's ``CUDA_VISIBLE_DEVICES`` (the engine's ids are translated
    through it). ``remote_engine``: the engine is a vLLM server the user runs
    (--rollout-engine-url). ``replicas``: the engines placed together (each one's share:
    ``split_replicas``)."""
    devices = check_placement_flags(mode, devices_spec)
    engine_ranks = engine_tp * replicas
    if mode == "colocated" and not cuda:
        return EnginePlacement(mode, note="--rollout-placement colocated: vLLM has no sleep "
                               "mode on CPU; the engine and the trainer share the cores as "
                               "with inherit")
    if mode != "dedicated":
        return EnginePlacement(mode, sleep_mode=mode == "colocated",
                               shares_trainer_gpus=cuda and not remote_engine)
    missing = [d for d in devices if d not in node_devices]
    if missing:
        raise ValueError(f"--rollout-devices {devices_spec}: {missing} do not exist on node 0 "
                         f"({'visible GPUs' if cuda else 'usable cores'}: "
                         f"{_ranges(node_devices)})")
    if cuda:
        return _dedicated_gpus(devices, engine_ranks, local_world_size, visible)
    rest = tuple(c for c in node_devices if c not in devices)
    if not rest:
        raise ValueError(f"--rollout-devices {devices_spec} leaves no core to the trainer "
                         f"(usable cores: {_ranges(node_devices)})")
    if len(devices) < engine_ranks:
        raise ValueError(f"--rollout-devices {devices_spec}: {len(devices)} cores for "
                         f"{_engine_ranks(engine_tp, replicas)}; give at least one core per "
                         f"engine rank")
    per = len(devices) // engine_tp  # each engine TP rank binds its own run of cores
    bind = "|".join(",".join(map(str, devices[r * per:(r + 1) * per]))
                    for r in range(engine_tp))
    return EnginePlacement("dedicated", devices, {"VLLM_CPU_OMP_THREADS_BIND": bind},
                           trainer_cores=rest)


def _engine_ranks(engine_tp: int, replicas: int) -> str:
    tp = f"--rollout-tensor-parallel-size {engine_tp}"
    return f"--rollout-replicas {replicas} x {tp}" if replicas > 1 else tp


def _dedicated_gpus(devices: tuple[int, ...], engine_ranks: int, local_world_size: int,
                    visible: str | None) -> EnginePlacement:
    if len(devices) != engine_ranks:
        raise ValueError(f"--rollout-devices {','.join(map(str, devices))}: {len(devices)} "
                         f"GPUs for {engine_ranks} engine ranks (--rollout-replicas x "
                         f"--rollout-tensor-parallel-size); give one per engine rank")
    trainer = set(range(local_world_size))
    shared = sorted(trainer.intersection(devices))
    if shared:
        raise ValueError(f"--rollout-devices: GPUs {shared} are used by node 0's trainer "
                         f"ranks (local rank i uses GPU i, 0-{local_world_size - 1} here); "
                         f"start fewer processes per node (--nproc-per-node) or give the "
                         f"engine other GPUs")
    return EnginePlacement("dedicated", devices,
                           {"CUDA_VISIBLE_DEVICES": physical_gpus(devices, visible)})


def physical_gpus(devices, visible: str | None) -> str:
    """The engine process's ``CUDA_VISIBLE_DEVICES`` for node 0's visible GPU indices
    ``devices``: the child reads the variable as physical ids (or UUIDs), so each index is
    translated through node 0's own ``visible`` list ("4,5" and index 1 -> "5"); without
    one the indices are the physical ids."""
    if not visible:
        return ",".join(map(str, devices))
    physical = [p.strip() for p in visible.split(",") if p.strip()]
    outside = [d for d in devices if d >= len(physical)]
    if outside:
        raise ValueError(f"GPUs {outside} are not in node 0's CUDA_VISIBLE_DEVICES={visible} "
                         f"({len(physical)} GPUs): give indices below {len(physical)}")
    return ",".join(physical[d] for d in devices)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, ids = [], sorted(ids)
    for i in ids:
        if out and i == out[-1][1] + 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in out)


def split_replicas(placement: EnginePlacement, replicas: int, engine_tp: int, *,
                   cuda: bool, node_devices: list[int],
                   visible: str | None = None) -> list[EnginePlacement]:
    """``placement`` for each of ``replicas`` engines (``--rollout-replicas``), or ValueError
    naming the flags and the fix. ``visible``: node 0's ``CUDA_VISIBLE_DEVICES``
    (``physical_gpus``).

    - dedicated: ``--rollout-devices`` split in ``replicas`` equal runs, one per engine (on
      CUDA one GPU per engine TP rank, on CPU at least one core per engine TP rank);
    - colocated on CUDA: engine r on the r-th run of ``engine_tp`` of node 0's GPUs (the
      trainer's, in turns as one engine does; ``devices``: their visible indices, its
      ``CUDA_VISIBLE_DEVICES`` their physical ids);
    - inherit (or colocated on CPU): every engine on trainer rank 0's devices (CPU cores
      shared; on CUDA refused: the engines would all sit on the first GPUs)."""
    if replicas == 1:
        return [placement]
    if placement.mode == "dedicated":
        devices = placement.devices
        if len(devices) % replicas or len(devices) // replicas < engine_tp:
            unit = "GPUs" if cuda else "cores"
            raise ValueError(f"--rollout-devices: {len(devices)} {unit} for --rollout-replicas "
                             f"{replicas} x --rollout-tensor-parallel-size {engine_tp}; give "
                             f"each engine its own equal share, at least one per engine rank")
        per = len(devices) // replicas
        return [_dedicated_share(placement, devices[r * per:(r + 1) * per], engine_tp, cuda)
                for r in range(replicas)]
    if not cuda:
        return [placement] * replicas
    if placement.mode == "colocated":
        if replicas * engine_tp > len(node_devices):
            raise ValueError(f"--rollout-replicas {replicas} x --rollout-tensor-parallel-size "
                             f"{engine_tp} colocated engines need {replicas * engine_tp} GPUs; "
                             f"node 0 has {len(node_devices)}")
        shares = [tuple(node_devices[r * engine_tp:(r + 1) * engine_tp]) for r in range(replicas)]
        return [replace(placement, devices=share, env={
            **placement.env, "CUDA_VISIBLE_DEVICES": physical_gpus(share, visible)})
            for share in shares]
    raise ValueError(f"--rollout-replicas {replicas} on GPUs: give each engine GPUs of its own "
                     f"with --rollout-placement dedicated --rollout-devices (N x TP GPUs), or "
                     f"share the trainer's with --rollout-placement colocated")


def _dedicated_share(placement: EnginePlacement, share: tuple[int, ...], engine_tp: int,
                     cuda: bool) -> EnginePlacement:
    """One replica's part of a dedicated placement: its own devices (the trainer's cores are
    the whole placement's)."""
    if cuda:
        physical = placement.env.get("CUDA_VISIBLE_DEVICES", "").split(",")
        position = {d: i for i, d in enumerate(placement.devices)}
        ids = [physical[position[d]] for d in share]
        return replace(placement, devices=share, env={"CUDA_VISIBLE_DEVICES": ",".join(ids)})
    per = len(share) // engine_tp
    bind = "|".join(",".join(map(str, share[r * per:(r + 1) * per])) for r in range(engine_tp))
    return replace(placement, devices=share, env={"VLLM_CPU_OMP_THREADS_BIND": bind})
