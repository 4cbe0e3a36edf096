"""The rollout engines' settings (``--rollout-*``), checked when built; no torch, no vLLM.

``RLConfig.rollout`` holds them. What one server is then started with (this slice plus
what the trainer derives: the model folder, the sequence length, its devices...) is
``rollout.types.ServerSpec``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_logra.flags import check_fields, flag_spec
from megatron_logra.rollout.placement import check_placement_flags

_POSITIVE = flag_spec(minimum=1)


@dataclass(frozen=True)
class EngineConfig:
    """The rollout engines (vLLM servers): their sampling seed, layout, precision, KV cache,
    placement, and how many."""

    FLAG_PREFIX: ClassVar[str] = "rollout-"

    seed: int = 0
    """Sampling seed."""
    tensor_parallel_size: int = field(default=1, metadata=_POSITIVE)
    """vLLM tensor-parallel size of the rollout engine."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """vLLM weights dtype (float32: trainer/engine logprobs agree to ~1e-6)."""
    kv_cache_gib: float = 1.0
    """vLLM KV cache size."""
    placement: Literal["inherit", "dedicated", "colocated"] = "inherit"
    """Where the engine runs (``rollout.placement``): on trainer rank 0's devices (inherit),
    on devices of its own (dedicated: --rollout-devices), or sharing the trainer's and
    taking turns with it (colocated: vLLM's sleep mode on CUDA)."""
    devices: str = ""
    """--rollout-placement dedicated: node 0's GPUs (visible indices, one per engine TP
    rank, e.g. 6,7) or on CPU its cores (e.g. 6-7) for the engine alone."""
    engine_url: str = ""
    """http://HOST:PORT of a vLLM server to generate the rollouts (started by you, as
    docs/usage.md shows: VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config
    '{"backend": "mlogra"}'); the trainer pushes its weights into it through vLLM's RL
    weight-transfer routes. Empty: trainer rank 0 starts one."""
    replicas: int = field(default=1, metadata=_POSITIVE)
    """Rollout engines (vLLM servers), each with the whole model: the prompts of every
    rollout are split over them in a fixed order, and every push goes to every one."""

    def __post_init__(self) -> None:
        """Raise ValueError naming the flags and the fix."""
        check_fields(self)
        if self.kv_cache_gib <= 0:
            raise ValueError("--rollout-kv-cache-gib must be > 0")
        check_placement_flags(self.placement, self.devices)
        if self.engine_url:
            self._check_server_engine()

    def _check_server_engine(self) -> None:
        from urllib.parse import urlparse

        url = urlparse(self.engine_url)
        if url.scheme not in ("http", "https") or not url.hostname or not url.port:
            raise ValueError(f"--rollout-engine-url {self.engine_url!r}: give the vLLM "
                             f"server's address as http://HOST:PORT")
        if self.placement != "inherit":
            raise ValueError("--rollout-placement places an engine the trainer starts; the "
                             "server at --rollout-engine-url runs where you started it: drop it")
        if self.replicas > 1:
            raise ValueError("--rollout-engine-url names one server; --rollout-replicas > 1 "
                             "starts its engines here: drop one of them")
