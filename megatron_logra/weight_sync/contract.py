"""The seam between the trainer's weight pushes and the rollout engine, typed in one place.

Everything both sides of a push must agree on lives here, and nothing else does: no
torch, no vLLM, no other module of the package, so any side imports it.

- ``Transport``: how a push travels (``--weight-sync``); the same word on the trainer's
  side, in the vLLM server client and on the wire (the ``update_info`` of vLLM's
  ``/update_weights`` names it ``transport``).
- ``BACKEND``: the name of this project's vLLM weight-transfer backend (the server's
  ``--weight-transfer-config``; ``vllm_plugin`` registers it under this name).
- The errors an engine raises (``EngineError``, ``PushInFlight``, ``PushRefused``) and how
  a push went (``Delivery``).
- ``TransportNeeds``: what each transport needs of the run (optimizer, precision, LoRA,
  steps per push, engines), and the checks every caller asks (the configs, the CLI,
  ``weight_sync.sync.WeightSync``, the sketch-delta push): the one place those rules are.
- ``PushTarget``: what a push needs from an engine, the methods ``weight_sync`` calls;
  ``rollout.vllm_server.VllmServer`` implements it.

Who restarts an engine is not part of it: a push that fails says so (``Delivery.failed``),
and the RL side (``rl.synced_engines``) has the engine restarted (``rollout.engines``)
and pushes again. Weight sync never restarts an engine, and the rollout side never
imports weight sync's pushes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Protocol

BACKEND = "mlogra"
"""This project's vLLM weight-transfer backend (``weight_sync.vllm_backend``)."""


class Transport(StrEnum):
    """How a weight push travels (``--weight-sync``); the values are the flag's choices."""

    FULL = "full"  # every HF tensor, each trainer rank its own pieces
    SPARSE_DELTA = "sparse-delta"  # the engine-dtype elements that changed (exact)
    SKETCH_DELTA = "sketch-delta"  # LoGRA: D and the projection seed per sketched weight
    LORA_ADAPTER = "lora-adapter"  # LoRA: the adapter only, served by vLLM's LoRA support


class EngineError(RuntimeError):
    """The engine died or refused a request; restart it and push the weights again."""


class PushInFlight(EngineError):
    """Generation or scoring was asked for while a push is open (started, not finished):
    the server would mix two versions, so it is refused (and the server keeps running);
    finish the push, or restart the server and push again."""


class PushRefused(ValueError):
    """A weight push was refused before anything was applied (a delta on the wrong base
    version); the engine still serves its previous version."""


@dataclass(frozen=True)
class Delivery:
    """How a push went, the same on every trainer rank: refused before anything was
    applied (the reason), or failed (the engine's error), else the bytes it took."""

    refused: str = ""
    failed: str = ""
    sent: int = 0


@dataclass(frozen=True)
class TransportNeeds:
    """What one transport needs of the run (``NEEDS[transport]``)."""

    optimizer: str | None = None
    """The only ``--optimizer`` whose updates it can send (None: any)."""
    peft: str | None = None
    """The ``--peft`` it sends (None: any)."""
    bit_exact_bf16: bool = False
    """Engine and trainer apply the same bf16 update with the same rounding bits: --bf16,
    --logra-master-weights none, --rollout-dtype bfloat16, Rademacher projections."""
    one_step_per_push: bool = False
    """It sends one optimizer step's factors: one step per rollout batch."""
    one_engine: bool = False
    """It diffs against what was last sent to one engine: --rollout-replicas 1."""
    keeps_logra_updates: bool = False
    """The LoGRA optimizer keeps each step's (D, coefficient, seed) for it."""
    engine_serves_adapter: bool = False
    """The engine serves the base (pushed in full, unmerged) plus a LoRA adapter."""


NEEDS: dict[Transport, TransportNeeds] = {
    Transport.FULL: TransportNeeds(),
    Transport.SPARSE_DELTA: TransportNeeds(one_engine=True),
    Transport.SKETCH_DELTA: TransportNeeds(optimizer="logra", bit_exact_bf16=True,
                                           one_step_per_push=True, keeps_logra_updates=True),
    Transport.LORA_ADAPTER: TransportNeeds(peft="lora", engine_serves_adapter=True),
}


def needs(transport: str) -> TransportNeeds:
    return NEEDS[Transport(transport)]


def check_steps_per_push(transport: str, steps: int) -> None:
    """Refuse a transport that sends one step's factors with ``steps`` optimizer steps per
    rollout batch (``--ppo-epochs`` x ``--ppo-minibatches``)."""
    if steps > 1 and needs(transport).one_step_per_push:
        raise ValueError(f"--weight-sync {transport} sends one LoGRA step's factors per "
                         f"push; with {steps} optimizer steps per rollout batch use "
                         f"--weight-sync sparse-delta or full")


def check_engines(transport: str, replicas: int) -> None:
    """Refuse a transport that diffs against one engine's view with ``replicas`` > 1."""
    if replicas > 1 and needs(transport).one_engine:
        raise ValueError(f"--weight-sync {transport} diffs against what was last sent, one "
                         "engine's view; with several engines (--rollout-replicas > 1, or "
                         "several --rollout-engine-url) use sketch-delta "
                         "(LoGRA), lora-adapter (LoRA) or full")


def check_run(transport: str, *, optimizer: str, peft: str, bf16: bool, master_weights: str,
              rollout_dtype: str, projection: str) -> None:
    """Refuse a transport the run's optimizer, LoRA and precision cannot keep exact
    (``config.RunConfig``): a sketch delta keeps the engine bit-identical to the trainer
    only when both apply the same bf16 update with the same rounding bits; anything else
    drifts (every checksum fails, or silently without verification)."""
    need = needs(transport)
    if need.optimizer is not None and optimizer != need.optimizer:
        raise ValueError(f"--weight-sync {transport} sends LoGRA's low-rank updates: it needs "
                         f"--optimizer {need.optimizer} (use --weight-sync full with Adam)")
    if need.bit_exact_bf16:
        inexact = [flag for flag, bad in (
            ("--bf16 (the trainer's weights are fp32)", not bf16),
            ("--logra-master-weights none (an fp32 master rounds differently from the "
             "engine)", master_weights != "none"),
            ("--rollout-dtype bfloat16 (an fp32 engine cannot hold the trainer's bf16 "
             "result)", rollout_dtype != "bfloat16"),
            ("--logra-projection rademacher (Gaussian entries are not exact in fp64 "
             "products)", projection != "rademacher")) if bad]
        if inexact:
            raise ValueError(f"--weight-sync {transport} keeps the engine bit-exact only "
                             "with --bf16 --logra-master-weights none --rollout-dtype bfloat16 "
                             "and Rademacher projections; missing: " + "; ".join(inexact) +
                             ". Add them, or use --weight-sync sparse-delta or full")
    if need.peft is not None and peft != need.peft:
        raise ValueError(f"--weight-sync {transport} sends a LoRA adapter to vLLM: it needs "
                         f"--peft {need.peft} (use --weight-sync full otherwise)")


class PushTarget(Protocol):
    """What a push needs from an engine (trainer rank 0 holds it): the methods
    ``weight_sync`` calls, each raising ``EngineError`` when the engine fails."""

    start_id: int
    """Which start of the engine this is: a fresh one (restarted) needs the weight group
    joined again (``channel.DirectChannel.join``)."""

    world_size: int
    """The engine's workers (its TP size): the trainer slices its shards for them
    (``channel.DirectChannel.use``)."""

    @property
    def version(self) -> int:
        """The weight version the engine serves (-1 before the first push)."""

    def begin_join(self, address: Any) -> None:
        """Every engine worker starts joining the trainer's weight group
        (``weight_sync.p2p.GroupAddress``); ``end_call`` waits for it."""

    def expect(self, transport: str, base_version: int | None, version: int) -> None:
        """Open a push of ``transport`` making ``version``; ``PushRefused`` (nothing
        applied) when ``base_version`` (a delta's, None for a full push) is not what the
        engine serves."""

    def begin_receive(self, rounds: int) -> None:
        """The workers start receiving ``rounds`` rounds of one message from every trainer
        rank; ``end_call`` waits for them."""

    def end_call(self) -> None:
        """Wait for the call ``begin_join`` or ``begin_receive`` started."""

    def commit(self, version: int) -> None:
        """Close the push: the engine serves ``version`` from now on."""

    def checksums(self) -> dict[str, str]:
        """The engine's checksum of every parameter of every worker
        (``weight_sync.checksums`` predicts them from the trainer's weights)."""

    def set_adapter(self, tensors: dict, config: dict, version: int) -> int:
        """Serve a LoRA adapter (PEFT's tensors and config) as ``version``; its bytes."""
