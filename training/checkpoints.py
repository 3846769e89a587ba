"""Training checkpoints: writing one whole or not at all, and reading it once.

    checkpoint = load_checkpoint(path)      # .drafter, .step, .hyper_parameters, .callbacks

A checkpoint is a Lightning .ckpt file written by training/train.py (drafter, optimizer, loop and
data state, the drafter config; never the target), or, under a DeepSpeed strategy, a folder of
per-rank shards under the same name. Finding one (best, last, a path, a run folder) is
training/checkpoint_paths.py's, which needs no torch.

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
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ddtree.configuration_dflash import DFlashDrafterConfig
from ddtree.errors import DDTreeError, error_line, first_and_count
from ddtree.files import WriteFailed, atomic_file, refused_write_as_error
from ddtree.modeling_dflash import DFlashDraftModel

from .checkpoint_paths import (SAVING_MARKER, deepspeed_model_states, is_checkpoint, is_deepspeed_checkpoint,
                               is_readable, run_checkpoints, run_folder_of, saved_at, saved_step)
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
        with (checkpoint_refusal_as_error(Path(path)),
              atomic_file(path, "wb", staging_prefix=self.STAGING_PREFIX) as handle):
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())  # the bytes are on disk before the rename makes them the checkpoint

    @classmethod
    def remove_stale_staging(cls, folder: Path) -> list[Path]:
        """Delete the staging files a killed save left in `folder`; those deleted."""
        stale = [path for path in Path(folder).glob(f"{cls.STAGING_PREFIX}*") if path.is_file()]
        for path in stale:
            path.unlink(missing_ok=True)
        return stale


@contextlib.contextmanager
def checkpoint_refusal_as_error(path: Path):
    """A save of the checkpoint `path` that the disk refuses (no space, a quota: refused_write_as_error) as one line
    saying how the run goes on. The checkpoint it would have replaced is untouched (AtomicCheckpointIO's file) or
    refused at a resume (a DeepSpeed folder keeps its SAVING_MARKER)."""
    try:
        with refused_write_as_error(path):
            yield
    except WriteFailed as failure:
        raise DDTreeError(f"cannot write the checkpoint {path}: {failure.reason}; {after_a_refused_save(path)}") from None


def after_a_refused_save(path: Path) -> str:
    """How a run goes on after the disk refused a file of it at `path` (a checkpoint, an evaluation), for its line."""
    if holds_checkpoint(path):
        return "the previous checkpoints are whole: make room and resume the run (--resume <run folder>)"
    # the first save: --resume would find nothing to resume
    return "the run holds no checkpoint yet: make room and start it again (the same command)"


def holds_checkpoint(path: Path) -> bool:
    """Whether a save into `path` failing leaves a checkpoint to resume from: a readable one of its run folder's, as
    --resume of that folder finds them (run_checkpoints), or, outside a run folder, another beside `path` (a DeepSpeed
    folder whose save failed keeps the name of a checkpoint but is none)."""
    run_dir = run_folder_of(path)
    if run_dir is not None:
        return any(is_readable(checkpoint) for checkpoint in run_checkpoints(run_dir))
    return any(is_checkpoint(other) and not other.is_symlink() and is_readable(other)
               for other in path.parent.glob("*.ckpt"))


# ----------------------------------------------------------------------------- reading a checkpoint


def deepspeed_client_state(folder: Path) -> dict:
    """What Lightning saved beside the weights of a DeepSpeed checkpoint folder (drafter_config, hyper_parameters, loops).

    Read from rank 0's model-state file (deepspeed_model_states) without DeepSpeed, so before its engine loads the
    shards; mmap leaves the weights it also holds on disk.
    """
    states = deepspeed_model_states(folder)
    try:
        return torch.load(states, map_location="cpu", weights_only=False, mmap=True)
    except Exception as error:  # noqa: BLE001 - an empty or garbled shard: DeepSpeed's loader would fail too
        raise DDTreeError(f"CKPT {folder}: cannot read {states.relative_to(folder)} "
                          f"({type(error).__name__}: {error_line(error)})") from None


def newest_finite_checkpoint(run_dir: Path) -> Path | None:
    """The run's newest checkpoint that loads with finite drafter weights (load_checkpoint refuses the others), or None.

    After a divergence: the checkpoint written just before the stop can already hold NaN weights, since an update can
    blow them up with a finite gradient and only the next step's loss shows it. Newest is the highest saved step, file
    times only between equal steps, as resume_point orders them: a copied folder's times are the order its files were
    copied in."""
    newest_first = sorted(run_checkpoints(run_dir), key=lambda path: (saved_step(path), saved_at(path)), reverse=True)
    for checkpoint in newest_first:
        try:
            load_checkpoint(checkpoint)
        except DDTreeError:
            continue
        return checkpoint
    return None


@dataclass
class Checkpoint:
    """A training checkpoint, read once."""

    path: Path  # the .ckpt file or DeepSpeed folder it was read from
    drafter: DFlashDraftModel  # as exported: LoRA merged, in the dtype it was saved in
    step: int  # the global step it was saved at
    hyper_parameters: dict  # DistillModule's arguments: target, target_dtype, lora_rank, lr, ...
    callbacks: dict  # each callback's saved state, e.g. AcceptanceEvaluation's history of measurements


def evaluation_state(checkpoint: Checkpoint) -> dict:
    """AcceptanceEvaluation's saved state (history, measurement), or {} where the checkpoint holds none."""
    return next((state for key, state in checkpoint.callbacks.items() if "AcceptanceEvaluation" in str(key)), {})


def recorded_evaluation(checkpoint: Checkpoint) -> dict | None:
    """The training-time evaluation the checkpoint itself recorded at its step (AcceptanceEvaluation's history row:
    step, summary, seconds, ...), or None."""
    history = evaluation_state(checkpoint).get("history", [])
    return next((row for row in history if row.get("step") == checkpoint.step), None)


def drafter_from_weights(drafter_config: dict, hyper_parameters: dict, weights: dict[str, torch.Tensor]) -> DFlashDraftModel:
    """The drafter as exported (LoRA adapters merged) from its config and its weights.

    `weights` are named as the training drafter's state_dict() names them (under a LoRA wrapper
    when hyper_parameters has lora_rank > 0). Raises RuntimeError if they do not fit the config, naming the first
    weight missing and the first one it has no place for.
    """
    drafter = DFlashDraftModel(DFlashDrafterConfig.from_dict(drafter_config))
    if hyper_parameters.get("lora_rank", 0) > 0:
        drafter = add_drafter_lora(
            drafter, hyper_parameters["lora_rank"], hyper_parameters["lora_alpha"], hyper_parameters["lora_dropout"],
            hyper_parameters.get("lora_target_modules") or DEFAULT_LORA_MODULES,
        )
    # strict=False returns the names that strict=True raises with: its message's first line, the one a user sees,
    # names none of them ("Error(s) in loading state_dict for DFlashDraftModel:"). A weight of another shape still
    # raises so: its line is the first that names one ("size mismatch for fc.weight: ...").
    try:
        missing, unexpected = drafter.load_state_dict(weights, strict=False)
    except RuntimeError as error:
        named = [line.strip() for line in str(error).splitlines()[1:] if line.strip()]
        raise RuntimeError(named[0] if named else str(error)) from None
    mismatches = [f"the config needs weight {first_and_count(missing)}, absent from the weights"] if missing else []
    if unexpected:
        mismatches.append(f"the weights hold {first_and_count(unexpected)}, which the config has no place for")
    if mismatches:
        raise RuntimeError("; ".join(mismatches))
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
        if (path / "config.yaml").is_file():
            named = next((path / "checkpoints" / f"{name}.ckpt" for name in ("best", "last")
                          if (path / "checkpoints" / f"{name}.ckpt").exists()), path / "checkpoints" / "best.ckpt")
            raise DDTreeError(f"CKPT {path} is a run folder, not a checkpoint: give one of its checkpoints, {named} "
                              f"(or RUN={path} with make export)")
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
    except RuntimeError as error:  # the weights do not fit the stored config: the file was edited, or another version's
        raise DDTreeError(f"CKPT {path}: its weights do not match its drafter_config ({error_line(error)}); "
                          "give a checkpoint as training/train.py wrote it") from None
    non_finite = non_finite_tensors(drafter)
    if non_finite:  # decoding, lossless whatever is proposed, would score it tau 1.0; an export would ship noise
        raise DDTreeError(f"CKPT {path}: {non_finite} of the drafter's parameter tensors hold NaN or inf (training "
                          "diverged before this step): give an earlier checkpoint of the run (its step-N.ckpt)")
    return Checkpoint(path, drafter, int(saved["global_step"]), hyper_parameters, dict(saved.get("callbacks") or {}))


RESUME_KEYS = ("pytorch-lightning_version", "global_step", "loops", "state_dict", "drafter_config")


def check_resumable(path: Path) -> dict:
    """A .ckpt file that Lightning can resume a run of this project from, or one line saying what it is instead
    (Lightning read any other pickle into a KeyError traceback). DeepSpeed folders are checked by their strategy.
    Returns the checkpoint, memory-mapped (its tensors are read only where used)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # mmap: nothing big is read
    except Exception as error:  # noqa: BLE001 - anything torch.load cannot read is not a checkpoint
        raise DDTreeError(f"--resume {path} is not a PyTorch checkpoint ({type(error).__name__}: {error_line(error)}); "
                          "give a run's last.ckpt, step-N.ckpt or hpc_ckpt_N.ckpt") from None
    missing = [key for key in RESUME_KEYS if key not in saved] if isinstance(saved, dict) else list(RESUME_KEYS)
    if missing:
        raise DDTreeError(f"--resume {path} is not a training checkpoint of this project (it has no "
                          f"{', '.join(missing)}): give a run's last.ckpt, step-N.ckpt or hpc_ckpt_N.ckpt")
    return saved


def non_finite_tensors(drafter: torch.nn.Module) -> int:
    """How many of the drafter's parameter tensors hold a NaN or an infinity (one wait on the device for all).

    A NaN or an inf makes the tensor's float32 sum non-finite, and so would only weights near 1e38 / numel, which are
    as broken. The sums cost 12 ms for 50M float32 weights on one CPU thread; `isfinite(p).all()` took 230 ms."""
    sums = [p.sum(dtype=torch.float32) for p in drafter.parameters()]
    return int((~torch.stack(sums).isfinite()).sum()) if sums else 0


def drafter_from_checkpoint(path: str | Path) -> DFlashDraftModel:
    """load_checkpoint(path).drafter: the exported form of a checkpoint's drafter."""
    return load_checkpoint(Path(path)).drafter
