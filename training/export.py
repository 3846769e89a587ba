"""Export a trained drafter as a Hugging Face folder that `ddtree bench --drafter <folder>` loads.

    python -m training.export outputs/smollm2-135m/<run>/checkpoints/last.ckpt outputs/my-drafter
    export_drafter(module_or_checkpoint_path, out_dir)

A checkpoint holds the drafter only (never the target) plus its config, so exporting needs no
target. LoRA adapters and the fc feature scale (training/feature_scale.py), if the run used them, are folded into the weights first. The folder is
written beside its destination and renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import DDTreeError

from .feature_scale import add_feature_scale
from .peft_utils import add_drafter_lora, merged_drafter


def drafter_from_checkpoint(checkpoint_path: str | Path) -> DFlashDraftModel:
    """Rebuild the (LoRA-merged) drafter from a Lightning checkpoint of DistillModule."""
    path = Path(checkpoint_path)
    if not path.is_file():
        raise DDTreeError(f"checkpoint {path} does not exist; give a .ckpt file from outputs/<recipe>/<run>/checkpoints")
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    if "drafter_config" not in checkpoint:
        raise DDTreeError(f"checkpoint {path} has no drafter_config: it was not written by training.module.DistillModule")
    return drafter_from_state(checkpoint)


def drafter_from_state(checkpoint: dict) -> DFlashDraftModel:
    """The (LoRA-merged) drafter of a loaded checkpoint dict: drafter_config, hyper_parameters, state_dict."""
    drafter = DFlashDraftModel(DFlashDrafterConfig.from_dict(checkpoint["drafter_config"]))
    hp = checkpoint.get("hyper_parameters", {})
    if hp.get("lora_rank", 0) > 0:
        from .module import DEFAULT_LORA_MODULES

        drafter = add_drafter_lora(
            drafter, hp["lora_rank"], hp["lora_alpha"], hp["lora_dropout"], hp.get("lora_target_modules") or DEFAULT_LORA_MODULES
        )
    prefix = "drafter."
    state = {key[len(prefix) :]: value for key, value in checkpoint["state_dict"].items() if key.startswith(prefix)}
    if "fc.parametrizations.weight.original" in state:  # trained with precondition_features: folded below
        add_feature_scale(drafter)
    drafter.load_state_dict(state, strict=True)
    return merged_drafter(drafter)


def export_drafter(source, out_dir: str | Path) -> Path:
    """Write `source` (a DistillModule, a drafter nn.Module or a checkpoint path) to out_dir; return out_dir."""
    if isinstance(source, (str, Path)):
        drafter = drafter_from_checkpoint(source)
    else:
        drafter = merged_drafter(getattr(source, "drafter", source))
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        drafter.save_pretrained(staging)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a .ckpt file written by training/train.py")
    parser.add_argument("out_dir", help="folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    try:
        out = export_drafter(args.checkpoint, args.out_dir)
    except DDTreeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"drafter written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
