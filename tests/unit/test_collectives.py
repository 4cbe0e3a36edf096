"""runtime.collectives: rank 0's value, or its exception, on every rank of a real gloo
group (two spawned processes, every check in one launch), and ``fn()`` alone without
torch.distributed."""

from __future__ import annotations

import datetime
import pickle

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_logra.weight_sync.contract import EngineError, PushRefused
from megatron_logra.runtime import collectives
from megatron_logra.runtime.collectives import Rank0Error, from_rank0, rank0_value
from megatron_logra.runtime.device import free_port

WORLD = 2


class TwoArgError(RuntimeError):
    """Its constructor takes other arguments than its ``args``: pickle cannot re-create it."""

    def __init__(self, what: str, code: int):
        super().__init__(f"{what} (code {code})")


def _raise(exc: Exception):
    raise exc


def _raises(fn, kind: type[Exception], match: str) -> Exception:
    with pytest.raises(kind, match=match) as info:
        fn()
    return info.value


def _worker(rank: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        _checks(rank)
    finally:
        dist.destroy_process_group()


def _checks(rank: int) -> None:
    # the value reaches every rank; only rank 0 calls fn; rank 0 keeps its own object
    calls = []
    mine = {"from": rank, "ids": [1, 2, 3]}
    got = from_rank0(lambda: calls.append(rank) or mine)
    assert got == {"from": 0, "ids": [1, 2, 3]}
    assert calls == ([0] if rank == 0 else [])
    assert (got is mine) == (rank == 0)
    assert from_rank0(lambda: None) is None

    # another source rank, and a group of its own
    assert from_rank0(lambda: f"rank {rank}", src=1) == "rank 1"
    group = dist.new_group([0, 1])
    assert from_rank0(lambda: rank + 10, group=group) == 10
    assert rank0_value(rank) == 0 and rank0_value(f"failed on {rank}", src=1) == "failed on 1"

    # rank 0's exception on every rank: itself on rank 0, the same type and message elsewhere
    original = ValueError("the fix: --rollout-kv-cache-gib 4")
    raised = _raises(lambda: from_rank0(lambda: _raise(original)), ValueError,
                     "^the fix: --rollout-kv-cache-gib 4$")
    if rank == 0:
        assert raised is original
    else:
        assert type(raised) is ValueError and not hasattr(raised, "__notes__")
    _raises(lambda: from_rank0(lambda: _raise(PushRefused("base 3, serving 2"))),
            PushRefused, "^base 3, serving 2$")
    _raises(lambda: from_rank0(lambda: _raise(EngineError("the engine died"))),
            EngineError, "^the engine died$")
    _raises(lambda: from_rank0(lambda: _raise(OSError(28, "No space left on device"))),
            OSError, r"No space left on device")

    # an exception the other ranks cannot re-create: a Rank0Error with its type and message
    def local_class():
        class Local(KeyError):
            pass
        raise Local("not importable")
    for fn, kind, message in ((lambda: _raise(TwoArgError("bad config", 7)), TwoArgError,
                               "bad config (code 7)"),
                              (local_class, KeyError, "'not importable'")):
        raised = _raises(lambda: from_rank0(fn), Exception, "")
        if rank == 0:
            assert isinstance(raised, kind) and str(raised) == message
        else:
            assert isinstance(raised, Rank0Error) and isinstance(raised, RuntimeError)
            assert raised.message == message and raised.src == 0
            assert raised.kind in ("TwoArgError", "Local")
            assert str(raised) == f"{raised.kind} on rank 0: {message}"

    # a value that cannot be pickled is an error on every rank, not a hang
    _raises(lambda: from_rank0(lambda: (lambda: None)), (pickle.PicklingError, AttributeError),
            "pickle")

    # an exception on rank 1 as the source
    _raises(lambda: from_rank0(lambda: _raise(ValueError(f"rank {rank} refused")), src=1),
            ValueError, "^rank 1 refused$")

    # the group still works after every failure above
    assert from_rank0(lambda: "still in step") == "still in step"


def test_from_rank0_in_a_gloo_group():
    mp.start_processes(_worker, args=(free_port(),), nprocs=WORLD, join=True,
                       start_method="spawn")


def test_from_rank0_without_torch_distributed(monkeypatch):
    """One process, no group: ``fn()`` itself, its exception as raised."""
    monkeypatch.setattr(collectives.dist, "is_initialized", lambda: False)
    calls = []
    assert from_rank0(lambda: calls.append(1) or "value") == "value" and calls == [1]
    assert rank0_value(5) == 5
    original = ValueError("refused")
    with pytest.raises(ValueError) as info:
        from_rank0(lambda: _raise(original))
    assert info.value is original
    unpicklable = lambda: None  # noqa: E731 - a value no group could send
    assert from_rank0(lambda: unpicklable) is unpicklable
