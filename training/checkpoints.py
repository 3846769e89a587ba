"""Training checkpoints: finding one (best, last, a path, a run folder), and reading it once.

    path = find_checkpoint("best", Path("outputs/smollm2-135m"))      # make eval CKPT=best
    path, label = find_run_checkpoint(run_dir, "best")                # make export RUN=... CKPT=best
    checkpoint, run_dir = find_resume("last", Path("outputs/smollm2-135m"))   # make train RESUME=last
    checkpoint = load_checkpoint(path)      # .drafter, .step, .hyper_parameters, .callbacks

A checkpoint is a Lightning .ckpt file written by training/train.py (drafter, optimizer, loop and
data state, the drafter config; never the target), or, under a DeepSpeed strategy, a folder of
per-rank shards under the same name (it holds a `latest` tag file). A run folder holds
checkpoints/{step-N,last,best}.ckpt (best.ckpt links to the step with the highest measured
tau), hpc_ckpt_N.ckpt after a SLURM requeue signal, and the config.yaml the run was trained with.

`load_checkpoint` reads a checkpoint once (a DeepSpeed folder is consolidated to fp32 weights
first) and rebuilds the drafter as it is exported, LoRA adapters merged. Anything that is not a drafter checkpoint of
this project is a DDTreeError of one line.

Every .ckpt file is written by `AtomicCheckpointIO` (training/recipe.py installs it): whole or not at all.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.errors import DDTreeError, error_line
from ddtree.files import atomic_file
from ddtree.modeling_dflash import DFlashDraftModel

from .arguments import missing_checkpoint
from .peft_utils import DEFAULT_LORA_MODULES, add_drafter_lora, merged_drafter

# ----------------------------------------------------------------------------- writing a checkpoint


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, with the staging file in the checkpoint's own folder.

    Lightning stages a checkpoint through fsspec in $TMPDIR and moves it into place: where outputs/ lies on another
    filesystem the move is a copy, and a full disk or a kill during it left a truncated step-N.ckpt under its final
    name. Here torch.save streams into a hidden file beside the checkpoint, flushed to disk, and one rename puts it in
    place: the name holds the old file or the whole new one. Streaming also spares the in-memory copy of the whole
    checkpoint that Lightning's writer makes. A failed save (no space left) is one line; the checkpoint it would have
    replaced is untouched. Remote paths (s3://...) keep Lightning's writer.

    The staging file's name holds neither the checkpoint's name nor `.ckpt` (`.saving-checkpoint-<random>`): Lightning
    numbers SLURM's hpc_ckpt_N.ckpt from every name in the run folder that contains `hpc_ckpt_`, and nothing that
    looks for checkpoints may take a kill's leftover for one (remove_stale_staging deletes it at the next start).
    """

    STAGING_PREFIX = ".saving-checkpoint-"

    @classmethod
    def is_staging(cls, path: Path) -> bool:
        return path.name.startswith(cls.STAGING_PREFIX)

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        try:
            with atomic_file(path, "wb", staging_prefix=self.STAGING_PREFIX) as handle:
                torch.save(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())  # the bytes are on disk before the rename makes them the checkpoint
        except OSError as error:
            raise DDTreeError(f"cannot write the checkpoint {path}: {error.strerror or error}; the previous "
                              "checkpoints are whole: make room and resume the run (--resume <run folder>)") from None

    @classmethod
    def remove_stale_staging(cls, folder: Path) -> list[Path]:
        """Delete the staging files a killed save left in `folder`; those deleted."""
        stale = [path for path in Path(folder).glob(f"{cls.STAGING_PREFIX}*") if path.is_file()]
        for path in stale:
            path.unlink(missing_ok=True)
        return stale


# ----------------------------------------------------------------------------- finding a checkpoint


def is_deepspeed_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def is_checkpoint(path: Path) -> bool:
    """A .ckpt file or a DeepSpeed checkpoint folder (through a best.ckpt link too)."""
    return path.is_file() or is_deepspeed_checkpoint(path)


# In a DeepSpeed checkpoint folder while a save writes it (strategies.DrafterDeepSpeed.save_checkpoint): DeepSpeed
# rewrites the folder's files in place, so a save cut short leaves two steps' files mixed.
SAVING_MARKER = "saving"


def is_readable(checkpoint: Path) -> bool:
    """A .ckpt file whose zip directory reads, or a DeepSpeed folder whose last save finished (its shards are left
    to DeepSpeed to judge).

    torch.save writes a zip archive with its directory at the very end, so a file cut off mid-write
    or mid-copy fails here in milliseconds, before a Lightning resume would load it.
    """
    if checkpoint.is_dir():
        return not (checkpoint / SAVING_MARKER).exists()
    try:
        with zipfile.ZipFile(checkpoint) as archive:
            return bool(archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def deepspeed_client_state(folder: Path) -> dict:
    """What Lightning saved beside the weights of a DeepSpeed checkpoint folder (drafter_config, hyper_parameters, loops).

    Read from the folder's first model-state file without DeepSpeed, so before its engine loads the shards; mmap
    leaves the weights it also holds on disk.
    """
    tag = (folder / "latest").read_text().strip()
    states = folder / tag / "mp_rank_00_model_states.pt"
    try:
        return torch.load(states, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # noqa: BLE001 - a missing, empty or garbled shard: DeepSpeed's loader would fail too
        raise DDTreeError(f"CKPT {folder}: cannot read {states.relative_to(folder)} "
                          f"({type(error).__name__}: {error_line(error)})") from None


def saved_at(checkpoint: Path) -> float:
    """When a checkpoint was last written: a file's mtime, or a DeepSpeed folder's `latest` tag file's."""
    return (checkpoint / "latest" if checkpoint.is_dir() else checkpoint).stat().st_mtime


def run_folder_of(checkpoint: Path) -> Path | None:
    """The run a checkpoint belongs to: the folder with the config.yaml above checkpoints/x.ckpt or hpc_ckpt_N.ckpt."""
    resolved = checkpoint.resolve()
    return next((folder for folder in resolved.parents[:2] if (folder / "config.yaml").is_file()), None)


ABLATE_PREFIX = "ablate-"  # `make ablate` names its variants' runs ablate-<stamp>-<variant> (training/ablate.py)


def newest_run(recipe_root: Path, name: str) -> Path | None:
    """The newest run under recipe_root (by when its last.ckpt was saved) that has checkpoints/<name>.

    `make ablate`'s variant runs are left out: 'last' and 'best' mean the newest `make train` run, not a variant
    trained for a comparison (name a variant's folder to take it)."""
    runs = [found.parent.parent for found in recipe_root.glob(f"*/checkpoints/{name}")
            if is_checkpoint(found) and not found.parent.parent.name.startswith(ABLATE_PREFIX)]

    def last_saved(run: Path) -> float:
        last = run / "checkpoints" / "last.ckpt"
        return saved_at(last) if is_checkpoint(last) else 0.0

    return max(runs, key=last_saved, default=None)


def no_run_found(recipe_root: Path, name: str) -> str:
    """Why newest_run found nothing, with the variant runs it left out (if any) and how to take one."""
    variants = sorted(recipe_root.glob(f"{ABLATE_PREFIX}*/checkpoints/{name}"))
    counted = f"{len(variants)} `make ablate` variant run" + ("s there are" if len(variants) > 1 else " there is")
    left_out = f" ({counted} not counted; name one, e.g. {variants[-1].parent.parent})" if variants else ""
    return f"no run under {recipe_root} has checkpoints/{name}{left_out}"


def check_run_folder(run_dir: Path) -> None:
    """RUN for `make eval` and `make export`: a folder `make train` wrote, or one line saying what it is instead."""
    if not run_dir.is_dir():
        raise DDTreeError(f"RUN={run_dir}: no such run folder; give outputs/<recipe>/<run>")
    if not (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints").is_dir():
        raise DDTreeError(f"RUN={run_dir} is not a training run (no config.yaml, no checkpoints/); "
                          "give the folder `make train` wrote, outputs/<recipe>/<run>")


def find_checkpoint(spec: str, recipe_root: Path, run_dir: Path | None = None) -> Path:
    """CKPT for `make eval`: 'best' or 'last' of RUN (a run folder), else of the newest run under recipe_root, or a
    checkpoint path."""
    if run_dir is not None:
        check_run_folder(run_dir)
        return find_run_checkpoint(run_dir, spec)[0]
    if spec in ("best", "last"):
        run = newest_run(recipe_root, f"{spec}.ckpt")
        if run is None:
            raise DDTreeError(f"CKPT={spec}: {no_run_found(recipe_root, f'{spec}.ckpt')}; train one first, or give RUN")
        return run / "checkpoints" / f"{spec}.ckpt"
    path = Path(spec)
    if (path / "config.yaml").is_file():
        raise DDTreeError(f"CKPT={spec} is a run folder: give RUN={spec} (its best.ckpt, or CKPT=last with it)")
    if not is_checkpoint(path):
        raise DDTreeError(f"CKPT={spec}: no such checkpoint file; give a .ckpt path (or DeepSpeed folder), 'best' or "
                          "'last' (of RUN=<run folder>, else of the recipe's newest run)")
    return path


def find_run_checkpoint(run_dir: Path, spec: str) -> tuple[Path, str]:
    """CKPT for `make export`: best | last | a path (absolute, relative to here or to <run>/checkpoints).

    Returns the resolved path and a label saying how it was chosen, for the model card
    ("best -> step-200.ckpt").
    """
    checkpoints = run_dir / "checkpoints"
    if not spec.strip():  # Path("") is the current folder, which would be read as a checkpoint
        raise DDTreeError("CKPT is empty; give best, last or a path to a checkpoint")
    if spec in ("best", "last"):
        named = checkpoints / f"{spec}.ckpt"
        if not named.exists():
            hint = "CKPT=last or a path" if spec == "best" else "a path to a checkpoint"
            why = " (runs trained before the acceptance evaluation have no best.ckpt)" if spec == "best" else ""
            raise DDTreeError(f"CKPT={spec}: {named} does not exist{why}; use {hint}")
        resolved = named.resolve()  # best.ckpt is a symlink to the chosen step-N checkpoint
        return resolved, spec if resolved.name == named.name else f"{spec} -> {resolved.name}"
    for candidate in (Path(spec), checkpoints / spec):
        if candidate.exists():
            owner = run_folder_of(candidate)
            if owner is not None and owner.resolve() != run_dir.resolve():  # the card would show this run's numbers
                raise DDTreeError(f"CKPT={spec} is a checkpoint of the run {owner}, not of RUN={run_dir}; "
                                  f"export it with RUN={owner}")
            return candidate.resolve(), candidate.name
    raise DDTreeError(f"CKPT={spec}: no such checkpoint (looked in . and {checkpoints}); give best, last or a path")


def newest_checkpoint(run_dir: Path) -> Path:
    """The newest of a run's checkpoints/last.ckpt and the hpc_ckpt_N.ckpt Lightning saves on SLURM's requeue signal;
    without either (checkpoint.save_last false, or a save of last.ckpt cut short), its newest step checkpoint. Each is
    a whole training state, and a run folder holding any is refused as a new run's, so it must resume from one.
    last.ckpt first: it is written with every step checkpoint, and file times alone would rank a copied folder's
    files by the order they were copied in."""
    saved = run_checkpoints(run_dir)
    latest = [p for p in saved if p.name == "last.ckpt" or p.name.startswith("hpc_ckpt_")]
    if latest or saved:
        return (latest or saved)[0]  # run_checkpoints: newest first
    unfinished = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    if unfinished:  # a DeepSpeed folder whose first save was cut short (no `latest`, or its `saving` marker)
        raise DDTreeError(f"--resume {run_dir}: no whole checkpoint: {', '.join(unfinished)} in checkpoints/ is a save "
                          "cut short, with no state to continue from; start again under another --run")
    raise DDTreeError(f"--resume {run_dir}: the run has no checkpoint yet (none in checkpoints/, no hpc_ckpt_*.ckpt)")


def run_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run, newest first: checkpoints/*.ckpt (best.ckpt, a link, counted once) and hpc_ckpt_N.ckpt."""
    found = [*(run_dir / "checkpoints").glob("*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")]
    return sorted((p for p in found if is_checkpoint(p) and not p.is_symlink()), key=saved_at, reverse=True)


def find_resume(resume: str, recipe_root: Path) -> tuple[Path, Path]:
    """(checkpoint, run folder) for --resume: 'last' = newest run of this recipe with a last.ckpt.

    Also a run folder (its newest checkpoint) or a checkpoint path: a .ckpt file, or the folder a
    DeepSpeed strategy writes under that name. A .ckpt file that cannot be read (cut off when the
    run was killed or the disk filled) is refused here, naming the run's readable checkpoints.
    """
    if resume == "last":
        run = newest_run(recipe_root, "last.ckpt")
        if run is None:
            raise DDTreeError(f"--resume last: {no_run_found(recipe_root, 'last.ckpt')}; start one first")
        checkpoint = run / "checkpoints" / "last.ckpt"
    elif (Path(resume) / "config.yaml").is_file():
        checkpoint = newest_checkpoint(Path(resume))
    else:
        checkpoint = Path(resume)
        if not is_checkpoint(checkpoint):
            raise missing_checkpoint(resume)
    run_dir = run_folder_of(checkpoint)
    if run_dir is None and not is_readable(checkpoint):
        raise DDTreeError(f"--resume {resume}: {checkpoint} is not a readable checkpoint; give a .ckpt from a run's "
                          "checkpoints/ folder, a run folder or 'last'")
    if run_dir is None:
        raise DDTreeError(f"--resume {resume}: {checkpoint.resolve().parent.parent}/config.yaml is missing, "
                          "so the run cannot be resumed exactly")
    if not is_readable(checkpoint):
        others = [str(p) for p in run_checkpoints(run_dir) if p.resolve() != checkpoint.resolve() and is_readable(p)]
        fix = (f"resume from an earlier one: {', '.join(others)}" if others
               else f"the run {run_dir} has no other readable checkpoint; start it again")
        why = "its save was cut short" if checkpoint.is_dir() else "truncated?"
        raise DDTreeError(f"--resume {resume}: checkpoint {checkpoint} is unreadable ({why}); {fix}")
    return checkpoint, run_dir


def newest_finite_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint that loads with finite drafter weights (load_checkpoint refuses the others), or None.

    After a divergence: the checkpoint written just before the stop can already hold NaN weights, since an update can
    blow them up with a finite gradient and only the next step's loss shows it."""
    for checkpoint in run_checkpoints(run_dir):
        try:
            load_checkpoint(checkpoint)
        except DDTreeError:
            continue
        return checkpoint
    return None


# ----------------------------------------------------------------------------- reading a checkpoint


@dataclass
class Checkpoint:
    """A training checkpoint, read once."""

    path: Path  # the .ckpt file or DeepSpeed folder it was read from
    drafter: DFlashDraftModel  # as exported: LoRA merged, in the dtype it was saved in
    step: int  # the global step it was saved at
    hyper_parameters: dict  # DistillModule's arguments: target, target_dtype, lora_rank, lr, ...
    callbacks: dict  # each callback's saved state, e.g. AcceptanceEvaluation's history of measurements


def recorded_evaluation(checkpoint: Checkpoint) -> dict | None:
    """The training-time evaluation the checkpoint itself recorded at its step (AcceptanceEvaluation's history row:
    step, summary, seconds, ...), or None."""
    for key, state in checkpoint.callbacks.items():
        if "AcceptanceEvaluation" in str(key):
            return next((row for row in state.get("history", []) if row.get("step") == checkpoint.step), None)
    return None


def drafter_from_weights(drafter_config: dict, hyper_parameters: dict, weights: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """The drafter as exported (LoRA adapters merged) from its config and its weights.

    `weights` are named as the training drafter's state_dict() names them (under a LoRA wrapper
    when hyper_parameters has lora_rank > 0). Raises RuntimeError if they do not fit the config.
    """
    drafter = DFlashDraftModel(DFlashDrafterConfig.from_dict(drafter_config))
    if hyper_parameters.get("lora_rank", 0) > 0:
        drafter = add_drafter_lora(
            drafter, hyper_parameters["lora_rank"], hyper_parameters["lora_alpha"], hyper_parameters["lora_dropout"],
            hyper_parameters.get("lora_target_modules") or DEFAULT_LORA_MODULES,
        )
    drafter.load_state_dict(weights, strict=True)
    return merged_drafter(drafter)


def consolidate_deepspeed(folder: Path) -> dict:
    """A DeepSpeed (ZeRO) checkpoint folder as a single-file checkpoint's dict, with every rank's shards gathered to fp32."""
    from lightning.pytorch.utilities.deepspeed import convert_zero_checkpoint_to_fp32_state_dict

    # Lightning's converter also saves what it returns to a file (and prints that it does); only the dict is used.
    with tempfile.TemporaryDirectory(prefix="ddtree-consolidate-") as workdir, contextlib.redirect_stdout(io.StringIO()):
        try:
            return convert_zero_checkpoint_to_fp32_state_dict(folder, Path(workdir) / "consolidated.ckpt")
        except Exception as error:  # noqa: BLE001 - an empty shard is an EOFError, a garbled one an UnpicklingError, ...
            raise DDTreeError(f"CKPT {folder}: could not consolidate the DeepSpeed checkpoint "
                              f"({type(error).__name__}: {error_line(error)})") from None


def load_checkpoint(path: Path) -> Checkpoint:
    """Read a .ckpt file or a DeepSpeed checkpoint folder once, or raise a DDTreeError naming what is wrong."""
    path = Path(path)
    if path.is_dir():
        if (path / "config.json").is_file():
            raise DDTreeError(f"CKPT {path} is an exported drafter folder, not a training checkpoint; give a .ckpt from the run")
        if not is_deepspeed_checkpoint(path):
            raise DDTreeError(f"CKPT {path} is a folder but not a DeepSpeed checkpoint (no 'latest' file in it)")
        if not is_readable(path):
            raise DDTreeError(f"CKPT {path}: its last save was cut short (the '{SAVING_MARKER}' marker is in it), so its "
                              "shards may mix two steps; give an earlier checkpoint of the run")
        saved = consolidate_deepspeed(path)
    elif not path.is_file():
        raise DDTreeError(f"CKPT {path}: no such checkpoint; give a .ckpt file from outputs/<recipe>/<run>/checkpoints")
    else:
        try:
            # mmap: the optimizer state a checkpoint also holds is never read into memory.
            saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        except Exception as error:  # noqa: BLE001 - anything torch.load cannot read is not a checkpoint
            raise DDTreeError(
                f"CKPT {path} is not a PyTorch checkpoint ({type(error).__name__}: {error_line(error)}); "
                "give a .ckpt from the run"
            ) from None
    if not isinstance(saved, dict) or "drafter_config" not in saved or "global_step" not in saved:
        raise DDTreeError(
            f"CKPT {path} is not a drafter checkpoint of this project (no drafter_config/global_step): "
            "give a checkpoint written by training/train.py"
        )
    hyper_parameters = dict(saved.get("hyper_parameters") or {})
    prefix = "drafter."  # DistillModule's state_dict: the drafter's weights only (never the target's)
    weights = {key[len(prefix):]: value for key, value in (saved.get("state_dict") or {}).items() if key.startswith(prefix)}
    try:
        drafter = drafter_from_weights(saved["drafter_config"], hyper_parameters, weights)
    except RuntimeError as error:  # load_state_dict(strict=True): the weights do not fit the stored config
        raise DDTreeError(f"CKPT {path}: its weights do not match its drafter_config ({error_line(error)})") from None
    non_finite = non_finite_tensors(drafter)
    if non_finite:  # decoding, lossless whatever is proposed, would score it tau 1.0; an export would ship noise
        raise DDTreeError(f"CKPT {path}: {non_finite} of the drafter's parameter tensors hold NaN or inf (training "
                          "diverged before this step): give an earlier checkpoint of the run (its step-N.ckpt)")
    return Checkpoint(path, drafter, int(saved["global_step"]), hyper_parameters, dict(saved.get("callbacks") or {}))


def non_finite_tensors(drafter: torch.nn.Module) -> int:
    """How many of the drafter's parameter tensors hold a NaN or an infinity (one wait on the device for all).

    A NaN or an inf makes the tensor's float32 sum non-finite, and so would only weights near 1e38 / numel, which are
    as broken. The sums cost 12 ms for 50M float32 weights on one CPU thread; `isfinite(p).all()` took 230 ms."""
    sums = [p.sum(dtype=torch.float32) for p in drafter.parameters()]
    return int((~torch.stack(sums).isfinite()).sum()) if sums else 0


def drafter_from_checkpoint(path: str | Path) -> DFlashDraftModel:
    """load_checkpoint(path).drafter: the exported form of a checkpoint's drafter."""
    return load_checkpoint(Path(path)).drafter
