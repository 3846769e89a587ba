"""PEFT glue: a target given as base model + adapter, and LoRA on a warm-started drafter.

    target = merge_target_adapter(base_target, "path/to/adapter")   # merged once, at load
    drafter = add_drafter_lora(drafter, rank=16, alpha=32, dropout=0.0, target_modules=[...])
    plain = merged_drafter(drafter)                                  # a copy with LoRA folded in

Merging the target's adapter at load keeps the frozen forward a plain transformers model (no
adapter branches on the hot path). The drafter's LoRA is merged only when it is saved, so the
exported folder is an ordinary DFlashDraftModel that `ddtree bench --drafter` loads.
"""

from __future__ import annotations

import copy
from pathlib import Path

from torch import nn
from transformers import PreTrainedModel

from ddtree.targets import DDTreeError

# LoRA on every attention and MLP projection of the drafter's layers, unless model.lora_target_modules says otherwise.
DEFAULT_LORA_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def merge_target_adapter(target: PreTrainedModel, adapter: str) -> PreTrainedModel:
    """Load a PEFT adapter onto the frozen target and fold it into the weights."""
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").exists():
        raise DDTreeError(
            f"model.target_adapter={adapter}: no adapter_config.json there; give a PEFT adapter folder "
            "(the one `save_pretrained` of a PeftModel writes)"
        )
    merged = PeftModel.from_pretrained(target, adapter).merge_and_unload()
    return merged.eval().requires_grad_(False)


def add_drafter_lora(
    drafter: PreTrainedModel, rank: int, alpha: float, dropout: float, target_modules: list[str]
) -> nn.Module:
    """Wrap the drafter so only LoRA adapters on `target_modules` of its layers train."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules))
    return get_peft_model(drafter, config)


def merged_drafter(drafter: nn.Module) -> PreTrainedModel:
    """A plain DFlashDraftModel: a copy with LoRA merged (the live drafter keeps training), else the drafter itself."""
    if hasattr(drafter, "merge_and_unload"):
        return copy.deepcopy(drafter).merge_and_unload()
    return drafter
