"""checkpoints_tools in one process: round trips, export completeness, bad input.

Every conversion goes through the CLI entry points (``main(argv)``), as a user
runs them. Round trips HF -> megatron -> HF must be bit-exact (fp32 in, fp32
out; bf16 in, bf16 out); the streamed checkpoint must hold exactly what
megatron-core's own ``dist_checkpointing.save`` writes for the same weights.
Logits parity at TP/PP > 1 is in tests/distributed/test_conversion_parity.py.
"""

from __future__ import annotations

import json
import shutil
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints_tools import hf_to_megatron, megatron_to_hf
from megatron_logra.model.tiny_assets import TINY_VARIANTS as FAMILIES
from megatron_logra.testing.tiny_checkpoint import write_tiny_hf_checkpoint


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _convert(capsys, *argv_pairs) -> tuple[int, str]:
    rc = argv_pairs[0].main(list(argv_pairs[1:]))
    captured = capsys.readouterr()
    return rc, captured.out + captured.err


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {name: write_tiny_hf_checkpoint(root / name, family, seed=i, **kw)
            for i, (name, (family, kw)) in enumerate(FAMILIES.items())}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_round_trip_is_bit_exact(name, tiny_folders, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MEGATRON_LOGRA_PROGRESS_INTERVAL", "0")  # every progress line
    hf = tiny_folders[name]
    ckpt, back = tmp_path / "ckpt", tmp_path / "back"
    rc, log = _convert(capsys, hf_to_megatron, "--hf-dir", str(hf), "--out", str(ckpt),
                       "--dtype", "fp32")
    assert rc == 0, log
    assert re.search(r"\[hf_to_megatron\] (\d+)/\1 chunks", log), log  # progress lines
    rc, log = _convert(capsys, megatron_to_hf, "--ckpt", str(ckpt), "--out", str(back),
                       "--hf-config-from", str(hf), "--dtype", "fp32", "--max-shard-size-mb", "1")
    assert rc == 0, log
    assert re.search(r"\[megatron_to_hf\] (\d+)/\1 parameters.*shard (\d+)/\2", log), log
    src, got = _hf_tensors(hf), _hf_tensors(back)
    if FAMILIES[name][1].get("tie_word_embeddings", True):
        src.pop("lm_head.weight", None)
    assert set(got) == set(src)
    for key, ref in src.items():
        assert got[key].dtype == ref.dtype and torch.equal(got[key], ref), key


def test_bf16_round_trip_is_bit_exact(tiny_folders, tmp_path, capsys):
    src = tiny_folders["qwen2_untied"]
    hf = tmp_path / "hf_bf16"
    shutil.copytree(src, hf)
    save_file({k: v.to(torch.bfloat16) for k, v in _hf_tensors(src).items()},
              str(hf / "model.safetensors"), metadata={"format": "pt"})
    assert _convert(capsys, hf_to_megatron, "--hf-dir", str(hf), "--out", str(tmp_path / "c"),
                    "--dtype", "bf16")[0] == 0
    assert _convert(capsys, megatron_to_hf, "--ckpt", str(tmp_path / "c"), "--out",
                    str(tmp_path / "b"), "--hf-config-from", str(hf))[0] == 0  # bf16 default
    got, ref = _hf_tensors(tmp_path / "b"), _hf_tensors(hf)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k]) for k in ref)
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.fixture(scope="module")
def exported(tiny_folders, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(hf source, converted checkpoint, multi-shard fp32 export) of the untied Llama."""
    root = tmp_path_factory.mktemp("export")
    hf = tiny_folders["llama_untied_kv1"]
    assert hf_to_megatron.main(["--hf-dir", str(hf), "--out", str(root / "ckpt")]) == 0
    assert megatron_to_hf.main(["--ckpt", str(root / "ckpt"), "--out", str(root / "out"),
                                "--hf-config-from", str(hf), "--dtype", "fp32",
                                "--max-shard-size-mb", "1"]) == 0
    return hf, root / "ckpt", root / "out"


def test_export_folder_is_complete_and_loads_in_transformers(exported):
    import transformers

    hf, _, out = exported
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size()
                                                  for t in _hf_tensors(out).values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float32" and cfg["tie_word_embeddings"] is False
    for f in ("generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json"):
        assert (out / f).read_bytes() == (hf / f).read_bytes(), f
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True).startswith("<|im_start|>user")
    tokens = torch.tensor([tokenizer.encode("The capital of France is")])
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    got = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ref(tokens).logits, got(tokens).logits)


def test_streamed_checkpoint_equals_megatron_core_save(exported, tmp_path):
    """Same keys, global shapes, dtypes and bytes as dist_checkpointing.save of the same model."""
    from megatron.core import dist_checkpointing

    from megatron_logra.convert.hf_checkpoint import load_hf_weights
    from megatron_logra.convert.megatron_dcp import CheckpointReader
    from megatron_logra.model.arch import load_arch
    from megatron_logra.model.provider import ModelBuildConfig, build_gpt_model
    from megatron_logra.runtime.device import init_runtime
    from megatron_logra.runtime.parallel import ParallelConfig, initialize

    hf, ckpt, _ = exported
    arch = load_arch(hf)
    initialize(ParallelConfig(), init_runtime().world_size, seed=0)
    model = [build_gpt_model(arch, ModelBuildConfig(), seed=0)]
    load_hf_weights(model, arch, hf)
    (tmp_path / "mcore").mkdir()
    dist_checkpointing.save(model[0].sharded_state_dict(), str(tmp_path / "mcore"))
    ours = CheckpointReader(ckpt / "iter_0000000")
    theirs = CheckpointReader(tmp_path / "mcore")
    ours_md, theirs_md = ours.metadata.state_dict_metadata, theirs.metadata.state_dict_metadata
    assert set(ours_md) == set(theirs_md)
    tensors = [k for k, v in theirs_md.items() if hasattr(v, "size")]
    assert len(tensors) == 9  # layers are stacked: one key per layer tensor kind
    for key in tensors:
        assert ours_md[key].size == theirs_md[key].size, key
        assert ours_md[key].properties.dtype == theirs_md[key].properties.dtype, key
        shape = tuple(theirs_md[key].size)
        region = ((0,) * len(shape), shape)
        assert torch.equal(ours.read_region(key, *region), theirs.read_region(key, *region)), key


# --------------------------------------------------------------------------- bad input


def _broken_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _shard_to_index(folder: Path) -> None:
    """Split the single model.safetensors into two shards + index (as big checkpoints are)."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, ks in halves.items() for k in ks}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _missing_shard(d: Path) -> None:
    _shard_to_index(d)
    (d / "model-00002-of-00002.safetensors").unlink()


def _missing_index_entry(d: Path) -> None:
    _shard_to_index(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.down_proj.weight"]
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _index_points_elsewhere(d: Path) -> None:
    _shard_to_index(d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    wm["model.norm.weight"] = ({"model-00001-of-00002.safetensors",
                                "model-00002-of-00002.safetensors"} - {wm["model.norm.weight"]}).pop()
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def _wrong_shape(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    tensors["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(128, 96)
    save_file(tensors, str(d / "model.safetensors"))


def _truncated(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])


def _corrupt_header(d: Path) -> None:
    data = bytearray((d / "model.safetensors").read_bytes())
    data[8:40] = b"\x00\xff" * 16
    (d / "model.safetensors").write_bytes(bytes(data))


BAD_INPUTS = {
    "missing shard": (_missing_shard, "missing from"),
    "missing index entry": (_missing_index_entry, "model.layers.1.mlp.down_proj.weight"),
    "index and shards disagree": (_index_points_elsewhere, "does not hold"),
    "shape mismatch": (_wrong_shape, "config.json implies"),
    "untied config without lm_head": (lambda d: _edit_config(d, tie_word_embeddings=False),
                                      "no lm_head.weight"),
    "config has fewer layers than weights": (lambda d: _edit_config(d, num_hidden_layers=3),
                                             "does not describe"),
    "config has more layers than weights": (lambda d: _edit_config(d, num_hidden_layers=5),
                                            "are missing"),
    "truncated safetensors": (_truncated, "truncated"),
    "corrupt safetensors header": (_corrupt_header, "corrupt safetensors header"),
    "no weights at all": (lambda d: (d / "model.safetensors").unlink(), "no safetensors weights"),
    "unsupported rope scaling": (lambda d: _edit_config(d, rope_scaling={"rope_type": "yarn",
                                                                          "factor": 4.0}),
                                 "rope scaling type 'yarn'"),
    "unsupported family": (lambda d: _edit_config(d, model_type="gpt2"), "model_type"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_refused_before_anything_is_written(case, tiny_folders, tmp_path, capsys):
    damage, message = BAD_INPUTS[case]
    hf = _broken_copy(tiny_folders["llama_tied"], tmp_path / "hf")
    damage(hf)
    out = tmp_path / "out"
    rc, log = _convert(capsys, hf_to_megatron, "--hf-dir", str(hf), "--out", str(out))
    assert rc == 2, log
    assert "error:" in log and message in log, log
    assert not out.exists() and not list(tmp_path.glob(".out.partial-*"))


def test_trainer_load_refuses_the_same_bad_folder(tiny_folders, tmp_path):
    from megatron_logra.cli import ConfigError, parse_run_config

    hf = _broken_copy(tiny_folders["llama_tied"], tmp_path / "hf")
    _truncated(hf)
    with pytest.raises(ConfigError, match="--load: .*truncated"):
        parse_run_config(["--load", str(hf)], world_size=1)


def test_output_folder_is_refused_unless_overwrite_and_kept_on_failure(tiny_folders, tmp_path,
                                                                      capsys):
    hf = tiny_folders["llama_tied"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc, log = _convert(capsys, hf_to_megatron, "--hf-dir", str(hf), "--out", str(out))
    assert rc == 2 and "is not empty; pass --overwrite" in log
    bad = _broken_copy(hf, tmp_path / "bad")
    _truncated(bad)
    rc, _ = _convert(capsys, hf_to_megatron, "--hf-dir", str(bad), "--out", str(out), "--overwrite")
    assert rc == 2 and (out / "precious.txt").read_text() == "keep me"
    rc, _ = _convert(capsys, hf_to_megatron, "--hf-dir", str(hf), "--out", str(out), "--overwrite")
    assert rc == 0 and not (out / "precious.txt").exists()
    assert (out / "latest").read_text().strip() == "iter_0000000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "out"]  # no temp folder left


def test_export_refuses_a_config_of_another_model(exported, tiny_folders, tmp_path, capsys):
    _, ckpt, _ = exported
    rc, log = _convert(capsys, megatron_to_hf, "--ckpt", str(ckpt), "--out", str(tmp_path / "o"),
                       "--hf-config-from", str(tiny_folders["qwen3_hd48"]))
    assert rc == 2 and "error:" in log
    assert not (tmp_path / "o").exists()


def test_trainer_load_accepts_hf_folders_and_converted_checkpoints(exported, tiny_folders):
    from megatron_logra.cli import ConfigError, parse_run_config

    hf, ckpt, _ = exported
    cfg = parse_run_config(["--load", str(hf)], world_size=1)
    assert cfg.model.model_dir == str(hf)
    assert cfg.checkpoint.load_format == "hf" and cfg.checkpoint.finetune
    cfg = parse_run_config(["--load", str(ckpt), "--model-dir", str(hf)], world_size=1)
    assert cfg.checkpoint.load_format == "megatron" and cfg.checkpoint.finetune
    with pytest.raises(ConfigError, match="another model"):
        parse_run_config(["--load", str(hf), "--model-dir", str(tiny_folders["qwen2_tied"])],
                         world_size=1)
