"""Checkpoint manifests (``checkpoint.manifest``): every file with its size and CRC32;
a missing, truncated, grown or corrupt file, and a missing or corrupt manifest, are
found and named; the files split over ranks cover each file once."""

from __future__ import annotations

import pytest

from megatron_logra.checkpoint import manifest as cv


@pytest.fixture
def ckpt(tmp_path):
    (tmp_path / "__0_0.distcp").write_bytes(b"a" * 1000)
    (tmp_path / "__1_0.distcp").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / ".metadata").write_bytes(b"meta")
    files = cv.checkpoint_files(tmp_path)
    cv.write_manifest(tmp_path, cv.manifest_entries(tmp_path, files))
    return tmp_path


def _problems(ckpt):
    manifest = cv.read_manifest(ckpt)
    return cv.verify(ckpt, list(manifest), manifest)


def test_intact_checkpoint_has_no_problems(ckpt):
    assert cv.checkpoint_files(ckpt) == ["__0_0.distcp", "__1_0.distcp", "sub/.metadata"]
    assert _problems(ckpt) == []


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "__1_0.distcp").unlink(), "__1_0.distcp is missing"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"a" * 999), "has 999 bytes, 1000 were written (truncated)"),
    (lambda p: (p / "sub" / ".metadata").write_bytes(b"meta+"), "has 5 bytes, 4 were written (grown)"),
    (lambda p: (p / "__0_0.distcp").write_bytes(b"a" * 999 + b"b"), "__0_0.distcp is corrupt"),
])
def test_damage_is_found_and_named(ckpt, damage, message):
    damage(ckpt)
    problems = _problems(ckpt)
    assert len(problems) == 1 and message in problems[0], problems


def test_missing_or_corrupt_manifest(ckpt):
    (ckpt / cv.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is corrupt"):
        cv.read_manifest(ckpt)
    (ckpt / cv.MANIFEST).unlink()
    with pytest.raises(ValueError, match="manifest.json is missing: the save did not finish"):
        cv.read_manifest(ckpt)


def test_ranks_split_the_files():
    files = [f"f{i}" for i in range(7)]
    parts = [cv.files_for_rank(files, r, 3) for r in range(3)]
    assert sorted(sum(parts, [])) == files
