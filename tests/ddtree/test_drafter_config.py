"""Drafter configs in the layouts other tools write them (ddtree/configuration_dflash.py, ddtree/drafters.py).

    .venv/bin/pytest -q tests/ddtree/test_drafter_config.py
"""

from __future__ import annotations

import json

import torch

from ddtree.configuration_dflash import LEGACY_MODEL_TYPE, DFlashDrafterConfig
from ddtree.drafters import load_drafter_folder
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config


def test_a_folder_with_a_block_size_and_no_dflash_config_is_a_drafters_and_loads(tmp_path, tiny_target):
    """A config.json is a drafter's when it holds dflash_config or block_size: one in vLLM's speculators layout (the
    MASK id at the top level, no dflash_config) reads the default layers of its target's depth, not a refusal."""
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    # the tiny target has 6 layers: a 2-layer drafter's default spread from layer 1 to layer 6 - 3 is [1, 3]
    config = build_drafter_config(target, tokenizer, "tiny-random", num_layers=2, block_size=4, target_layer_ids=[1, 3])
    DFlashDraftModel(config).save_pretrained(folder)
    fields = json.loads((folder / "config.json").read_text())
    fields["mask_token_id"] = fields.pop("dflash_config")["mask_token_id"]
    (folder / "config.json").write_text(json.dumps(fields))

    drafter = load_drafter_folder(folder, torch.float32, target)
    assert (drafter.block_size, drafter.mask_token_id, drafter.target_layer_ids) == (4, 16, [1, 3])


def test_a_config_given_the_old_model_type_is_of_qwen3s():
    """Fields of a drafter saved before its model_type became Qwen3's (read as a dict, not through from_pretrained,
    which rewrites it): the old name must not shadow the class's, which engines and AutoConfig read."""
    config = DFlashDrafterConfig.from_dict({"model_type": LEGACY_MODEL_TYPE, "block_size": 4})
    assert config.model_type == "qwen3" and config.to_dict()["model_type"] == "qwen3"


def test_a_config_saved_alone_names_the_drafters_architecture_unless_given_another(tmp_path):
    """save_pretrained of a model writes its class name; a config saved without one (the folder's config.json first)
    still names DFlashDraftModel, the class the reference dflash package and the engines look for."""
    DFlashDrafterConfig(block_size=4).save_pretrained(tmp_path / "default")
    DFlashDrafterConfig(block_size=4, architectures=["Other"]).save_pretrained(tmp_path / "given")
    saved = {name: json.loads((tmp_path / name / "config.json").read_text()) for name in ("default", "given")}
    assert saved["default"]["architectures"] == ["DFlashDraftModel"] and saved["given"]["architectures"] == ["Other"]


def test_a_config_cleared_of_what_training_learned_saves_none_of_it(tmp_path):
    """Calibration, draft temperatures and draft vocabulary set to None leave dflash_config, as a drafter that never had
    them: its config.json holds no null for another reader to take for a setting."""
    config = DFlashDrafterConfig(block_size=4, dflash_config={"mask_token_id": 0})
    config.calibration, config.draft_temperatures, config.draft_vocab = {"temperatures": {"8": 1.5}}, [1.2] * 3, [2, 1]
    config.calibration = config.draft_temperatures = config.draft_vocab = None
    config.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"] == {"mask_token_id": 0}
