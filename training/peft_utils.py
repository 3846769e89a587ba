"""PEFT glue: a target given as base model + adapter, and LoRA on a warm-started drafter.

    check_adapter_folder("path/to/adapter")                          # config and weights there, before any work
    adapter_fingerprint("path/to/adapter")                           # sha256 of its files, as records keep it
    target = merge_target_adapter(base_target, "path/to/adapter", "smollm2-135m")   # merged once, at load
    drafter = add_drafter_lora(drafter, rank=16, alpha=32, dropout=0.0, target_modules=[...])
    plain = merged_drafter(drafter)                                  # a copy with LoRA folded in

Merging the target's adapter at load keeps the frozen forward a plain transformers model (no
adapter branches on the hot path). The drafter's LoRA is merged only when it is saved, so the
exported folder is an ordinary DFlashDraftModel that `ddtree bench --drafter` loads.

Importing this module loads neither torch nor peft (they load where a model is built): the folder check and the
fingerprint answer before torch loads, in the recipe checks and in data/regenerate.py --check.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ddtree.errors import DDTreeError, error_line

if TYPE_CHECKING:
    from torch import nn
    from transformers import PreTrainedModel

# LoRA on every attention and MLP projection of the drafter's layers, unless model.lora_target_modules says otherwise.
DEFAULT_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The weights file `save_pretrained` of a PeftModel writes beside adapter_config.json (safetensors, or torch's format).
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# peft's adapter types that add virtual tokens or prefixes to the input rather than updates to weights, so there is
# nothing to fold into the target (their PeftModel has no merge_and_unload; peft 0.21). Any other type merges.
UNMERGEABLE_PEFT_TYPES = {"PROMPT_TUNING", "MULTITASK_PROMPT_TUNING", "P_TUNING", "PREFIX_TUNING", "ADAPTION_PROMPT",
                          "CPT", "CARTRIDGE"}
# What to give instead, in the errors that refuse one
MERGEABLE = "give a weight adapter (LoRA, LoHa, LoKr, IA3, ...) trained on the target, or the adapted model saved whole"


def adapter_folder(adapter: str) -> Path:
    """The folder a model.target_adapter (or --target-adapter) names: a recipe's `target_adapter: ~/x`, or
    `--model.target_adapter=~/x`, reaches no shell, and its ~ is the home folder, as model.target's and
    model.init_from's are."""
    return Path(adapter).expanduser()


def check_adapter_folder(adapter: str, field: str = "model.target_adapter") -> dict:
    """The adapter folder's adapter_config.json, once its weights file is known to be beside it; else a DDTreeError
    naming `field` (where the folder was given). Without the weights peft went on to ask the Hub for the folder's path
    as a repo id, and failed with a message about repo names."""
    config_path = adapter_folder(adapter) / "adapter_config.json"
    if not config_path.is_file():
        raise DDTreeError(f"{field}={adapter}: no adapter_config.json there; give a PEFT adapter folder "
                          "(the one `save_pretrained` of a PeftModel writes)")
    if not any((config_path.parent / name).is_file() for name in ADAPTER_WEIGHTS):
        raise DDTreeError(f"{field}={adapter}: adapter_config.json is there but not the adapter's weights "
                          f"({' or '.join(ADAPTER_WEIGHTS)}): copy the whole folder `save_pretrained` wrote")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as error:  # not JSON, or not UTF-8 text (UnicodeDecodeError)
        raise DDTreeError(f"{field}={adapter}: {config_path.name} is not valid JSON ({error_line(error)}); copy the "
                          "whole folder `save_pretrained` wrote again") from None
    if not isinstance(config, dict):
        raise DDTreeError(f"{field}={adapter}: {config_path.name} holds a JSON {type(config).__name__}, not a PEFT "
                          "adapter's settings; copy the whole folder `save_pretrained` wrote again")
    if not isinstance(config.get("peft_type"), str):  # else peft's TypeError traceback, at the merge
        raise DDTreeError(f"{field}={adapter}: {config_path.name} names no peft_type, so it is no PEFT adapter's "
                          "settings; copy the whole folder `save_pretrained` of a PeftModel wrote")
    if config.get("peft_type") in UNMERGEABLE_PEFT_TYPES:  # else an AttributeError traceback once the data was written
        raise DDTreeError(f"{field}={adapter}: a {config['peft_type']} adapter, which cannot be merged into the "
                          f"target's weights (it adds virtual tokens, not weight updates); {MERGEABLE}")
    return config


def adapter_fingerprint(adapter: str | None) -> str | None:
    """sha256 of a local PEFT adapter folder's adapter_* files (config and weights): what was trained against, the
    feature store built from, or the data generated with, once the adapter was retrained at the same path, is another
    target's. None without an adapter, or for one named by a Hub id (its files are not here)."""
    if not adapter or not adapter_folder(adapter).is_dir():
        return None
    digest = hashlib.sha256()
    for path in sorted(adapter_folder(adapter).iterdir()):
        if path.is_file() and path.name.startswith("adapter_"):
            digest.update(path.name.encode() + b"\0")
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 24), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def merge_target_adapter(target: PreTrainedModel, adapter: str, target_name: str,
                         field: str = "model.target_adapter") -> PreTrainedModel:
    """Load a PEFT adapter onto the frozen target (named `target_name` where it was given) and fold it into the
    weights. An adapter made for another model (other shapes, modules the target lacks, another depth) is a DDTreeError
    naming both: peft raised a RuntimeError of a dozen size-mismatch lines, or its own error class."""
    import peft
    from peft import PeftConfig, PeftModel, PeftType

    settings = check_adapter_folder(adapter, field)
    if settings["peft_type"] not in {kind.value for kind in PeftType}:  # peft's KeyError said the type's name alone
        raise DDTreeError(f"{field}={adapter}: peft_type {settings['peft_type']} is none that peft {peft.__version__} "
                          "knows (an adapter saved by a newer peft?): upgrade peft (pip install -U peft)")
    folder = str(adapter_folder(adapter))  # peft takes a path it cannot find for a Hub id
    made_for = settings.get("base_model_name_or_path")
    try:
        # PeftModel.from_pretrained, keeping the load result it drops: it loads with strict=False, so the weights of
        # layers the target lacks (an adapter made for a deeper model of its width) went without a word, and layers
        # the adapter has no weights for (a shallower one's) stayed unadapted after a warning
        config = PeftConfig.from_pretrained(folder)
        config.inference_mode = True
        adapted = PeftModel(target, config)
        merge = adapted.merge_and_unload  # before the weights load: a prompt tuner's load result names them unused
        loaded = adapted.load_adapter(folder, "default")
    except AttributeError:  # no merge_and_unload: a type UNMERGEABLE_PEFT_TYPES does not list yet
        raise DDTreeError(f"{field}={adapter}: a {settings.get('peft_type')} adapter, which cannot be merged into the "
                          f"target's weights; {MERGEABLE}") from None
    except (RuntimeError, ValueError, KeyError) as error:  # peft's own (NoMatchingPeftModuleError) are ValueErrors
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
        # "Error(s) in loading state_dict for PeftModel:" says nothing alone: with the first size mismatch under it
        cause = (f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]).rstrip(".")
    else:
        # named as in the adapter's file, without the name peft gives the loaded adapter
        unused, lacking = ([key.replace(".default.", ".") for key in keys]
                           for keys in (loaded.unexpected_keys, loaded.missing_keys))
        cause = (f"{len(unused)} of its tensors match no module of the target (the first: {unused[0]})" if unused
                 else f"it has no weights for {len(lacking)} adapter tensors the target takes (the first: {lacking[0]})"
                 if lacking else None)
    if cause:
        raise DDTreeError(f"{field}={adapter} does not fit target {target_name}"
                          f"{f' (it was made for {made_for})' if made_for else ''}: {cause}; give an adapter trained "
                          f"on {target_name}, or the target it was made for") from None
    return merge().eval().requires_grad_(False)


def add_drafter_lora(
    drafter: PreTrainedModel, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> nn.Module:
    """Wrap the drafter so only LoRA adapters on `target_modules` of its layers train (each a Linear module's name, or
    the end of its dotted path, as peft matches them; another is a DDTreeError listing the drafter's)."""
    from peft import LoraConfig, get_peft_model
    from torch import nn

    # checked here, not by peft: a typo was its NoMatchingPeftModuleError traceback, a norm its "is not supported"
    linear = [name for name, module in drafter.named_modules() if isinstance(module, nn.Linear)]
    for wanted in target_modules:
        if not any(name == wanted or name.endswith(f".{wanted}") for name in linear):
            names = ", ".join(sorted({name.rsplit(".", 1)[-1] for name in linear}))
            raise DDTreeError(f"model.lora_target_modules={list(target_modules)}: {wanted} is no Linear module of the "
                              f"drafter; give names among {names}, or leave it unset")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    return get_peft_model(drafter, config)


def merged_drafter(drafter: nn.Module) -> PreTrainedModel:
    """A plain DFlashDraftModel: a copy with LoRA merged (the live drafter keeps training), else the drafter itself."""
    if hasattr(drafter, "merge_and_unload"):
        return copy.deepcopy(drafter).merge_and_unload()
    return drafter
