"""Drafter folders (config.json + safetensors, the published DFlash format): read and checked before loading.

    drafter = load_drafter_folder(Path("exports/my-drafter"), torch.bfloat16, target=target)

Used by the `ddtree` CLI (--drafter) and by training's warm start (model.init_from), so a folder
whose config.json was edited, whose weights are missing or cut off, or that was built for another
target stops with one line naming what is wrong instead of a traceback (or, worse, a model whose
missing weights transformers quietly started from random values).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import PreTrainedModel
from transformers.activations import ACT2FN

from .configuration_dflash import DFlashDrafterConfig
from .errors import DDTreeError, error_line, first_and_count
from .inputs import check_drafter_path
from .modeling_dflash import DFlashDraftModel
from .targets import check_drafter_fits, is_number


def weight_shapes(folder: Path) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, file name)} of every tensor in a drafter folder's safetensors, read from the file headers only.

    The weights are model.safetensors, or the shards model.safetensors.index.json names. A file
    cut off mid-copy fails here: a safetensors header lists every tensor's byte range and the
    file must cover them exactly.
    """
    index = folder / "model.safetensors.index.json"
    if (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    elif index.is_file():
        try:
            files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise DDTreeError(f"drafter {index} could not be read ({error_line(error)}); export the drafter again") from None
    else:
        raise DDTreeError(f"drafter {folder} has a config.json but no model.safetensors; "
                          "copy the weights in beside it, or export the drafter again")
    shapes = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as weights:
                shapes.update({name: (list(weights.get_slice(name).get_shape()), file.name) for name in weights.keys()})
        except (OSError, SafetensorError) as error:
            raise DDTreeError(f"drafter weights {file} are unreadable, truncated or not safetensors "
                              f"({error_line(error)}); copy or export the drafter again") from None
    return shapes


def check_weights_match_config(folder: Path, config: DFlashDrafterConfig) -> None:
    """The folder's weights are exactly the tensors its config.json builds, name for name and shape for shape.

    transformers would otherwise stop with a size-mismatch traceback, or quietly start a weight
    that is missing (or a layer config.json no longer has) from random values.
    """
    mismatch = "config.json does not match the weights (was it edited?): restore it, or export the drafter again"
    if config.hidden_act not in ACT2FN:  # transformers' KeyError, from deep in the build below
        raise DDTreeError(f"drafter {folder}: config.json's hidden_act {config.hidden_act!r} is not an activation "
                          "transformers knows (silu, gelu, relu, ...): restore it, or export the drafter again")
    try:
        with torch.device("meta"):  # shapes only: no memory, no initialization
            expected = {name: list(t.shape) for name, t in DFlashDraftModel(config).state_dict().items()}
    # a size or setting it cannot build (head_dim 0: a ZeroDivisionError in the attention's scale)
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError, ArithmeticError) as error:
        raise DDTreeError(f"drafter {folder}: config.json does not build a drafter ({type(error).__name__}: "
                          f"{error_line(error)}); restore it, or export the drafter again") from None
    found = weight_shapes(folder)
    missing = [name for name in expected if name not in found]
    if missing:
        raise DDTreeError(f"drafter {folder}: config.json needs weight {first_and_count(missing)}, absent from its "
                          f"safetensors; {mismatch}")
    unused = [name for name in found if name not in expected]
    if unused:
        raise DDTreeError(f"drafter {folder}: {found[unused[0]][1]} holds weight {first_and_count(unused)}, "
                          f"which config.json has no place for; {mismatch}")
    for name, shape in expected.items():
        saved, file = found[name]
        if saved != shape:
            raise DDTreeError(f"drafter {folder}: config.json makes weight {name} {shape} but {file} holds {saved}; {mismatch}")


def read_drafter_config(folder: str | Path) -> DFlashDrafterConfig:
    """A drafter folder's config.json, or one line saying why it cannot be read."""
    folder = Path(folder).expanduser()  # a str as every other path-taking entry point (load_target) takes one
    check_drafter_path(folder)
    try:
        fields = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise DDTreeError(f"drafter {folder}/config.json could not be read: {error_line(error)}") from None
    if not isinstance(fields, dict):
        raise DDTreeError(f"drafter {folder}/config.json holds a JSON {type(fields).__name__}, not an object of fields")
    if "dflash_config" not in fields and "block_size" not in fields:  # a target model's folder, say
        raise DDTreeError(f"{folder} is not a DFlash drafter: its config.json (model_type {fields.get('model_type')!r}) "
                          "has no dflash_config or block_size; give a drafter folder (a run's drafter/ or an export)")
    if "block_size" not in fields:  # DFlashDrafterConfig's default (16) would draft positions it was never trained on
        raise DDTreeError(f"drafter {folder}/config.json has no block_size (the anchor plus the tokens one forward "
                          "drafts, as the drafter was trained; every export and the published DFlash drafters write "
                          "it): restore it, or export the drafter again")
    try:
        config = DFlashDrafterConfig.from_pretrained(folder)
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:  # (transformers' rope and dtype checks)
        raise DDTreeError(f"drafter {folder}/config.json could not be read: {error_line(error)}") from None
    except StrictDataclassError as error:  # a field fails transformers' validation; its first line only names the validator
        raise DDTreeError(f"drafter {folder}/config.json could not be read: {error_line(error.__cause__ or error)}") from None
    check_rope_keys_agree(folder, fields)
    # transformers takes any value here; a quoted or null base failed in the rotary embedding's build as a TypeError
    # naming no field, and a negative one rotated every position by a NaN angle
    rope = getattr(config, "rope_parameters", None)
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    if isinstance(rope, dict) and "rope_theta" in rope and not (is_number(theta) and theta > 0):
        raise DDTreeError(f"drafter {folder}/config.json: rope_parameters.rope_theta is {theta!r}, expected a positive "
                          "number (the RoPE base the drafter was trained with); write it as a JSON number, without "
                          "quotes, in rope_parameters and rope_theta alike: restore it, or export the drafter again")
    return config


def legacy_rope_keys(config: dict) -> dict:
    """rope_theta / rope_scaling as transformers 4 reads them, from a config's rope_parameters (transformers 5 writes
    only rope_parameters); {} where rope_parameters names no theta. training/hub_config.py writes them in an export."""
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        return {}
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


def check_rope_keys_agree(folder: Path, fields: dict) -> None:
    """A config.json holding RoPE twice (an export: rope_parameters, and rope_theta / rope_scaling for transformers 4)
    says one thing in both. transformers 4 reads only the old keys and transformers 5 reads them first where
    rope_scaling is set, so an edit to one set alone made a drafter rotate positions by the other, silently."""
    expected = legacy_rope_keys(fields)
    found = {key: fields[key] for key in ("rope_theta", "rope_scaling") if key in fields}
    scaling = found.get("rope_scaling")
    if isinstance(scaling, dict):  # as transformers 4 wrote it: "type" before "rope_type"; default is no scaling
        scaling = {("rope_type" if key == "type" else key): value for key, value in scaling.items()}
        found["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
    if expected and any(value != expected[key] for key, value in found.items()):
        raise DDTreeError(
            f"drafter {folder}/config.json: rope_parameters {fields['rope_parameters']} disagree with rope_theta "
            f"{fields.get('rope_theta')} and rope_scaling {fields.get('rope_scaling')} (what transformers 4 reads, and "
            "transformers 5 first where rope_scaling is set): make the two agree, or remove rope_theta and rope_scaling")


def load_drafter_folder(folder: str | Path, dtype: torch.dtype, target: PreTrainedModel | None = None,
                        retarget: bool = False) -> DFlashDraftModel:
    """The drafter of a folder, its config and weights checked first (and against `target` when given: built for a
    target of its depth too, unless `retarget`, as training's warm start, which trains it against `target` from here)."""
    folder = Path(folder).expanduser()  # a str failed with TypeError str / str
    config = read_drafter_config(folder)
    if target is not None:
        check_drafter_fits(config, target, str(folder), same_depth=not retarget)
    check_weights_match_config(folder, config)
    return DFlashDraftModel.from_pretrained(folder, config=config, dtype=dtype)
