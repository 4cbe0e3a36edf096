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
    """http://HOST:PORT of the vLLM servers that generate the rollouts, comma-separated for
    several (started by you, as docs/usage.md shows: VLLM_SERVER_DEV_MODE=1, --load-format
    dummy and --weight-transfer-config '{"backend": "mlogra"}'): each is one engine, the
    prompts are split over them as over --rollout-replicas, and every push goes to each
    one through vLLM's RL weight-transfer routes. Empty: trainer rank 0 starts them."""
    engine_url_wait_s: float = field(default=60.0, metadata=flag_spec(minimum=1))
    """How long the trainer waits for a server at --rollout-engine-url to answer (at the
    start and after a failure; it should already be up): a progress line every 10 s,
    then an error naming the URL and why it does not answer."""
    replicas: int = field(default=1, metadata=_POSITIVE)
    """Rollout engines (vLLM servers), each with the whole model: the prompts of every
    rollout are split over them in a fixed order, and every push goes to every one."""

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The servers at --rollout-engine-url, in order (empty: the trainer starts them)."""
        return tuple(u.strip().rstrip("/") for u in self.engine_url.split(",") if u.strip())

    @property
    def engines(self) -> int:
        """How many engines: one per --rollout-engine-url, else --rollout-replicas."""
        return len(self.engine_urls) or self.replicas

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

        urls = self.engine_urls
        for u in urls:
            url = urlparse(u)
            try:
                port = url.port
            except ValueError:
                port = None
            if url.scheme not in ("http", "https") or not url.hostname or not port:
                raise ValueError(f"--rollout-engine-url {u!r}: give each vLLM server's "
                                 f"address as http://HOST:PORT (several: comma-separated)")
        twice = sorted({u for u in urls if urls.count(u) > 1})
        if twice:
            raise ValueError(f"--rollout-engine-url names {', '.join(twice)} twice: each URL "
                             f"is one engine, give each server once")
        if self.placement != "inherit":
            raise ValueError("--rollout-placement places an engine the trainer starts; the "
                             "server at --rollout-engine-url runs where you started it: drop it")
        if self.replicas > 1:
            raise ValueError(f"--rollout-engine-url's {len(urls)} server(s) are the engines; "
                             f"--rollout-replicas > 1 starts engines here: drop it (give "
                             f"several URLs, comma-separated, for several engines)")
