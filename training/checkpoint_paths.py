"""Where a run's checkpoints are: found by name (best, last), by run folder or by path, and whether one is whole.

    path = find_checkpoint("best", Path("outputs/smollm2-135m"))      # make eval CKPT=best
    path, label = find_run_checkpoint(run_dir, "best")                # make export RUN=... CKPT=best
    checkpoint, run_dir = find_resume("last", Path("outputs/smollm2-135m"))   # make train RESUME=last

A run folder holds checkpoints/{step-N,last,best}.ckpt (best.ckpt links to the step with the highest measured
tau), hpc_ckpt_N.ckpt after a SLURM requeue signal, and the config.yaml the run was trained with. A checkpoint is a
.ckpt file or, under a DeepSpeed strategy, a folder of per-rank shards under the same name (it holds a `latest` tag
file). Reading one is training/checkpoints.py's.

Free of torch and Lightning at import: the training commands find what their command line names before those load
(training/arguments.py), so a run or checkpoint that is not there is one line at once. Only ranking a run's
last.ckpt against its hpc_ckpt_N.ckpt (saved_step) loads torch, when it comes to that.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from ddtree.errors import DDTreeError
from ddtree.files import read_yaml_mapping


def missing_checkpoint(resume: str) -> DDTreeError:
    return DDTreeError(f"--resume {resume}: no such checkpoint; give a .ckpt path, a run folder or 'last'")


def is_deepspeed_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "latest").is_file()


def is_drafter_folder(path: Path) -> bool:
    """A folder `ddtree` decodes with (a run's drafter/, an export): its config.json, and no DeepSpeed `latest`."""
    return path.is_dir() and (path / "config.json").is_file() and not is_deepspeed_checkpoint(path)


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



def is_other_file(path: Path) -> bool:
    """A file that does not begin as the zip archive torch.save writes: a run's config.yaml or report, a prompts
    file, never a checkpoint. An empty one may be a copy cut off at once, which is_readable calls truncated."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4)
    except OSError:  # unreadable: is_readable says so
        return False
    return bool(head) and head != b"PK\x03\x04"


# Rank 0's model-state file in a DeepSpeed checkpoint's tag folder, as DeepSpeed names it (its engine's
# _get_ckpt_name): ZeRO-1/2 keep one, ZeRO-3 (partitioned weights) one per rank under the second name.
DEEPSPEED_MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")


def deepspeed_model_states(folder: Path) -> Path:
    """Rank 0's model-state file of a DeepSpeed checkpoint folder (the tag its `latest` file names): where Lightning
    saves its own state (global_step, loops, hyper_parameters, drafter_config) beside rank 0's weights.

    Reading the ZeRO-1/2 name only made every ZeRO-3 checkpoint unreadable here: its resume stopped at once and
    a requeued job trained nothing."""
    tag = folder / (folder / "latest").read_text().strip()
    found = next((tag / name for name in DEEPSPEED_MODEL_STATES if (tag / name).is_file()), None)
    if found is None:
        held = sorted(path.name for path in tag.iterdir()) if tag.is_dir() else []
        raise DDTreeError(f"CKPT {folder}: {tag.relative_to(folder)}/ holds neither "
                          f"{' nor '.join(DEEPSPEED_MODEL_STATES)} (it holds {', '.join(held) or 'nothing'}), so it is "
                          "no whole DeepSpeed checkpoint; give another checkpoint of the run")
    return found


def saved_step(checkpoint: Path) -> int:
    """The global step a checkpoint was saved at (-1 where it cannot be read): what orders a run's checkpoints, where
    file times follow the order a copy (`cp -r`) wrote them in.

    mmap: torch reads the pickled structure and maps the tensors without reading them, milliseconds for a checkpoint
    of many GB. weights_only=False, as every reader of these checkpoints here and Lightning's resume load them: a
    Lightning checkpoint may pickle classes weights_only refuses, and the resume unpickles the file whole anyway."""
    import torch  # here: the module is imported before torch loads (above), and most resumes never rank

    try:
        path = deepspeed_model_states(checkpoint) if checkpoint.is_dir() else checkpoint
        return int(torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"])
    except Exception:  # noqa: BLE001 - a file that reads as a zip but holds no step ranks below every other
        return -1


def saved_at(checkpoint: Path) -> float:
    """When a checkpoint was last written: a file's mtime, or a DeepSpeed folder's `latest` tag file's."""
    return (checkpoint / "latest" if checkpoint.is_dir() else checkpoint).stat().st_mtime


ABANDONED_PREFIX = "abandoned-after-step-"  # callbacks.move_aside: a branch left by a resume from an earlier step


def run_folder_of(checkpoint: Path) -> Path | None:
    """The run a checkpoint belongs to: the folder with the config.yaml above checkpoints/x.ckpt or hpc_ckpt_N.ckpt,
    or above checkpoints/abandoned-after-step-N/x.ckpt (abandoned_branch)."""
    branch = abandoned_branch(checkpoint)
    if branch is not None:
        return branch[0]
    resolved = checkpoint.resolve()
    return next((folder for folder in resolved.parents[:2] if (folder / "config.yaml").is_file()), None)


def abandoned_branch(checkpoint: Path) -> tuple[Path, str] | None:
    """(run folder, branch folder name) of a checkpoint a resume from an earlier step moved aside into
    <run>/checkpoints/abandoned-after-step-N/, else None. Its run's config and corpus are its own; its evaluations past
    step N are in <run>/eval/ under the same folder name, not eval/ (the current branch's steps of the same numbers)."""
    folder = checkpoint.resolve().parent
    run = folder.parent.parent
    if folder.name.startswith(ABANDONED_PREFIX) and folder.parent.name == "checkpoints" and (run / "config.yaml").is_file():
        return run, folder.name
    return None


ABLATE_PREFIX = "ablate-"  # `make ablate` names its variants' runs ablate-<stamp>-<variant> (training/ablate.py)


def newest_run(recipe_root: Path, name: str) -> Path | None:
    """The newest run under recipe_root (by when it last saved a checkpoint) that has checkpoints/<name>.

    `make ablate`'s variant runs are left out: 'last' and 'best' mean the newest `make train` run, not a variant
    trained for a comparison (name a variant's folder to take it). A run that keeps no last.ckpt
    (`checkpoint.save_last: false`) is dated by its newest checkpoint, not taken as the oldest. A <name> whose first
    DeepSpeed save was cut short (its `saving` marker, no `latest` yet) still counts, dated by its marker, for the
    callers to refuse: passed over, 'last' quietly took an older run. So does a best.ckpt linking to a step file since
    deleted, dated by the link: passed over, `make eval CKPT=best` scored an older run's."""
    # (glob("*/checkpoints/<name>") leaves such a link out: it follows it)
    runs = [found.parent.parent for found in (folder / name for folder in recipe_root.glob("*/checkpoints"))
            if (is_checkpoint(found) or (found / SAVING_MARKER).is_file() or found.is_symlink())
            and not found.parent.parent.name.startswith(ABLATE_PREFIX)]

    def last_saved(run: Path) -> float:
        found = run / "checkpoints" / name
        begun = ([] if is_checkpoint(found) else
                 [found.lstat().st_mtime] if found.is_symlink() else [(found / SAVING_MARKER).stat().st_mtime])
        return max([*begun, *(saved_at(checkpoint) for checkpoint in run_checkpoints(run))], default=0.0)

    return max(runs, key=last_saved, default=None)


def no_run_found(recipe_root: Path, name: str) -> str:
    """Why newest_run found nothing, with the variant runs it left out (if any) and how to take one."""
    variants = sorted(recipe_root.glob(f"{ABLATE_PREFIX}*/checkpoints/{name}"))
    counted = f"{len(variants)} `make ablate` variant run" + ("s there are" if len(variants) > 1 else " there is")
    left_out = f" ({counted} not counted; name one, e.g. {variants[-1].parent.parent})" if variants else ""
    return f"no run under {recipe_root} has checkpoints/{name}{left_out}"


def check_run_folder(run_dir: Path) -> None:
    """RUN for `make eval` and `make export`: a folder `make train` wrote, or one line saying what it is instead."""
    if run_dir.is_file() and is_other_file(run_dir):
        raise DDTreeError(f"RUN={run_dir} is a file, not a run folder; give outputs/<recipe>/<run>")
    if is_checkpoint(run_dir) and not (run_dir / "config.yaml").is_file():  # a .ckpt file or a DeepSpeed folder
        owner = run_folder_of(run_dir)
        kind = "a checkpoint file" if run_dir.is_file() else "a DeepSpeed checkpoint folder"
        raise DDTreeError(f"RUN={run_dir} is {kind}, not a run folder; give its run folder as RUN and the checkpoint "
                          f"as CKPT: RUN={owner or '<the run folder it was trained in>'} CKPT={run_dir}")
    if not run_dir.is_dir():
        raise DDTreeError(f"RUN={run_dir}: no such run folder; give outputs/<recipe>/<run>")
    if not (run_dir / "config.yaml").is_file() and not (run_dir / "checkpoints").is_dir():
        raise DDTreeError(f"RUN={run_dir} is not a training run (no config.yaml, no checkpoints/); "
                          "give the folder `make train` wrote, outputs/<recipe>/<run>")


def find_checkpoint(spec: str, recipe_root: Path, run_dir: Path | None = None) -> Path:
    """CKPT for `make eval`: 'best' or 'last' of RUN (a run folder), else of the newest run under recipe_root, or a
    checkpoint path. The newest run's 'best' or 'last' that cannot be read is refused, naming its readable ones: not
    an older run's taken in its place."""
    if run_dir is not None:
        check_run_folder(run_dir)
        return find_run_checkpoint(run_dir, spec)[0]
    if spec in ("best", "last"):
        run = newest_run(recipe_root, f"{spec}.ckpt")
        if run is None:
            raise DDTreeError(f"CKPT={spec}: {no_run_found(recipe_root, f'{spec}.ckpt')}; train one first, or give RUN")
        checkpoint = run / "checkpoints" / f"{spec}.ckpt"
        if not is_readable(checkpoint):
            raise unreadable_checkpoint(f"CKPT={spec}", checkpoint, run, "give an earlier one as CKPT")
        return checkpoint
    path = Path(spec)
    if (path / "config.yaml").is_file():
        raise DDTreeError(f"CKPT={spec} is a run folder: give RUN={spec} (its best.ckpt, or CKPT=last with it)")
    if is_drafter_folder(path):  # a run's drafter/ or an export: there, so not "no such checkpoint"
        raise DDTreeError(f"CKPT={spec} is an exported drafter folder, not a training checkpoint; give a .ckpt of its "
                          "run, 'best' or 'last' (`ddtree bench --drafter` measures a drafter folder)")
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
            why = f" ({why_no_best(run_dir)})" if spec == "best" else ""
            if not run_checkpoints(run_dir):  # a run stopped before its first save (a loss gone NaN at step 1): "use
                # CKPT=last or a path" sent the user to a last.ckpt that was not there either
                raise DDTreeError(f"CKPT={spec}: {named} does not exist{why}, and the run saved no checkpoint at all: "
                                  "there is none to measure or export; train it again")
            last = spec == "best" and (checkpoints / "last.ckpt").exists()
            hint = "CKPT=last or a path" if last else f"a path to a checkpoint ({saved_checkpoints(run_dir)})"
            raise DDTreeError(f"CKPT={spec}: {named} does not exist{why}; use {hint}")
        resolved = named.resolve()  # best.ckpt is a symlink to the chosen step-N checkpoint
        return resolved, spec if resolved.name == named.name else f"{spec} -> {resolved.name}"
    for candidate in (Path(spec), checkpoints / spec):
        if (candidate / "config.yaml").is_file():
            if candidate.resolve() == run_dir.resolve():
                raise DDTreeError(f"CKPT={spec} is RUN's own folder, not a checkpoint; give best, last or one of "
                                  f"its checkpoints ({checkpoints}/<name>.ckpt)")
            raise DDTreeError(f"CKPT={spec} is a run folder: give RUN={spec} (its best.ckpt, or CKPT=last with it)")
        if candidate.exists():
            owner = run_folder_of(candidate)
            if owner is not None and owner.resolve() != run_dir.resolve():  # the card would show this run's numbers
                raise DDTreeError(f"CKPT={spec} is a checkpoint of the run {owner}, not of RUN={run_dir}; "
                                  f"export it with RUN={owner}")
            return candidate.resolve(), candidate.name
    raise DDTreeError(f"CKPT={spec}: no such checkpoint (looked in . and {checkpoints}); give best, last or a path "
                      f"({saved_checkpoints(run_dir)})")


def saved_checkpoints(run_dir: Path) -> str:
    """The run's checkpoints, as CKPT= names them, for an error that asks for a path: a step never saved, or pruned
    since, left the user to list the folder for one."""
    checkpoints = run_dir / "checkpoints"
    saved = [str(p.relative_to(checkpoints)) if p.parent == checkpoints else str(p) for p in run_checkpoints(run_dir)]
    return f"the run's checkpoints, newest first: {', '.join(saved)}" if saved else "the run saved no checkpoint"


def why_no_best(run_dir: Path) -> str:
    """Why a run has no checkpoints/best.ckpt, from what its acceptance evaluation (training/callbacks.py) wrote: an
    eval/step-N.json for each step it measured, and report.md once it measured one or the run ended before its first;
    and from its config.yaml's checkpoint.save_top_k. A best.ckpt that is there, linking to a step file gone since, says
    so: it was ranked and saved, and a failed save sent the user looking for a full disk."""
    best = run_dir / "checkpoints" / "best.ckpt"
    if best.is_symlink() and not best.exists():
        return f"{why_unreadable(best)}: deleted or moved since the run ranked it"
    if any((run_dir / "eval").glob("step-*.json")):
        if configured_top_k(run_dir) == 0:
            return "the run evaluated steps but kept none as best: checkpoint.save_top_k 0 keeps last.ckpt only"
        return ("the run evaluated steps but no checkpoint of them was saved: the save failed or was cut short (a full "
                "disk, an interrupt, a crash)")
    if (run_dir / "report.md").is_file():
        return ("the run evaluated no step, so it ranked no checkpoint: it stopped before its first evaluation, as "
                "its report.md says")
    return "runs trained before the acceptance evaluation have no best.ckpt"


def configured_top_k(run_dir: Path) -> int | None:
    """checkpoint.save_top_k in the run's config.yaml; None where it is not there or cannot be read."""
    try:
        section = read_yaml_mapping(run_dir / "config.yaml").get("checkpoint")
    except (DDTreeError, OSError):
        return None
    top_k = section.get("save_top_k") if isinstance(section, dict) else None
    return top_k if isinstance(top_k, int) else None


def newest_checkpoint(run_dir: Path) -> Path:
    """The checkpoint a resume of the run folder takes (resume_point)."""
    return resume_point(run_dir)[0]


def resume_point(run_dir: Path) -> tuple[Path, Path | None]:
    """(the checkpoint a resume of the run folder takes, the unreadable newer one it passed over, else None).

    The newest of a run's checkpoints/last.ckpt and the hpc_ckpt_N.ckpt Lightning saves on SLURM's requeue signal;
    without either (checkpoint.save_last false, or a save of last.ckpt cut short), its newest step checkpoint. Each is
    a whole training state, and a run folder holding any is refused as a new run's, so it must resume from one.
    last.ckpt first: it is written with every step checkpoint. Newest means the highest saved step, file times only
    between equal steps: a copied folder's times are the order its files were copied in, which took a requeue's older
    hpc_ckpt_N.ckpt over last.ckpt. When the newest file cannot be read (a save cut short by a kill or a full disk),
    the newest readable checkpoint is taken: a requeued SLURM job resumes its run folder on every requeue, and
    refusing would fail each one while a whole step checkpoint is there. With none readable the newest is returned,
    for find_resume to refuse with its reason."""
    saved = run_checkpoints(run_dir)
    latest = [p for p in saved if p.name == "last.ckpt" or p.name.startswith("hpc_ckpt_")]
    if latest or saved:
        newest = (latest or saved)[0]  # run_checkpoints: newest file first
        passed_over = None if is_readable(newest) else newest
        readable = [p for p in (saved if passed_over else latest or saved) if is_readable(p)]
        if not readable:
            return newest, None
        # max keeps the first of equal steps, the newest file; a single candidate is not loaded
        return (max(readable, key=saved_step) if len(readable) > 1 else readable[0]), passed_over
    unfinished = sorted(p.name for p in (run_dir / "checkpoints").glob("*.ckpt"))
    if unfinished:  # a DeepSpeed folder whose first save was cut short (no `latest`, or its `saving` marker)
        raise DDTreeError(f"--resume {run_dir}: no whole checkpoint: {', '.join(unfinished)} in checkpoints/ is a save "
                          "cut short, with no state to continue from; start again under another --run")
    raise DDTreeError(f"--resume {run_dir}: the run has no checkpoint yet (none in checkpoints/, no hpc_ckpt_*.ckpt)")


def why_unreadable(checkpoint: Path) -> str:
    if checkpoint.is_symlink() and not checkpoint.exists():  # best.ckpt, its step file deleted
        return f"it links to {os.readlink(checkpoint)}, which is gone"
    return "its save was cut short" if checkpoint.is_dir() else "truncated?"


def run_checkpoints(run_dir: Path) -> list[Path]:
    """Every checkpoint of a run, newest first: checkpoints/*.ckpt (best.ckpt, a link, counted once) and hpc_ckpt_N.ckpt."""
    found = [*(run_dir / "checkpoints").glob("*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")]
    return sorted((p for p in found if is_checkpoint(p) and not p.is_symlink()), key=saved_at, reverse=True)


def find_resume(resume: str, recipe_root: Path) -> tuple[Path, Path]:
    """(checkpoint, run folder) for --resume: 'last' = newest run of this recipe with a last.ckpt.

    Also a run folder (its newest readable checkpoint: resume_point) or a checkpoint path: a .ckpt file, or the
    folder a DeepSpeed strategy writes under that name. A checkpoint named ('last' too) that cannot be read (cut off
    when the run was killed or the disk filled) is refused here, naming the run's readable checkpoints.
    """
    if not resume.strip():  # `--resume "$CKPT"` with CKPT unset: read as no --resume, it began a new run
        raise DDTreeError("--resume is empty (an unset shell variable?); give 'last', a run folder or a checkpoint path")
    if resume == "last":
        run = newest_run(recipe_root, "last.ckpt")
        if run is None:
            raise DDTreeError(f"--resume last: {no_run_found(recipe_root, 'last.ckpt')}; start one first")
        checkpoint = run / "checkpoints" / "last.ckpt"
    elif (Path(resume) / "config.yaml").is_file():
        checkpoint = newest_checkpoint(Path(resume))
    else:
        checkpoint = Path(resume)
        if is_drafter_folder(checkpoint):
            raise DDTreeError(f"--resume {resume} is an exported drafter folder, not a training checkpoint; give a "
                              ".ckpt of its run, its run folder or 'last'")
        if not is_checkpoint(checkpoint):
            raise missing_checkpoint(resume)
        if checkpoint.is_file() and is_other_file(checkpoint):  # not "unreadable (truncated?)": it never was one
            run = run_folder_of(checkpoint)
            folder = f"its run folder {run} (its newest checkpoint)" if run else "a run folder"
            raise DDTreeError(f"--resume {resume} is not a checkpoint (not a file torch.save wrote); give {folder}, "
                              "a .ckpt path or 'last'")
    branch = abandoned_branch(checkpoint)
    if branch is not None:  # its ranking names step files that are now the current branch's
        raise DDTreeError(f"--resume {resume}: a checkpoint of the branch the run {branch[0]} left (checkpoints/"
                          f"{branch[1]}/) when a launch resumed it from an earlier step; a resume continues the run's "
                          f"current branch only. Warm-start a new run from it: python -m training.export {checkpoint} "
                          "<folder>, then --model.init_from=<folder>")
    run_dir = run_folder_of(checkpoint)
    if run_dir is None and not is_readable(checkpoint):
        raise DDTreeError(f"--resume {resume}: {checkpoint} is not a readable checkpoint; give a .ckpt from a run's "
                          "checkpoints/ folder, a run folder or 'last'")
    if run_dir is None:
        raise DDTreeError(f"--resume {resume}: {checkpoint.resolve().parent.parent}/config.yaml is missing, "
                          "so the run cannot be resumed exactly")
    if not is_readable(checkpoint):
        raise unreadable_checkpoint(f"--resume {resume}", checkpoint, run_dir, "resume from an earlier one")
    return checkpoint, run_dir


def unreadable_checkpoint(given: str, checkpoint: Path, run_dir: Path, instead: str) -> DDTreeError:
    """The refusal of a run's checkpoint that cannot be read, naming the run's readable ones (newest first)."""
    others = [str(p) for p in run_checkpoints(run_dir) if p.resolve() != checkpoint.resolve() and is_readable(p)]
    fix = (f"{instead}: {', '.join(others)}" if others
           else f"the run {run_dir} has no other readable checkpoint; start it again")
    return DDTreeError(f"{given}: checkpoint {checkpoint} is unreadable ({why_unreadable(checkpoint)}); {fix}")
