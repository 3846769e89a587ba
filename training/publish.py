"""Export a trained drafter as a Hugging Face Hub folder, ready for the serving engines, and push it.

    make export RUN=outputs/smollm2-135m/<run> OUT=exports/smollm2-drafter [CKPT=best|last|path]
                [SPECULATORS=1] [OVERWRITE=1] [REPO=user/name PUSH=1]
    python -m training.publish outputs/smollm2-135m/<run> --out exports/smollm2-drafter --ckpt best \
        [--speculators] [--overwrite] [--repo user/name --push [--private]]
    python -m training.publish --push-only exports/smollm2-drafter --repo user/name   # push a finished export

The output folder (one flat folder, as the Hub serves it):
    model.safetensors        the drafter's weights only (never the target's); LoRA merged in
    config.json              the published DFlash fields (architectures, block_size, num_target_layers,
                             dflash_config.{mask_token_id,target_layer_ids}), the target it was trained
                             for, auto_map -> the two files below; with --speculators also vLLM's
                             speculators fields (speculators_config with the verifier and the number of
                             speculative tokens)
    configuration_dflash.py  ddtree's model files, copied as remote code:
    modeling_dflash.py       AutoModel.from_pretrained(folder, trust_remote_code=True) loads the drafter
    README.md                model card: Hub metadata, the acceptance measured for this checkpoint during
                             training (read from <run>/eval/), the recipe and data, usage

Checkpoints: `best` is checkpoints/best.ckpt (the step with the highest measured tau), `last` is
checkpoints/last.ckpt, anything else a path (a .ckpt file or a DeepSpeed checkpoint folder, which is
consolidated to fp32 first). Bad input (a non-empty OUT without --overwrite, a checkpoint that is not
a drafter of this project, an invalid repo name, no token or no network for --push) stops with one
line before anything is written. The folder is built beside OUT and renamed into place after it has
been loaded back and checked, so a failure leaves nothing half-written; a failed push leaves the
exported folder intact for --push-only.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import AutoModel
from transformers.utils import HF_MODULES_CACHE

from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import DDTreeError, resolve_target, staged_folder

from .export import drafter_from_checkpoint, export_drafter
from .model_card import CardFacts, evaluated_steps, read_evaluation, read_run_config, render_model_card

# The Hub ids of the built-in targets (their local names mean nothing on the Hub).
BUILTIN_HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}

REMOTE_CODE = ("configuration_dflash.py", "modeling_dflash.py")  # flat, with a relative import between them
LIBRARY_DIR = Path(inspect.getfile(DFlashDraftModel)).parent  # where ddtree's model files live
AUTO_MAP = {
    "AutoConfig": "configuration_dflash.DFlashDrafterConfig",
    "AutoModel": "modeling_dflash.DFlashDraftModel",
}
EXPORT_FILES = ("config.json", "model.safetensors", "README.md", *REMOTE_CODE)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# config.json keys that are DFlash's, not the Qwen3 layer config vLLM builds the draft layers from.
NON_LAYER_KEYS = {"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers",
                  "target_name_or_path", "transformers_version"}


# ----------------------------------------------------------------------------- checking the request


def check_repo_id(repo: str) -> None:
    """A Hub model id of the form user/name (or org/name)."""
    try:
        validate_repo_id(repo)
    except HFValidationError as error:
        raise DDTreeError(f"REPO={repo!r} is not a valid Hub repo id ({str(error).splitlines()[0]})") from None
    if repo.count("/") != 1:
        raise DDTreeError(f"REPO={repo!r} must be user/name or org/name, so the drafter lands in your namespace")


def check_output_folder(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DDTreeError(f"OUT={out} is a file; give a folder to write the export into")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DDTreeError(f"OUT={out} exists and is not empty; pick another folder or pass --overwrite (OVERWRITE=1)")


def hub_endpoint() -> str:
    # Read at call time (huggingface_hub reads HF_ENDPOINT once, at import).
    return os.environ.get("HF_ENDPOINT", constants.ENDPOINT).rstrip("/")


def preflight_hub(repo: str) -> tuple[HfApi, str]:
    """Token and network checked before any work, so a push that cannot happen costs nothing."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        raise DDTreeError("--push: HF_HUB_OFFLINE is set; unset it to push to the Hub")
    token = os.environ.get("HF_TOKEN") or get_token()
    if not token:
        raise DDTreeError(
            "--push: no Hugging Face token; set HF_TOKEN to a write token (https://huggingface.co/settings/tokens)"
        )
    endpoint = hub_endpoint()
    api = HfApi(endpoint=endpoint, token=token)
    try:
        user = api.whoami()
    except Exception as error:  # noqa: BLE001 - network and HTTP errors alike end here, as one line
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DDTreeError(
            f"--push: cannot use the Hub at {endpoint} ({reason}); check the network and HF_TOKEN"
        ) from None
    role = ((user.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise DDTreeError(f"--push: HF_TOKEN is a read-only token of {user.get('name')}; use a write token for {repo}")
    return api, endpoint


# ----------------------------------------------------------------------------- the checkpoint


@dataclass
class Source:
    """The checkpoint being exported and what it says about itself."""

    path: Path  # a .ckpt file or a DeepSpeed checkpoint folder
    label: str  # how the user chose it, for the card ("best -> step-step=200.ckpt")
    step: int
    hyper_parameters: dict


def resolve_checkpoint(run_dir: Path, ckpt: str) -> tuple[Path, str]:
    """best | last | a path (absolute, relative to here, or to <run>/checkpoints) -> (path, label)."""
    checkpoints = run_dir / "checkpoints"
    if ckpt in ("best", "last"):
        named = checkpoints / f"{ckpt}.ckpt"
        if not named.exists():
            hint = "CKPT=last or a path" if ckpt == "best" else "a path to a checkpoint"
            why = " (runs trained before the acceptance evaluation have no best.ckpt)" if ckpt == "best" else ""
            raise DDTreeError(f"CKPT={ckpt}: {named} does not exist{why}; use {hint}")
        resolved = named.resolve()  # best.ckpt is a symlink to the chosen step-N checkpoint
        return resolved, ckpt if resolved.name == named.name else f"{ckpt} -> {resolved.name}"
    for candidate in (Path(ckpt), checkpoints / ckpt):
        if candidate.exists():
            return candidate.resolve(), candidate.name
    raise DDTreeError(f"CKPT={ckpt}: no such checkpoint (looked in . and {checkpoints}); give best, last or a path")


def is_deepspeed_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def consolidate_deepspeed(path: Path, workdir: Path) -> Path:
    """A DeepSpeed (ZeRO) checkpoint folder -> one fp32 Lightning checkpoint file in `workdir`."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    single = workdir / "consolidated.ckpt"
    try:
        convert_zero_checkpoint_to_fp32_state_dict(path, single)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError) as error:
        raise DDTreeError(f"CKPT {path}: could not consolidate the DeepSpeed checkpoint ({error})") from None
    return single


def load_source(path: Path, label: str, workdir: Path) -> tuple[DFlashDraftModel, Source]:
    """The (LoRA-merged) drafter of a checkpoint and its step, or a DDTreeError naming what is wrong."""
    if path.is_dir():
        if (path / "config.json").is_file():
            raise DDTreeError(
                f"CKPT {path} is an exported drafter folder, not a training checkpoint; give a .ckpt from the run"
            )
        if not is_deepspeed_checkpoint(path):
            raise DDTreeError(f"CKPT {path} is a folder but not a DeepSpeed checkpoint (no 'latest' file in it)")
        file = consolidate_deepspeed(path, workdir)
    else:
        file = path
    try:
        # mmap: only the few fields read here are paged in; drafter_from_checkpoint reads the weights.
        checkpoint = torch.load(file, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # noqa: BLE001 - anything torch.load cannot read is not a checkpoint
        raise DDTreeError(
            f"CKPT {path} is not a PyTorch checkpoint ({type(error).__name__}); give a .ckpt from the run"
        ) from None
    if not isinstance(checkpoint, dict) or "drafter_config" not in checkpoint or "global_step" not in checkpoint:
        raise DDTreeError(
            f"CKPT {path} is not a drafter checkpoint of this project (no drafter_config/global_step): "
            "give a checkpoint written by training/train.py"
        )
    try:
        drafter = drafter_from_checkpoint(file)
    except RuntimeError as error:  # load_state_dict(strict=True): weights do not fit the stored config
        reason = str(error).splitlines()[0]
        raise DDTreeError(f"CKPT {path}: its weights do not match its drafter_config ({reason})") from None
    source = Source(path, label, int(checkpoint["global_step"]), dict(checkpoint.get("hyper_parameters", {})))
    return drafter, source


# ----------------------------------------------------------------------------- config.json


def rope_keys_for_transformers_v4(config: dict) -> dict:
    """rope_theta / rope_scaling as transformers 4 reads them (v5 writes only rope_parameters).

    Serving engines pinned to transformers 4 would otherwise build the drafter's RoPE with their
    default theta, silently (the drafter's positions must rotate exactly as the target's).
    """
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        return {}
    scaling = {key: value for key, value in rope.items() if key != "rope_theta"}
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return {"rope_theta": rope["rope_theta"], "rope_scaling": scaling}


def verifier_for(target: str, base_model: str | None) -> tuple[str, list[str]]:
    """(name_or_path, architectures) of the target, as vLLM's speculators format names the verifier.

    The Hub id when there is one (what another machine can load), else the target's local folder.
    """
    local = Path(resolve_target(target))  # a built-in's converted folder, a folder, or (a Hub id) nothing local
    name = base_model or BUILTIN_HUB_IDS.get(target) or str(local)
    config = local / "config.json"
    architectures = list(json.loads(config.read_text()).get("architectures") or []) if config.is_file() else []
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


def hub_config(saved: dict, verifier: tuple[str, list[str]] | None = None) -> dict:
    """config.json for the Hub from the one save_pretrained wrote; with a verifier, the speculators variant."""
    config = dict(saved)
    config["auto_map"] = dict(AUTO_MAP)
    config.update(rope_keys_for_transformers_v4(config))
    if verifier is not None:
        config.update(speculators_fields(config, *verifier))
        # vLLM takes the speculators path only when config.json names no model_type; transformers then
        # finds the config class through auto_map.
        config.pop("model_type", None)
    return config


# ----------------------------------------------------------------------------- the export


def check_loads_back(folder: Path, drafter: DFlashDraftModel) -> None:
    """AutoModel with the shipped remote code, offline, must give back exactly the exported weights."""
    try:
        loaded = AutoModel.from_pretrained(folder, trust_remote_code=True, local_files_only=True, dtype=drafter.dtype)
    except Exception as error:  # noqa: BLE001 - any failure means the folder is not usable as shipped
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DDTreeError(f"the export does not load with AutoModel(trust_remote_code=True): {reason}") from None
    finally:
        # transformers copied the remote code into its modules cache, under the (random) staging folder's
        # name, sanitised as in transformers.dynamic_module_utils: no later load can reuse that copy.
        copy = folder.name.replace(".", "_dot_").replace("-", "_hyphen_")
        shutil.rmtree(Path(HF_MODULES_CACHE) / "transformers_modules" / copy, ignore_errors=True)
    expected, found = drafter.state_dict(), loaded.state_dict()
    if expected.keys() != found.keys() or any(not torch.equal(expected[k], found[k]) for k in expected):
        raise DDTreeError("the export loads with AutoModel but its weights differ from the checkpoint's")


def export_folder(
    run_dir: Path, ckpt: str, out: Path, *, speculators: bool = False, base_model: str | None = None,
    license_id: str = "apache-2.0", dtype: str = "float32", repo: str | None = None,
) -> Path:
    """Write the Hub folder for one checkpoint of a run to `out` (replacing it); return `out`."""
    path, label = resolve_checkpoint(run_dir, ckpt)
    run_config = read_run_config(run_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}-consolidate-", dir=out.parent) as workdir:
        drafter, source = load_source(path, label, Path(workdir))
    drafter = drafter.to(DTYPES[dtype]).eval()
    target = drafter.config.target_name_or_path or source.hyper_parameters.get("target")
    base_model = base_model or BUILTIN_HUB_IDS.get(target) or (target if _looks_like_hub_id(target) else None)
    evaluation = read_evaluation(run_dir, source.step, path.stem)

    with staged_folder(out) as staging:
        export_drafter(drafter, staging)  # save_pretrained: model.safetensors + config.json
        saved = json.loads((staging / "config.json").read_text())
        config = hub_config(saved, verifier_for(target, base_model) if speculators else None)
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for name in REMOTE_CODE:
            shutil.copyfile(LIBRARY_DIR / name, staging / name)
        facts = CardFacts(
            name=(repo or out.name).split("/")[-1], repo=repo, target=target, base_model=base_model,
            license=license_id, drafter_config=config, num_parameters=sum(p.numel() for p in drafter.parameters()),
            dtype=dtype, step=source.step, checkpoint=source.label, hyper_parameters=source.hyper_parameters,
            run_config=run_config, evaluation=evaluation, other_evaluated_steps=evaluated_steps(run_dir),
            speculators=speculators,
        )
        (staging / "README.md").write_text(render_model_card(facts))
        check_loads_back(staging, drafter)
        readable_by_all(staging)
    if evaluation is None:
        print(f"[export] note: step {source.step} has no evaluation in {run_dir / 'eval'}; the card says so",
              file=sys.stderr)
    if base_model is None:
        print(f"[export] note: target {target!r} has no Hub id; give --base-model owner/name so the card links it"
              + (" and vLLM can find the verifier" if speculators else ""), file=sys.stderr)
    return out


def readable_by_all(folder: Path) -> None:
    """The permissions a plain mkdir/open would give (temp folders and files are created owner-only)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _looks_like_hub_id(name: str | None) -> bool:
    return bool(name) and name.count("/") == 1 and not name.startswith((".", "/")) and not Path(name).exists()


def check_export_folder(folder: Path) -> None:
    missing = [name for name in EXPORT_FILES if not (folder / name).is_file()]
    if missing:
        raise DDTreeError(
            f"--push-only {folder}: not a finished export (missing {', '.join(missing)}); export it first"
        )


def push(api: HfApi, endpoint: str, folder: Path, repo: str, private: bool) -> str:
    """Upload the folder as one commit; return the repo URL."""
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(
            folder_path=folder, repo_id=repo, commit_message="Upload DFlash drafter (training/publish.py)"
        )
    except Exception as error:  # noqa: BLE001 - any upload failure: the export stays for --push-only
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DDTreeError(
            f"upload to {repo} failed ({reason}); the export in {folder} is intact: "
            f"retry with python -m training.publish --push-only {folder} --repo {repo}"
        ) from None
    return f"{endpoint}/{repo}"


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training.publish", description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", help="the run folder, outputs/<recipe>/<run>")
    parser.add_argument("--out", help="the folder to write (refused if it holds files, unless --overwrite)")
    parser.add_argument("--ckpt", default="best", help="best (default), last, or a checkpoint path")
    parser.add_argument("--speculators", action="store_true", help="add vLLM's speculators fields to config.json")
    parser.add_argument("--base-model", help="the target's Hub id, if the run named it otherwise (a folder)")
    parser.add_argument("--license", default="apache-2.0", help="card license; match the target's (e.g. llama3.1)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="dtype of the exported weights")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out folder")
    parser.add_argument("--repo", help="Hub repo id, user/name")
    parser.add_argument("--push", action="store_true", help="upload to --repo after exporting (token: HF_TOKEN)")
    parser.add_argument("--private", action="store_true", help="create the Hub repo private")
    parser.add_argument("--push-only", metavar="FOLDER", help="upload a finished export without exporting again")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.repo is not None:
            check_repo_id(args.repo)
        if args.push_only:
            if args.run or args.out:
                raise DDTreeError("--push-only takes the export folder only; drop RUN and --out")
            if not args.repo:
                raise DDTreeError("--push-only needs --repo user/name")
            folder = Path(args.push_only)
            check_export_folder(folder)
            api, endpoint = preflight_hub(args.repo)
            print(f"[export] pushed {folder} to {push(api, endpoint, folder, args.repo, args.private)}")
            return 0
        if not args.run or not args.out:
            raise DDTreeError("give the run folder and --out (make export RUN=... OUT=...)")
        run_dir, out = Path(args.run), Path(args.out)
        if not run_dir.is_dir():
            raise DDTreeError(f"RUN={run_dir}: no such run folder; give outputs/<recipe>/<run>")
        check_output_folder(out, args.overwrite)
        if args.push and not args.repo:
            raise DDTreeError("--push needs --repo user/name (REPO=user/name)")
        hub = preflight_hub(args.repo) if args.push else None
        export_folder(
            run_dir, args.ckpt, out, speculators=args.speculators, base_model=args.base_model,
            license_id=args.license, dtype=args.dtype, repo=args.repo,
        )
        print(f"[export] {out} written (load it with AutoModel.from_pretrained(..., trust_remote_code=True))")
        if hub is not None:
            print(f"[export] pushed to {push(*hub, out, args.repo, args.private)}")
    except DDTreeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
