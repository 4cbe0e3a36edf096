"""A save that fails in the middle leaves the previous checkpoint intact and selected (a
process that dies mid-save: tests/distributed/test_fault_tolerance.py)."""

from __future__ import annotations

import pytest

from megatron_logra.checkpoint import save
from megatron_logra.checkpoint.layout import resolve_load_dir
from megatron_logra.checkpoint.meta import CheckpointMeta
from megatron_logra.cli import parse_run_config


def _cfg(tmp_path, *extra):
    return parse_run_config(["--train-iters", "2", "--global-batch-size", "2",
                             "--micro-batch-size", "1", "--seq-length", "64", "--dataset-size", "8",
                             "--output-dir", str(tmp_path / "out"), "--save", str(tmp_path / "ck"),
                             *extra], world_size=1)


def test_failed_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    from megatron_logra.training.sft import run_sft

    result = run_sft(_cfg(tmp_path))
    ck = tmp_path / "ck"
    assert resolve_load_dir(ck) == ck / "iter_0000002"

    def crashing_save(state, directory, **kwargs):
        (tmp_path / "ck" / "iter_0000003.partial" / "half_written.distcp").write_bytes(b"\0" * 64)
        raise RuntimeError("simulated crash during save")

    monkeypatch.setattr(save.dist_checkpointing, "save", crashing_save)
    with pytest.raises(save.CheckpointSaveError,
                       match="iter_0000003 not saved: writing the state failed .RuntimeError: "
                             "simulated crash during save.; the partial save is removed"):
        save.save_checkpoint(ck, result.objects, {}, CheckpointMeta(step=3))
    monkeypatch.undo()
    assert (ck / "latest").read_text().strip() == "iter_0000002"
    assert not (ck / "iter_0000003").exists() and not (ck / "iter_0000003.partial").exists()
    assert resolve_load_dir(ck) == ck / "iter_0000002"

    # the previous checkpoint still loads and resumes
    resumed = run_sft(_cfg(tmp_path, "--load", str(ck), "--train-iters", "3"))
    assert [r["step"] for r in resumed.records] == [3]
    assert resolve_load_dir(ck) == ck / "iter_0000003"


def test_resume_refuses_other_optimizer_sharding(tmp_path):
    from megatron_logra.training.sft import run_sft

    run_sft(_cfg(tmp_path))
    with pytest.raises(ValueError, match="resume without --use-distributed-optimizer"):
        run_sft(_cfg(tmp_path, "--load", str(tmp_path / "ck"), "--train-iters", "3",
                     "--use-distributed-optimizer"))


def test_checkpoint_for_another_model_is_refused(tmp_path):
    from megatron_logra.model.tiny_assets import write_tiny_model_dir
    from megatron_logra.training.sft import run_sft

    run_sft(_cfg(tmp_path))
    other = write_tiny_model_dir(tmp_path / "other", num_layers=2)
    with pytest.raises(ValueError, match="saved for another model"):
        run_sft(_cfg(tmp_path, "--load", str(tmp_path / "ck"), "--model-dir", str(other)))


def test_the_manager_saves_on_cadence_keeps_k_and_resumes_the_newest_that_verifies(
        tmp_path, capsys):
    """``checkpoint.manager.CheckpointManager``, driven by the loop: a save every
    --save-interval updates and at the end, the newest --save-keep kept; --auto-resume
    starts from the newest that verifies, passing over a damaged one (said so), and the
    resumable parts (the scheduler) come back with it."""
    from megatron_logra.training.sft import run_sft

    first = run_sft(_cfg(tmp_path, "--train-iters", "3", "--save-interval", "1",
                         "--save-keep", "2"))
    ck = tmp_path / "ck"
    assert sorted(p.name for p in ck.glob("iter_*")) == ["iter_0000002", "iter_0000003"]
    assert first.last_checkpoint == ck / "iter_0000003"
    (ck / "iter_0000003" / "common.pt").write_bytes(b"damaged")
    capsys.readouterr()
    resumed = run_sft(_cfg(tmp_path, "--train-iters", "4", "--auto-resume"))
    out = capsys.readouterr().out
    assert "auto-resume: passing over a damaged checkpoint" in out and "iter_0000003" in out
    assert "resumed from" in out and "iter_0000002 at step 2" in out
    assert [r["step"] for r in resumed.records] == [3, 4]
    assert resumed.objects.scheduler.num_steps == 4  # restored at 2 (fresh: 2), 2 more updates
