"""Every recipe in recipes/ passes the launcher's checks at the world size it is run at
(config only: the model is a folder of the right shape without weights, and ``--load``
is dropped, as the commands that use the recipes give their own), and says what the
documented runs are."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_logra.cli import build_parser, parse_run_config
from megatron_logra.config_file import file_tokens
from megatron_logra.memory.shapes import PAPER_SHAPES, hf_config
from test_paper_recipe import paper_shape  # the paper's model shapes

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if not p.name.startswith("_"))


def _world_size(recipe: Path) -> int:
    if recipe.parent.name == "paper" and recipe.stem != "cpu" and recipe.stem != "cpu-sft":
        return 8  # the Table 1 runs: one 8-GPU node
    return 1 if recipe.stem == "cpu-sft" else 2  # the CPU runs: torchrun on 2 cores


def _without_load(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
        elif tok == "--load":
            skip = True
        elif tok != "--finetune":
            out.append(tok)
    return out


def test_every_documented_run_has_its_recipe():
    names = {str(p.relative_to(REPO / "recipes")) for p in RECIPES}
    assert {f"paper/{m}-{s}.yaml" for m in ("dense", "logra") for s in ("1.5b", "7b", "27b")
            } | {"paper/cpu.yaml", "paper/cpu-sft.yaml", "demo/sft.yaml", "demo/rl.yaml",
                 "quality/dense.yaml", "quality/logra.yaml", "quality/lora.yaml",
                 "quality/warm-start.yaml"} <= names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_recipe_passes_the_launchers_checks(tmp_path, recipe):
    tokens, _ = file_tokens(build_parser, recipe)
    argv = _without_load(tokens)
    if "--model-dir" in argv or _world_size(recipe) == 8:
        model = tmp_path / "model"
        model.mkdir()
        size = recipe.stem.split("-")[-1]
        config = paper_shape(size.upper()) if size.upper() in PAPER_SHAPES else \
            hf_config("smollm2-135m", max_position_embeddings=8192)
        (model / "config.json").write_text(json.dumps(config))
        argv += ["--model-dir", str(model)]
    cfg = parse_run_config(argv, world_size=_world_size(recipe))
    # what the recipes promise (their comments): the method they name
    if recipe.stem.startswith("logra") or recipe.stem in ("cpu", "rl"):
        assert cfg.optimizer.name == "logra" and cfg.rl.kl.control == "predicted"
    if recipe.stem.startswith("dense"):
        assert cfg.optimizer.name == "adam" and cfg.optimizer.peft == "none"
    if recipe.stem == "lora":
        assert cfg.optimizer.peft == "lora" and cfg.rl.weight_sync.transport == "full"
