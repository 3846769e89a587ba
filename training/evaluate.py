"""Measure a saved checkpoint's DDTree acceptance exactly as training measured it.

    make eval RECIPE=smollm2-135m CKPT=best     # best.ckpt of the newest run of the recipe (the default)
    make eval RECIPE=tiny CKPT=last
    python -m training.evaluate --recipe tiny --ckpt outputs/tiny/<run>/checkpoints/step-step=20.ckpt

Same code, same settings as the training-time evaluation (training/callbacks.py): the eval section
(prompts, budgets, max_new_tokens, limit) and the target's dtype (model.target_dtype, or the one
trainer.precision gives) come from the run's config.yaml, or from recipes/<recipe>.yaml for a
checkpoint outside a run folder; the target comes from the checkpoint's hyper-parameters. The
drafter is the checkpoint's (LoRA adapters merged in, as exported). When the checkpoint holds the
value logged at its step, it is printed beside the new measurement.

Prints one row per method and writes <run>/eval/checkpoint-<name>.json (or --out). Bad input
prints one line and exits with status 1 (2 for an unknown recipe).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from ddtree.targets import DDTreeError, load_target, stop_token_ids

from .callbacks import AcceptanceEvaluation, metrics_of, write_json_atomic
from .export import drafter_from_checkpoint
from .module import _dtype_for_precision
from .peft_utils import merge_target_adapter
from .publish import consolidate_deepspeed, is_deepspeed_checkpoint
from .train import RECIPES_DIR, known_recipes


def find_checkpoint(spec: str, recipe_root: Path) -> Path:
    """A .ckpt path, or 'best'/'last' of the newest run (by its last.ckpt) under recipe_root."""
    if spec in ("best", "last"):
        runs = [d for d in recipe_root.glob("*/checkpoints") if (d / f"{spec}.ckpt").exists()]
        if not runs:
            raise DDTreeError(f"CKPT={spec}: no run under {recipe_root} has checkpoints/{spec}.ckpt; train one first")
        newest = max(runs, key=lambda d: (d / "last.ckpt").stat().st_mtime if (d / "last.ckpt").exists() else 0.0)
        return newest / f"{spec}.ckpt"
    path = Path(spec)
    if not (path.is_file() or is_deepspeed_checkpoint(path)):
        raise DDTreeError(f"CKPT={spec}: no such checkpoint file; give a .ckpt path (or DeepSpeed folder), 'best' or 'last'")
    return path


def read_config(checkpoint: Path, recipe: str) -> tuple[dict, Path]:
    """The run's resolved config.yaml beside the checkpoint folder, else the recipe."""
    run_config = checkpoint.resolve().parent.parent / "config.yaml"
    source = run_config if run_config.is_file() else RECIPES_DIR / f"{recipe}.yaml"
    try:
        return yaml.safe_load(source.read_text()) or {}, source
    except yaml.YAMLError as error:
        raise DDTreeError(f"{source}: not valid YAML ({str(error).splitlines()[0]})") from None


def logged_metrics(checkpoint: dict, step: int) -> dict | None:
    """What the training-time evaluation logged at the checkpoint's step, if the checkpoint carries it."""
    for key, state in checkpoint.get("callbacks", {}).items():
        if "AcceptanceEvaluation" in str(key):
            for record in state.get("history", []):
                if record["step"] == step:
                    return metrics_of(record["summary"], record["seconds"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="smollm2-135m", help="one of recipes/*.yaml")
    parser.add_argument("--ckpt", default="best", help="'best', 'last' (newest run of the recipe) or a .ckpt path")
    parser.add_argument("--output-root", default="outputs", help="where the recipe's runs are: <output-root>/<recipe>/")
    parser.add_argument("--limit", type=int, default=None, help="override eval.limit (the result then differs from training's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", default=None, help="results JSON (default: <run>/eval/checkpoint-<name>.json)")
    args = parser.parse_args(argv)
    if args.recipe not in known_recipes():
        print(f"error: unknown recipe {args.recipe!r}; known recipes: {', '.join(known_recipes())}", file=sys.stderr)
        return 2
    stack = contextlib.ExitStack()
    try:
        path = find_checkpoint(args.ckpt, Path(args.output_root) / args.recipe)
        config, source = read_config(path, args.recipe)
        settings = dict(config.get("eval") or {})
        if args.limit is not None:
            settings["limit"] = args.limit
        try:
            evaluation = AcceptanceEvaluation(**settings)
        except TypeError as error:
            raise DDTreeError(f"{source}: bad eval section ({error})") from None

        if is_deepspeed_checkpoint(path):  # a ZeRO folder of per-rank shards: one fp32 file first
            path_to_load = consolidate_deepspeed(path, Path(stack.enter_context(tempfile.TemporaryDirectory())))
        else:
            path_to_load = path
        checkpoint = torch.load(path_to_load, map_location="cpu", weights_only=False)
        hp = checkpoint.get("hyper_parameters", {})
        if "target" not in hp:
            raise DDTreeError(f"checkpoint {path} names no target: it was not written by training.module.DistillModule")
        target_dtype = hp.get("target_dtype", "auto")
        if target_dtype == "auto":  # what DistillModule.configure_model picks under that trainer precision
            dtype = _dtype_for_precision((config.get("trainer") or {}).get("precision"))
        else:
            dtype = getattr(torch, target_dtype)
        target, tokenizer = load_target(hp["target"], dtype=dtype, device=args.device)
        if hp.get("target_adapter"):
            target = merge_target_adapter(target, hp["target_adapter"])
        drafter = drafter_from_checkpoint(path_to_load).to(args.device)

        prompts = evaluation.load_prompts(tokenizer)
        result = evaluation.measure(target, drafter, prompts, stop_token_ids(target, tokenizer))
    except DDTreeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        stack.close()

    step = int(checkpoint.get("global_step", -1))
    logged = logged_metrics(checkpoint, step) if args.limit is None else None
    print(
        f"[eval] {path} (step {step}, settings from {source}): {len(prompts)} prompts of {evaluation.prompts_path}, "
        f"up to {evaluation.max_new_tokens} new tokens, T=0, target {hp['target']} in {str(dtype).split('.')[-1]}"
    )
    print(f"{'method':<12} {'tau':>7} {'logged':>7} {'expected':>8} {'rounds':>7}  accepted depth: rounds")
    for key, stats in result["summary"].items():
        was = logged.get(f"val/tau_{key}") if logged else None
        expected = f"{stats['expected_tau']:.3f}" if key.startswith("ddtree") else "-"
        depths = " ".join(f"{d}:{n}" for d, n in stats["accepted_depth_counts"].items())
        print(
            f"{key:<12} {stats['tau']:>7.3f} {'-' if was is None else f'{was:.3f}':>7} {expected:>8} "
            f"{stats['rounds']:>7}  {depths}"
        )
    out = Path(args.out) if args.out else path.resolve().parent.parent / "eval" / f"checkpoint-{path.resolve().stem}.json"
    used = {
        "prompts": evaluation.prompts_path, "num_prompts": len(prompts), "budgets": evaluation.budgets,
        "max_new_tokens": evaluation.max_new_tokens, "limit": evaluation.limit, "target": hp["target"], "dtype": str(dtype),
    }
    write_json_atomic(out, {"checkpoint": str(path), "step": step, "settings": used, "logged": logged, **result})
    print(f"results written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
