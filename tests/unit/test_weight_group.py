"""The weight group between trainer ranks and vLLM workers (``weight_sync.p2p``) on the paths
a CUDA run takes, checked on CPU with members as threads of this process:

- a NCCL group is built with torch's watchdog off for it (``NCCL_GROUP_ENV``, read by
  ``ProcessGroupNCCL``'s constructor: a failed wait then raises in the caller instead of
  torch taking the process down), and only while it is built: the default group keeps
  torchrun's settings (a stand-in ``ProcessGroupNCCL`` records the environment it is
  built under; this CPU torch has none). The installed torch's header still declares the
  variables and members this relies on;
- members of a NCCL group that share a GPU (a server at --rollout-engine-url on the
  trainer's GPUs) learn so from each other's GPU UUIDs and all build a real gloo group,
  which carries a message (NCCL would refuse: "Duplicate GPU detected");
- a sparse delta's shadows are host copies, one buffer per shard for the run.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from megatron_logra.weight_sync import p2p
from megatron_logra.weight_sync.channel import keep_on_host
from megatron_logra.weight_sync.p2p import GroupAddress

HEADER = (Path(torch.__file__).parent / "include/torch/csrc/distributed/c10d"
          / "ProcessGroupNCCL.hpp")


class FakeNCCL:
    """Stands in for ``dist.ProcessGroupNCCL``: records the environment it is built under."""

    built: list = []

    class Options:
        _timeout = None

    def __init__(self, store, rank, size, options):
        self.rank, self.options = rank, options
        self.env = {k: os.environ.get(k) for k in ("TORCH_NCCL_BLOCKING_WAIT",
                                                    "TORCH_NCCL_ASYNC_ERROR_HANDLING")}
        self.connected = None
        FakeNCCL.built.append(self)

    def eager_connect_single_device(self, device):
        self.connected = device


def _join_all(address: GroupAddress, uuids: list[str]) -> list:
    """Every member of ``address`` joins in a thread of its own (its GPU: cuda:rank, whose
    UUID is ``uuids[rank]``); their groups (or exceptions) by rank."""
    store = dist.HashStore()
    out: list = [None] * address.size

    def member(rank: int) -> None:
        try:
            out[rank] = p2p.join_group(address, rank, store, torch.device("cuda", rank))
        except Exception as exc:  # noqa: BLE001 - returned to the test
            out[rank] = exc
    threads = [threading.Thread(target=member, args=(r,)) for r in range(address.size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.fixture
def gpus(monkeypatch):
    """cuda:i has the UUID ``gpus[i]`` (set by the test); NCCL is ``FakeNCCL``."""
    uuids: list[str] = []
    monkeypatch.setattr(p2p, "gpu_uuid", lambda device: uuids[device.index])
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNCCL, raising=False)
    FakeNCCL.built = []
    return uuids


def test_a_nccl_weight_group_is_built_without_torchs_watchdog(gpus, monkeypatch):
    """torchrun sets TORCH_NCCL_ASYNC_ERROR_HANDLING=1: with a watchdog, a failed push's
    work would take the trainer down a minute after the bounded wait raised. The group is
    built in blocking-wait mode (no watchdog thread: the wait raises in the caller), and
    the process environment is as it was before and after."""
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    monkeypatch.delenv("TORCH_NCCL_BLOCKING_WAIT", raising=False)
    gpus[:] = ["GPU-a", "GPU-b", "GPU-c"]
    address = GroupAddress("127.0.0.1", 0, "g/", 2, 1, "nccl", timeout_s=30.0)
    groups = _join_all(address, gpus)
    assert all(isinstance(g, FakeNCCL) for g in groups), groups
    assert sorted(g.rank for g in FakeNCCL.built) == [0, 1, 2]
    for g in groups:
        assert g.env == {"TORCH_NCCL_BLOCKING_WAIT": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
        assert g.connected == torch.device("cuda", g.rank)  # bound to its own GPU
        assert g.options._timeout == timedelta(seconds=2 * 30 + 60)  # past wait_all's bound
        assert p2p.message_device(g, torch.device("cuda", g.rank)) == torch.device("cuda", g.rank)
    assert "TORCH_NCCL_BLOCKING_WAIT" not in os.environ  # the default group's settings stay
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    with pytest.raises(ValueError, match="needs this member's CUDA device"):
        p2p.join_group(address, 0, dist.HashStore())


def test_environment_is_restored_after_an_error(monkeypatch):
    monkeypatch.setenv("MLOGRA_TEST_A", "before")
    monkeypatch.delenv("MLOGRA_TEST_B", raising=False)
    with pytest.raises(RuntimeError, match="inside"):
        with p2p.environment({"MLOGRA_TEST_A": "x", "MLOGRA_TEST_B": "y"}):
            assert (os.environ["MLOGRA_TEST_A"], os.environ["MLOGRA_TEST_B"]) == ("x", "y")
            raise RuntimeError("inside")
    assert os.environ["MLOGRA_TEST_A"] == "before" and "MLOGRA_TEST_B" not in os.environ


def test_the_installed_torch_reads_the_setting_per_group():
    """What NCCL_GROUP_ENV relies on, in this torch's own header: the variable exists, and
    blocking wait and error handling are members of each group (read when it is built),
    while the dump flag that lets the default group's monitor end the process is static
    (process-wide), which is why a watchdog must not see the weight group's failure."""
    if not HEADER.is_file():
        pytest.skip("this torch ships no c10d headers")
    text = HEADER.read_text()
    assert '"TORCH_NCCL_BLOCKING_WAIT"' in text and '"TORCH_NCCL_ASYNC_ERROR_HANDLING"' in text
    assert "bool blockingWait_ = false;" in text
    assert "ErrorHandlingMode asyncErrorHandling_" in text
    assert "static std::atomic<bool> shouldDump_;" in text


def test_members_sharing_a_gpu_fall_back_to_a_gloo_group(gpus, capsys):
    """Trainer rank 0 and the server's worker 0 on one GPU (a server at
    --rollout-engine-url on the trainer's GPUs): every member sees the duplicate UUID and
    builds gloo; NCCL is never asked; a message crosses the group through host memory."""
    gpus[:] = ["GPU-a", "GPU-b", "GPU-a"]
    address = GroupAddress("127.0.0.1", 0, "s/", 2, 1, "nccl", timeout_s=30.0)
    groups = _join_all(address, gpus)
    assert all(isinstance(g, dist.ProcessGroupGloo) for g in groups), groups
    assert FakeNCCL.built == []
    assert p2p.message_device(groups[0], torch.device("cuda", 0)) == torch.device("cpu")
    note = capsys.readouterr().out
    assert "trainer rank 0 and engine worker 0 share GPU GPU-a" in note
    assert note.count("weight group:") == 1  # said once, by group rank 0
    sent = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(
        p2p.recv_message(groups[2], 0, torch.device("cpu"), 30.0)))
    reader.start()
    works, _ = p2p.send_message(groups[0], 2, {"kind": "test"}, [sent], torch.device("cpu"))
    p2p.wait_all(works, 30.0)
    reader.join(30)
    meta, tensors, _ = got[0]
    assert meta == {"kind": "test"} and torch.equal(tensors[0].reshape(3, 4), sent)


def test_shared_gpus_lists_each_gpu_held_twice():
    assert p2p.shared_gpus(["a", "b", "c"]) == {}
    assert p2p.shared_gpus(["a", "b", "a", "b", "c"]) == {"a": [0, 2], "b": [1, 3]}
    assert p2p.shared_note({"a": [1, 4]}, trainers=4) == ("trainer rank 1 and engine worker 0 "
                                                         "share GPU a")


def test_sparse_delta_shadows_are_host_copies_kept_for_the_run():
    """One host buffer per shard, reused by every push (a copy, never a view of the
    weights); on a GPU it is pinned host memory, so the shadows are not in the GPU's
    memory plan."""
    shadow: dict = {}
    value = torch.randn(4, 6).bfloat16()
    keep_on_host(shadow, "w", value)
    held = shadow["w"]
    assert held.device.type == "cpu" and torch.equal(held, value)
    assert held.data_ptr() != value.data_ptr() and not held.is_pinned()  # CPU value: unpinned
    value.add_(1)
    assert not torch.equal(held, value)  # a copy
    keep_on_host(shadow, "w", value)
    assert shadow["w"] is held and torch.equal(held, value)  # the same buffer, refreshed
    keep_on_host(shadow, "w", value.float())  # another dtype: a new buffer
    assert shadow["w"].dtype == torch.float32 and shadow["w"] is not held
