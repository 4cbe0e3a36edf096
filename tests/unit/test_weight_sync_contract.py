"""The seam between weight pushes and the rollout engine (``weight_sync.contract``).

One vocabulary: every ``--weight-sync`` choice is a ``Transport`` with its needs
(``NEEDS``), and the backend's name is one constant that the server's command line and the
vLLM plugin both use. One interface: the vLLM server client has every member of
``PushTarget`` (what a push calls), with the same parameters. What each transport needs is
asked of the contract by the run's checks: a run that has it passes, a run missing any one
need is refused naming the flag, whichever config or check reaches it first.
"""

from __future__ import annotations

import inspect
import json

import pytest

from megatron_logra.cli import build_parser, parse_run_config
from megatron_logra.weight_sync.contract import (BACKEND, NEEDS, PushTarget, Transport,
                                                 check_engines, check_run,
                                                 check_steps_per_push)


def test_every_transport_is_a_flag_choice_with_its_needs():
    choices = next(a.choices for a in build_parser()._actions
                   if "--weight-sync" in a.option_strings)
    assert [str(c) for c in choices] == [t.value for t in Transport]
    assert set(NEEDS) == set(Transport)


def test_the_backend_name_has_one_home():
    from megatron_logra.rollout.server_process import server_argv
    from megatron_logra.rollout.types import ServerSpec
    from megatron_logra.weight_sync import vllm_plugin

    argv = server_argv(ServerSpec("/m", 64), 8000, cuda=False)
    assert json.loads(argv[argv.index("--weight-transfer-config") + 1]) == {"backend": BACKEND}
    assert vllm_plugin.BACKEND is BACKEND


def _members(cls) -> dict[str, object]:
    return {name: value for name, value in vars(cls).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def test_the_vllm_server_client_implements_what_a_push_needs():
    """Its methods and properties by their parameters; its attributes (``start_id``) as
    the client sets them."""
    from megatron_logra.rollout.vllm_server import VllmServer

    wanted = _members(PushTarget)
    assert len(wanted) == 8, sorted(wanted)
    for name in PushTarget.__annotations__:
        assert f"self.{name} = " in inspect.getsource(VllmServer), name
    for name, member in wanted.items():
        mine = inspect.getattr_static(VllmServer, name)
        assert isinstance(mine, property) == isinstance(member, property), name
        if not isinstance(member, property):
            assert list(inspect.signature(mine).parameters) == \
                list(inspect.signature(member).parameters), name


EXACT = dict(optimizer="logra", peft="none", bf16=True, master_weights="none",
             rollout_dtype="bfloat16", projection="rademacher")


@pytest.mark.parametrize("transport", list(Transport))
def test_a_run_meeting_a_transports_needs_passes_and_each_missing_need_is_named(transport):
    need = NEEDS[transport]
    run = dict(EXACT, peft="lora", optimizer="adam") if need.peft else dict(EXACT)
    check_run(transport, **run)
    check_steps_per_push(transport, 1)
    check_engines(transport, 1)
    missing = []
    if need.optimizer:
        missing.append(({"optimizer": "adam"}, "it needs --optimizer logra"))
    if need.bit_exact_bf16:
        missing += [({"bf16": False}, "missing: --bf16"),
                    ({"master_weights": "fp32"}, "missing: --logra-master-weights none"),
                    ({"rollout_dtype": "float32"}, "missing: --rollout-dtype bfloat16"),
                    ({"projection": "gaussian"}, "missing: --logra-projection rademacher")]
    if need.peft:
        missing.append(({"peft": "none"}, "it needs --peft lora"))
    for change, why in missing:
        with pytest.raises(ValueError, match=why):
            check_run(transport, **{**run, **change})
    if need.one_step_per_push:
        with pytest.raises(ValueError, match="with 2 optimizer steps per rollout batch"):
            check_steps_per_push(transport, 2)
    else:
        check_steps_per_push(transport, 2)
    if need.one_engine:
        with pytest.raises(ValueError, match=r"with several engines \(--rollout-replicas > 1"):
            check_engines(transport, 2)
    else:
        check_engines(transport, 2)


def test_the_cli_asks_the_contract_which_optimizer_keeps_its_updates():
    argv = ["--stage", "rl", "--optimizer", "logra", "--bf16", "--logra-master-weights", "none",
            "--rollout-dtype", "bfloat16"]
    for transport in Transport:
        if NEEDS[transport].peft:
            continue
        cfg = parse_run_config([*argv, "--weight-sync", transport.value], world_size=1)
        assert cfg.optimizer.logra.keep_updates == NEEDS[transport].keeps_logra_updates
