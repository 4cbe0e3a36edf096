"""The checkpoint package's pure parts: resumable parts by name, the typed meta, the layout's
selection and the trainer's save cadence."""

from __future__ import annotations

import json

import pytest

from megatron_logra.checkpoint import layout
from megatron_logra.checkpoint.meta import CheckpointMeta, read_meta
from megatron_logra.checkpoint.state import ResumableState
from megatron_logra.config import CheckpointConfig
from megatron_logra.checkpoint.manager import save_due


class Counter:
    def __init__(self, value: int = 0):
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_parts_are_saved_by_name_and_restored_as_they_register():
    saved = ResumableState()
    saved.register("scheduler", Counter(7))
    saved.register("rl_baseline", Counter(3))
    state = saved.state_dict()
    assert state == {"scheduler": {"value": 7}, "rl_baseline": {"value": 3}}

    resumed = ResumableState(state)
    scheduler, baseline, kl = Counter(), Counter(), Counter(-1)
    resumed.register("scheduler", scheduler, required=True)
    resumed.register("rl_baseline", baseline)
    resumed.register("kl_controller", kl)  # not in the checkpoint: keeps its fresh state
    assert (scheduler.value, baseline.value, kl.value) == (7, 3, -1)
    assert resumed.names == ["scheduler", "rl_baseline", "kl_controller"]
    with pytest.raises(ValueError, match="'scheduler' is registered already"):
        resumed.register("scheduler", Counter())


def test_a_required_part_missing_from_a_resumed_checkpoint_is_named():
    resumed = ResumableState({"rl_baseline": {"value": 1}}, source="checkpoint X")
    with pytest.raises(KeyError, match="checkpoint X holds no scheduler state"):
        resumed.register("scheduler", Counter(), required=True)
    ResumableState().register("scheduler", Counter(), required=True)  # fresh run: fine


def test_format_2_nested_rl_parts_restore_under_their_names():
    old = {"scheduler": {"value": 5}, "rl": {"baseline": {"value": 2}, "kl": {"value": 9}}}
    resumed = ResumableState(old)
    parts = {name: Counter() for name in ("scheduler", "rl_baseline", "kl_controller")}
    for name, part in parts.items():
        resumed.register(name, part)
    assert {n: p.value for n, p in parts.items()} == {"scheduler": 5, "rl_baseline": 2,
                                                      "kl_controller": 9}


def test_meta_round_trips_and_reads_older_formats(tmp_path):
    meta = CheckpointMeta(step=4, arch={"hidden": 8}, optimizer_sharding="distributed")
    meta.write(tmp_path)
    assert read_meta(tmp_path) == meta
    (tmp_path / layout.META).write_text(json.dumps({"step": 2, "arch": None}))
    assert read_meta(tmp_path) == CheckpointMeta(step=2, format_version=1)
    (tmp_path / layout.META).write_text(json.dumps({"step": 2, "colour": "red"}))
    with pytest.raises(ValueError, match="megatron_logra.json is unreadable"):
        read_meta(tmp_path)


def test_meta_refuses_the_wrong_optimizer_state_with_the_flag_to_pass(tmp_path):
    distributed = CheckpointMeta(step=1, optimizer_sharding="distributed")
    distributed.check_resumable("distributed", tmp_path)
    with pytest.raises(ValueError, match="resume with --use-distributed-optimizer"):
        distributed.check_resumable("replicated", tmp_path)
    converted = CheckpointMeta(step=0, weights_only=True,
                               source={"tool": "checkpoints_tools.hf_to_megatron"})
    with pytest.raises(ValueError, match="hf_to_megatron.*load it with --finetune"):
        converted.check_resumable("replicated", tmp_path)


def _complete(root, step):
    folder = root / layout.iter_dir_name(step)
    folder.mkdir(parents=True)
    CheckpointMeta(step=step).write(folder)
    return folder


def test_layout_selects_resumes_and_prunes(tmp_path):
    a, b, c = (_complete(tmp_path, s) for s in (1, 2, 3))
    (tmp_path / "iter_0000004.partial").mkdir()
    layout.select(tmp_path, b.name)
    assert layout.resolve_load_dir(tmp_path) == b
    assert layout.resume_candidates(tmp_path) == [b, c, a]  # the selected one first
    assert layout.prune(tmp_path, keep=1) == [a]  # never the selected one
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000002", "iter_0000003", "iter_0000004.partial", "latest"]


def test_save_cadence():
    ck = CheckpointConfig(save="ck", save_interval=3)
    assert [d for d in range(1, 8) if save_due(ck, d, last=d == 7)] == [3, 6, 7]
    assert not save_due(CheckpointConfig(save_interval=3), 3, last=True)  # no --save
