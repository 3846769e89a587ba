"""Tests of finding and reading training checkpoints (training/checkpoint_paths.py, training/checkpoints.py).

    .venv/bin/pytest -q tests/training/test_checkpoints.py

The resolution rules run on run folders laid out as training/train.py writes them (.ckpt files
holding a stub dict, a DeepSpeed folder with its `latest` tag, best.ckpt as a link), with their save times set
by hand. The reading tests save one real checkpoint of a tiny DistillModule, as Lightning would.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import re
import shutil
import sys
import types
import zipfile
from pathlib import Path

import pytest
import torch
import yaml

import training.evaluate
import training.publish
from ddtree.errors import DDTreeError
from training.callbacks import AcceptanceEvaluation
from training.checkpoint_paths import (SAVING_MARKER, abandoned_branch, check_run_folder, configured_top_k,
                                       find_checkpoint, find_resume, find_run_checkpoint, newest_checkpoint,
                                       resume_point, run_folder_of, saved_step)
from training.checkpoints import (AtomicCheckpointIO, Checkpoint, after_a_refused_save, check_resumable,
                                  deepspeed_client_state, load_checkpoint, newest_finite_checkpoint,
                                  non_finite_tensors, recorded_evaluation)
from training.module import DistillModule


pytestmark = pytest.mark.usefixtures("undrawn_plots")  # tau.png drawn only where a test asks (drawn_plots)

REPO_ROOT = Path(__file__).resolve().parents[2]


def make_run(root: Path, name: str, saved: dict[str, float], best: str | None = None,
             steps: dict[str, int] | None = None) -> Path:
    """A run folder with config.yaml and checkpoints/<file> saved at the given times (seconds since the epoch), each
    at its step in `steps` (default 0)."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    for file, when in saved.items():
        path, state = run / file, {"global_step": (steps or {}).get(file, 0)}
        path.parent.mkdir(parents=True, exist_ok=True)  # checkpoints/abandoned-after-step-N/ (a resume's move_aside)
        if file.endswith("/"):  # a DeepSpeed checkpoint: a folder of shards named by its `latest` tag
            (path / "tag").mkdir(parents=True)
            torch.save(state, path / "tag" / "mp_rank_00_model_states.pt")  # Lightning's state beside rank 0's shard
            path = path / "latest"
            path.write_text("tag")
        else:
            torch.save(state, path)  # a zip archive like a real .ckpt, so it reads as one
        os.utime(path, (when, when))
    if best:
        (run / "checkpoints" / "best.ckpt").symlink_to(best)
    return run


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# ----------------------------------------------------------------------------- finding


def test_make_eval_takes_best_or_last_of_the_newest_run_that_has_it_or_a_path(tmp_path):
    root = tmp_path / "tiny"
    old = make_run(root, "old", {"checkpoints/step-step=2.ckpt": 100, "checkpoints/last.ckpt": 100},
                   best="step-step=2.ckpt")
    new = make_run(root, "new", {"checkpoints/last.ckpt/": 200})  # newer, DeepSpeed, no evaluation yet: no best
    assert find_checkpoint("last", root) == new / "checkpoints" / "last.ckpt"
    assert find_checkpoint("best", root) == old / "checkpoints" / "best.ckpt"
    assert find_checkpoint(str(new / "checkpoints" / "last.ckpt"), root) == new / "checkpoints" / "last.ckpt"

    with pytest.raises(DDTreeError, match=r"CKPT=best: no run under .* has checkpoints/best.ckpt; train one first"):
        find_checkpoint("best", tmp_path / "untrained")
    with pytest.raises(DDTreeError, match="CKPT=nope.ckpt: no such checkpoint file"):
        find_checkpoint("nope.ckpt", root)
    with pytest.raises(DDTreeError, match="no such checkpoint file"):  # a folder that is not a DeepSpeed checkpoint
        find_checkpoint(str(old / "checkpoints"), root)


def test_best_of_the_newest_run_when_runs_keep_no_last_checkpoint(tmp_path):
    """A run with `checkpoint.save_last: false` was dated 0.0 and lost to any older run that kept a last.ckpt."""
    root = tmp_path / "tiny"
    make_run(root, "20250101-120000", {"checkpoints/step-step=2.ckpt": 100, "checkpoints/last.ckpt": 100},
             best="step-step=2.ckpt")
    newer = make_run(root, "20250102-120000", {"checkpoints/step-step=2.ckpt": 200}, best="step-step=2.ckpt")
    newest = make_run(root, "20250103-120000", {"checkpoints/step-step=2.ckpt": 300}, best="step-step=2.ckpt")
    assert find_checkpoint("best", root) == newest / "checkpoints" / "best.ckpt"
    shutil.rmtree(newest)
    assert find_checkpoint("best", root) == newer / "checkpoints" / "best.ckpt"


def test_best_of_the_newest_run_linking_to_a_deleted_step_is_refused_not_an_older_runs_taken(tmp_path):
    """The newest run's best.ckpt links to a step file since deleted (disk cleaned up): `make eval CKPT=best` passed
    the run over and scored an older run's best.ckpt with no message."""
    root = tmp_path / "tiny"
    make_run(root, "old", {"checkpoints/step-step=2.ckpt": 100, "checkpoints/last.ckpt": 100}, best="step-step=2.ckpt")
    new = make_run(root, "new", {"checkpoints/step-step=4.ckpt": 200, "checkpoints/last.ckpt": 200},
                   best="step-step=4.ckpt")
    (new / "checkpoints" / "step-step=4.ckpt").unlink()
    best = new / "checkpoints" / "best.ckpt"
    with pytest.raises(DDTreeError) as error:
        find_checkpoint("best", root)
    assert str(error.value) == (f"CKPT=best: checkpoint {best} is unreadable (it links to step-step=4.ckpt, which is "
                                f"gone); give an earlier one as CKPT: {new / 'checkpoints' / 'last.ckpt'}")


def test_last_and_best_leave_out_ablate_variants_and_run_names_the_folder(tmp_path):
    """`make ablate` writes ordinary runs named ablate-<stamp>-<variant>; 'last' and 'best' took the newest variant."""
    root = tmp_path / "tiny"
    mine = make_run(root, "20261129-104249", {"checkpoints/step-step=2.ckpt": 100, "checkpoints/last.ckpt": 100},
                    best="step-step=2.ckpt")
    variant = make_run(root, "ablate-20261129-105834-foo", {"checkpoints/step-step=2.ckpt": 200,
                                                             "checkpoints/last.ckpt": 200}, best="step-step=2.ckpt")
    assert find_checkpoint("best", root) == mine / "checkpoints" / "best.ckpt"
    assert find_resume("last", root) == (mine / "checkpoints" / "last.ckpt", mine.resolve())
    # A variant is taken by name: RUN for make eval (as for make export), the folder for --resume.
    assert find_checkpoint("best", root, variant) == (variant / "checkpoints" / "step-step=2.ckpt").resolve()
    assert find_checkpoint("last", root, variant) == (variant / "checkpoints" / "last.ckpt").resolve()
    assert find_resume(str(variant), root)[1] == variant.resolve()
    with pytest.raises(DDTreeError, match=rf"CKPT={variant} is a run folder: give RUN={variant}"):
        find_checkpoint(str(variant), root)
    with pytest.raises(DDTreeError, match=r"RUN=.* is not a training run \(no config.yaml, no checkpoints/\)"):
        find_checkpoint("best", root, tmp_path)
    shutil.rmtree(mine)
    with pytest.raises(DDTreeError, match=rf"has checkpoints/last.ckpt \(1 `make ablate` variant run there is not "
                                          rf"counted; name one, e.g. {variant}\)"):
        find_resume("last", root)
    # of several, the newest variant is the example: the one a user who just ran `make ablate` most likely wants
    newer = make_run(root, "ablate-20261130-090000-bar", {"checkpoints/last.ckpt": 100})
    with pytest.raises(DDTreeError, match=rf"\(2 `make ablate` variant runs there are not counted; name one, e.g. "
                                          rf"{newer}\)"):
        find_resume("last", root)


def test_make_export_takes_best_last_or_a_path_of_one_run_and_says_which(tmp_path, monkeypatch):
    run = make_run(tmp_path, "r", {"checkpoints/step-step=2.ckpt": 100, "checkpoints/last.ckpt": 200},
                   best="step-step=2.ckpt")
    assert find_run_checkpoint(run, "best") == (run / "checkpoints" / "step-step=2.ckpt", "best -> step-step=2.ckpt")
    assert find_run_checkpoint(run, "last") == (run / "checkpoints" / "last.ckpt", "last")
    # a path relative to <run>/checkpoints, or to here
    assert find_run_checkpoint(run, "step-step=2.ckpt") == (run / "checkpoints" / "step-step=2.ckpt", "step-step=2.ckpt")
    monkeypatch.chdir(run)
    assert find_run_checkpoint(run, "checkpoints/last.ckpt")[0] == run / "checkpoints" / "last.ckpt"

    (run / "checkpoints" / "best.ckpt").unlink()
    with pytest.raises(DDTreeError, match=r"CKPT=best: .* does not exist \(runs trained before .*; use CKPT=last"):
        find_run_checkpoint(run, "best")
    with pytest.raises(DDTreeError, match="CKPT=nope.ckpt: no such checkpoint"):
        find_run_checkpoint(run, "nope.ckpt")
    # a step never saved (or pruned since) names the ones there are: "give best, last or a path" left the user to list
    # the folder for one
    with pytest.raises(DDTreeError, match=r"CKPT=step-step=7.ckpt: no such checkpoint \(looked in \. and .*\); give "
                                          r"best, last or a path \(the run's checkpoints, newest first: last.ckpt, "
                                          r"step-step=2.ckpt\)$"):
        find_run_checkpoint(run, "step-step=7.ckpt")
    # why a run lacks best.ckpt says nothing of a missing last.ckpt (checkpoint.save_last false): it sent the user
    # looking for an acceptance evaluation, with the path that would serve left unsaid
    (run / "checkpoints" / "last.ckpt").unlink()
    with pytest.raises(DDTreeError) as error:
        find_run_checkpoint(run, "last")
    assert str(error.value) == (f"CKPT=last: {run / 'checkpoints' / 'last.ckpt'} does not exist; use a path to a "
                                "checkpoint (the run's checkpoints, newest first: step-step=2.ckpt)")


def test_make_eval_of_a_run_that_saved_no_checkpoint_does_not_send_the_user_to_a_missing_last_ckpt(tmp_path):
    """A run whose loss went NaN at step 1 (a `make ablate` variant with a bad lr) saved no checkpoint: `make eval
    RUN=` said "use CKPT=last or a path", and CKPT=last was "last.ckpt does not exist" in turn."""
    run = make_run(tmp_path, "r", {})
    (run / "report.md").write_text("# Acceptance during training: r\n\n**No evaluation ran**: failed at step 1\n")
    for spec in ("best", "last"):
        with pytest.raises(DDTreeError) as error:
            find_run_checkpoint(run, spec)
        assert "CKPT=last" not in str(error.value).split("does not exist")[1], error.value
        assert str(error.value).endswith("the run saved no checkpoint at all: there is none to measure or export; "
                                         "train it again"), error.value
    # step checkpoints but no last.ckpt (checkpoint.save_last false): a path, not CKPT=last
    torch.save({"global_step": 2}, run / "checkpoints" / "step-step=2.ckpt")
    with pytest.raises(DDTreeError, match=r"does not exist \(.*\); use a path to a checkpoint \(the run's checkpoints, "
                                          r"newest first: step-step=2.ckpt\)$"):
        find_run_checkpoint(run, "best")


def test_make_export_of_a_best_ckpt_linking_to_a_deleted_step_says_so_not_that_the_save_failed(tmp_path):
    """best.ckpt left linking to a step file the user deleted was explained as a save that failed or was cut short."""
    run = make_run(tmp_path, "r", {"checkpoints/step-step=4.ckpt": 100, "checkpoints/last.ckpt": 200},
                   best="step-step=4.ckpt")
    (run / "eval").mkdir()
    (run / "eval" / "step-000004.json").write_text("{}\n")
    (run / "checkpoints" / "step-step=4.ckpt").unlink()
    with pytest.raises(DDTreeError) as error:
        find_run_checkpoint(run, "best")
    assert str(error.value) == (f"CKPT=best: {run / 'checkpoints' / 'best.ckpt'} does not exist (it links to "
                                "step-step=4.ckpt, which is gone: deleted or moved since the run ranked it); use "
                                "CKPT=last or a path")


def test_a_drafter_folder_given_as_ckpt_or_resume_is_named_as_such_not_missing(tmp_path):
    """A run's drafter/ (what `ddtree` decodes with) given to make eval CKPT= or --resume was "no such checkpoint":
    the folder is there, and the user went looking for a typo."""
    run = make_run(tmp_path, "r", {"checkpoints/last.ckpt": 100})
    drafter = run / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}\n")
    with pytest.raises(DDTreeError) as error:
        find_checkpoint(str(drafter), tmp_path)
    assert str(error.value) == (f"CKPT={drafter} is an exported drafter folder, not a training checkpoint; give a "
                                ".ckpt of its run, 'best' or 'last' (`ddtree bench --drafter` measures a drafter "
                                "folder)")
    with pytest.raises(DDTreeError) as error:
        find_resume(str(drafter), tmp_path)
    assert str(error.value) == (f"--resume {drafter} is an exported drafter folder, not a training checkpoint; give a "
                                ".ckpt of its run, its run folder or 'last'")


def test_a_checkpoint_given_as_run_or_a_run_folder_given_as_ckpt_is_named_as_such(tmp_path):
    """Each was refused as what it is not: a checkpoint as "no such run folder", a run folder as "a folder but not a
    DeepSpeed checkpoint (no 'latest' file in it)"."""
    run = make_run(tmp_path, "r", {"checkpoints/step-2.ckpt": 100, "checkpoints/deepspeed.ckpt/": 200,
                                   "checkpoints/last.ckpt": 300}, best="step-2.ckpt")  # named: best over last
    other = make_run(tmp_path, "other", {"checkpoints/last.ckpt": 100})
    best = run / "checkpoints" / "best.ckpt"
    with pytest.raises(DDTreeError, match=rf"^RUN={best} is a checkpoint file, not a run folder; give its run folder "
                                          rf"as RUN and the checkpoint as CKPT: RUN={run.resolve()} CKPT={best}$"):
        check_run_folder(best)
    deepspeed = run / "checkpoints" / "deepspeed.ckpt"
    with pytest.raises(DDTreeError, match=rf"^RUN={deepspeed} is a DeepSpeed checkpoint folder, not a run folder"):
        check_run_folder(deepspeed)
    loose = tmp_path / "loose.ckpt"
    shutil.copyfile(best, loose)
    with pytest.raises(DDTreeError, match=rf"RUN=<the run folder it was trained in> CKPT={loose}$"):
        find_checkpoint("best", tmp_path, loose)  # make eval RUN=<a checkpoint>
    with pytest.raises(DDTreeError, match=rf"^RUN={run / 'config.yaml'} is a file, not a run folder"):
        check_run_folder(run / "config.yaml")

    with pytest.raises(DDTreeError, match=rf"^CKPT={other} is a run folder: give RUN={other} \(its best.ckpt"):
        find_run_checkpoint(run, str(other))  # make export RUN=r CKPT=<another run folder>
    with pytest.raises(DDTreeError, match=rf"^CKPT={run} is RUN's own folder, not a checkpoint; give best, last"):
        find_run_checkpoint(run, str(run))
    with pytest.raises(DDTreeError, match=rf"^CKPT {run} is a run folder, not a checkpoint: give one of its "
                                          rf"checkpoints, {best} \(or RUN={run} with make export\)$"):
        load_checkpoint(run)  # python -m training.export <run folder> OUT
    with pytest.raises(DDTreeError, match=rf"give one of its checkpoints, {other / 'checkpoints' / 'last.ckpt'} "):
        load_checkpoint(other)  # no best.ckpt: its last


def test_a_run_folder_with_its_config_yaml_or_its_checkpoints_alone_is_a_run_folder(tmp_path):
    """A run stopped before its first save holds config.yaml alone, a run's checkpoints/ copied out holds no
    config.yaml: each is a run folder `make eval` and `make export` take (and then say what it lacks), never "not a
    training run". A folder with neither is refused."""
    started = tmp_path / "started"
    started.mkdir()
    (started / "config.yaml").write_text("{}\n")
    copied = make_run(tmp_path, "copied", {"checkpoints/last.ckpt": 100})
    (copied / "config.yaml").unlink()
    for run in (started, copied):
        check_run_folder(run)
    with pytest.raises(DDTreeError, match=rf"^RUN={tmp_path} is not a training run \(no config.yaml, no "
                                          r"checkpoints/\)"):
        check_run_folder(tmp_path)


def test_resume_takes_last_a_run_folder_or_a_path_and_finds_its_run(tmp_path):
    root = tmp_path / "tiny"
    make_run(root, "old", {"checkpoints/last.ckpt": 100})
    requeued = make_run(root, "slurm-7", {"checkpoints/last.ckpt/": 200, "hpc_ckpt_1.ckpt": 300})
    assert find_resume("last", root) == (requeued / "checkpoints" / "last.ckpt", requeued.resolve())
    # a run folder: its newest checkpoint, here the one Lightning saved on SLURM's requeue signal
    assert find_resume(str(requeued), root) == (requeued / "hpc_ckpt_1.ckpt", requeued.resolve())
    path = root / "old" / "checkpoints" / "last.ckpt"
    assert find_resume(str(path), root) == (path, (root / "old").resolve())

    with pytest.raises(DDTreeError, match="--resume last: no run under .* has checkpoints/last.ckpt"):
        find_resume("last", tmp_path / "untrained")
    with pytest.raises(DDTreeError, match="--resume nope.ckpt: no such checkpoint; give a .ckpt path, a run folder"):
        find_resume("nope.ckpt", root)
    empty = make_run(root, "empty", {})
    with pytest.raises(DDTreeError, match="the run has no checkpoint yet"):
        find_resume(str(empty), root)
    # checkpoint.save_last false: its step checkpoints are all it keeps, and its folder is refused to a new run
    stepped = make_run(root, "stepped", {"checkpoints/step-2.ckpt": 100, "checkpoints/step-4.ckpt": 200})
    assert find_resume(str(stepped), root) == (stepped / "checkpoints" / "step-4.ckpt", stepped.resolve())
    # A copied folder's files carry their copy times: last.ckpt still leads, written with every step checkpoint.
    copied = make_run(root, "copied", {"checkpoints/last.ckpt": 100, "checkpoints/step-8.ckpt": 200})
    assert find_resume(str(copied), root) == (copied / "checkpoints" / "last.ckpt", copied.resolve())
    cut = make_run(root, "cut", {})
    (cut / "checkpoints" / "step-2.ckpt").mkdir()  # a DeepSpeed folder whose first save never finished
    with pytest.raises(DDTreeError, match=r"no whole checkpoint: step-2.ckpt in checkpoints/ is a save cut short"):
        find_resume(str(cut), root)
    stray = tmp_path / "elsewhere" / "x.ckpt"
    stray.parent.mkdir()
    stray.write_text("")
    with pytest.raises(DDTreeError, match=r"x.ckpt is not a readable checkpoint; give a .ckpt from a run's checkpoints/"):
        find_resume(str(stray), root)  # a file that is no checkpoint (a prompts file, say) is named as such
    torch.save({"state_dict": {}}, stray)
    with pytest.raises(DDTreeError, match="config.yaml is missing, so the run cannot be resumed exactly"):
        find_resume(str(stray), root)


def test_a_checkpoint_of_an_abandoned_branch_is_refused_to_resume_with_how_to_train_on_from_it(tmp_path):
    """A resume from step N moved the later checkpoints to checkpoints/abandoned-after-step-N/: resuming one of those
    restored a ranking whose step files are now the current branch's (it was refused for a config.yaml "missing"
    beside checkpoints/)."""
    run = make_run(tmp_path / "tiny", "r", {"checkpoints/last.ckpt": 100, "checkpoints/abandoned-after-step-2/"
                                                                            "step-6.ckpt": 50})
    branch = run / "checkpoints" / "abandoned-after-step-2" / "step-6.ckpt"
    with pytest.raises(DDTreeError, match=rf"^--resume {branch}: a checkpoint of the branch the run {run} left "
                                          r"\(checkpoints/abandoned-after-step-2/\) .* Warm-start a new run from it: "
                                          rf"python -m training.export {branch} <folder>, then --model.init_from="):
        find_resume(str(branch), tmp_path / "tiny")
    assert run_folder_of(branch) == run.resolve()  # its config and corpus are its run's


def test_a_copied_run_resumes_from_its_highest_step_whatever_the_file_times(tmp_path):
    """`cp -r` gives each file its copy time: a requeue's older hpc_ckpt_1.ckpt, copied after last.ckpt, was taken as
    the newest, and the resume went back 4 steps and overwrote the later checkpoints."""
    root = tmp_path / "tiny"
    copied = make_run(root, "copied", {"checkpoints/last.ckpt": 100, "hpc_ckpt_1.ckpt": 200},
                      steps={"checkpoints/last.ckpt": 12, "hpc_ckpt_1.ckpt": 8})
    assert resume_point(copied) == (copied / "checkpoints" / "last.ckpt", None)
    deepspeed = make_run(root, "deepspeed", {"checkpoints/last.ckpt/": 100, "hpc_ckpt_1.ckpt/": 200},
                         steps={"checkpoints/last.ckpt/": 12, "hpc_ckpt_1.ckpt/": 8})
    assert newest_checkpoint(deepspeed) == deepspeed / "checkpoints" / "last.ckpt"
    stepped = make_run(root, "stepped", {"checkpoints/step-4.ckpt": 100, "checkpoints/step-2.ckpt": 200},
                       steps={"checkpoints/step-4.ckpt": 4, "checkpoints/step-2.ckpt": 2})  # save_last false
    assert newest_checkpoint(stepped) == stepped / "checkpoints" / "step-4.ckpt"
    requeued = make_run(root, "requeued", {"checkpoints/last.ckpt": 100, "hpc_ckpt_1.ckpt": 200},
                        steps={"checkpoints/last.ckpt": 12, "hpc_ckpt_1.ckpt": 12})  # the signal came at step 12
    assert newest_checkpoint(requeued) == requeued / "hpc_ckpt_1.ckpt"  # equal steps: the newer file


def test_an_empty_resume_or_a_file_that_is_no_checkpoint_is_named_as_such(tmp_path, capsys):
    """`--resume "$CKPT"` with CKPT unset began a new run (a 3 GB feature-store build); `--resume <run>/config.yaml`
    was called "unreadable (truncated?)", as if a checkpoint had been cut off."""
    root = tmp_path / "tiny"
    run = make_run(root, "r", {"checkpoints/last.ckpt": 100})
    with pytest.raises(DDTreeError, match=r"^--resume is empty \(an unset shell variable\?\); give 'last', a run folder"):
        find_resume("", root)
    with pytest.raises(DDTreeError, match=r"^--resume is empty"):  # `--resume " $CKPT"`, quoted with a space
        find_resume("  ", root)
    with pytest.raises(DDTreeError) as error:
        find_resume(str(run / "config.yaml"), root)
    assert str(error.value) == (f"--resume {run / 'config.yaml'} is not a checkpoint (not a file torch.save wrote); "
                                f"give its run folder {run.resolve()} (its newest checkpoint), a .ckpt path or 'last'")
    from training.train import main as train_main

    assert train_main(["--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--resume", ""]) == 2
    assert one_error_line(capsys).startswith("error: --resume is empty")
    assert not (tmp_path / "out").exists()  # no new run


def test_a_checkpoint_this_user_cannot_read_is_called_unreadable_not_a_file_of_another_kind(tmp_path, monkeypatch):
    """A .ckpt whose permissions keep this user out (simulated: root reads anything): is_other_file cannot look
    inside, so it is not called "not a file torch.save wrote", which it may well be; the readability check names it."""
    stray = tmp_path / "elsewhere" / "x.ckpt"
    stray.parent.mkdir()
    torch.save({"state_dict": {}}, stray)
    real_open = builtins.open

    def permission_denied(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file) == stray:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", permission_denied)
    monkeypatch.setattr(io, "open", permission_denied)  # zipfile's
    with pytest.raises(DDTreeError) as error:
        find_resume(str(stray), tmp_path / "tiny")
    assert str(error.value) == (f"--resume {stray}: {stray} is not a readable checkpoint; give a .ckpt from a run's "
                                "checkpoints/ folder, a run folder or 'last'")


def truncate(path: Path) -> None:
    saved = path.stat().st_mtime  # when it was saved: the order of a run's checkpoints stays
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # cut off mid-write
    os.utime(path, (saved, saved))


def test_resume_refuses_a_truncated_checkpoint_and_names_the_readable_ones_newest_first(tmp_path):
    root = tmp_path / "tiny"
    run = make_run(root, "r", {"checkpoints/step-2.ckpt": 100, "checkpoints/step-4.ckpt": 200,
                               "checkpoints/step-6.ckpt": 300, "checkpoints/last.ckpt": 400}, best="step-4.ckpt")
    last, checkpoints = run / "checkpoints" / "last.ckpt", run.resolve() / "checkpoints"
    truncate(last)
    truncate(run / "checkpoints" / "step-6.ckpt")  # unreadable too: not offered
    for resume in ("last", str(last)):  # named: refused; the run folder takes its newest readable one (below)
        with pytest.raises(DDTreeError) as error:
            find_resume(resume, root)
        assert str(error.value) == (
            f"--resume {resume}: checkpoint {last} is unreadable (truncated?); "
            f"resume from an earlier one: {checkpoints / 'step-4.ckpt'}, {checkpoints / 'step-2.ckpt'}"
        )
    assert find_resume(str(run), root) == (run / "checkpoints" / "step-4.ckpt", run.resolve())
    alone = make_run(root, "alone", {"checkpoints/last.ckpt": 500})
    truncate(alone / "checkpoints" / "last.ckpt")
    with pytest.raises(DDTreeError, match=r"is unreadable \(truncated\?\); the run .*alone has no other readable checkpoint; start it again"):
        find_resume(str(alone), root)


def test_a_deepspeed_folder_whose_save_was_cut_short_is_refused_and_the_earlier_ones_named(tmp_path):
    """DeepSpeed rewrites a checkpoint folder's files in place: a save killed midway left shards of two steps, which
    resumed with a traceback (a half-written shard) or silently from the older optimizer state (one not yet
    reached). Its strategy keeps a marker in the folder while it saves (below)."""

    root = tmp_path / "tiny"
    run = make_run(root, "ds", {"checkpoints/step-2.ckpt/": 100, "checkpoints/last.ckpt/": 200})
    last = run / "checkpoints" / "last.ckpt"
    (last / SAVING_MARKER).write_text("a save began\n")
    with pytest.raises(DDTreeError) as error:
        find_resume(str(last), root)
    assert str(error.value) == (f"--resume {last}: checkpoint {last} is unreadable (its save was cut short); "
                                f"resume from an earlier one: {run.resolve() / 'checkpoints' / 'step-2.ckpt'}")
    with pytest.raises(DDTreeError, match="its last save was cut short .* give an earlier checkpoint of the run"):
        load_checkpoint(last)  # make eval and make export read it too


def test_last_of_a_newer_run_whose_first_deepspeed_last_save_was_cut_short_is_refused_not_an_older_run(tmp_path):
    """A run's first DeepSpeed last.ckpt/ save, killed midway, left the folder with its `saving` marker and no `latest`
    yet: 'last' passed the run over, and `--resume last` continued (`make eval CKPT=last` scored) an older run with
    no message."""
    root = tmp_path / "tiny"
    older = make_run(root, "A-older", {"checkpoints/last.ckpt": 100})
    newer = make_run(root, "B-newer", {"checkpoints/step-2.ckpt/": 200})
    last = newer / "checkpoints" / "last.ckpt"
    last.mkdir()
    (last / SAVING_MARKER).write_text("a save began\n")
    step = newer.resolve() / "checkpoints" / "step-2.ckpt"
    with pytest.raises(DDTreeError) as error:
        find_resume("last", root)
    assert str(error.value) == (f"--resume last: checkpoint {last} is unreadable (its save was cut short); "
                                f"resume from an earlier one: {step}")
    with pytest.raises(DDTreeError) as error:
        find_checkpoint("last", root)
    assert str(error.value) == (f"CKPT=last: checkpoint {last} is unreadable (its save was cut short); "
                                f"give an earlier one as CKPT: {step}")
    shutil.rmtree(step)  # no whole checkpoint left: the run is still the newest, dated by its marker
    with pytest.raises(DDTreeError, match=rf"checkpoint {last} is unreadable .* the run .*B-newer has no other "
                                          "readable checkpoint; start it again"):
        find_resume("last", root)
    with pytest.raises(DDTreeError, match=rf"CKPT=last: checkpoint {last} is unreadable"):
        find_checkpoint("last", root)
    shutil.rmtree(newer)
    assert find_resume("last", root) == (older / "checkpoints" / "last.ckpt", older.resolve())


def test_a_requeued_job_resumes_its_run_folder_from_the_newest_readable_checkpoint(tmp_path):
    """slurm.sbatch resumes a requeued job with --resume <run folder>: a last.ckpt whose save the kill cut short
    refused that resume, so every requeue failed while a whole step checkpoint was there."""
    root = tmp_path / "tiny"
    run = make_run(root, "slurm-77", {"checkpoints/step-200.ckpt/": 100, "checkpoints/last.ckpt/": 100,
                                      "hpc_ckpt_1.ckpt": 50})  # an older requeue's: not before step 200
    last, step = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "step-200.ckpt"
    assert newest_checkpoint(run) == last and resume_point(run) == (last, None)  # whole: last.ckpt first, as before
    (last / SAVING_MARKER).write_text("a save began\n")  # the step-300 save, killed midway
    assert newest_checkpoint(run) == step
    assert resume_point(run) == (step, last)  # training/train.py prints that last.ckpt was passed over
    assert find_resume(str(run), root) == (step, run.resolve())
    (step / SAVING_MARKER).write_text("a save began\n")
    assert newest_checkpoint(run) == run / "hpc_ckpt_1.ckpt"
    (run / "hpc_ckpt_1.ckpt").write_bytes(b"PK cut")
    with pytest.raises(DDTreeError, match="has no other readable checkpoint; start it again"):
        find_resume(str(run), root)  # none readable: refused, naming the newest


def test_the_deepspeed_strategy_marks_a_checkpoint_folder_until_every_rank_has_saved(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from training.strategies import DrafterDeepSpeed

    seen, events = [], []
    monkeypatch.setattr(DrafterDeepSpeed, "is_global_zero", True)
    monkeypatch.setattr(DrafterDeepSpeed, "barrier", lambda self, name=None: events.append(name))

    def save(self, checkpoint, filepath, storage_options=None):  # DeepSpeed's engine writes the shards here
        seen.append((Path(filepath) / SAVING_MARKER).is_file())
        if checkpoint.get("fail"):
            raise OSError("No space left on device")

    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", save)
    strategy = object.__new__(DrafterDeepSpeed)  # no engine: only the save's order is under test
    strategy.save_checkpoint({}, tmp_path / "last.ckpt")
    assert seen == [True] and not (tmp_path / "last.ckpt" / SAVING_MARKER).exists()
    assert events == ["drafter_deepspeed_save_begins", "drafter_deepspeed_save_ends"]
    with pytest.raises(OSError):
        strategy.save_checkpoint({"fail": True}, tmp_path / "step-4.ckpt")
    assert (tmp_path / "step-4.ckpt" / SAVING_MARKER).is_file()  # left: the folder is refused on resume


def test_a_save_killed_midway_leaves_a_staging_file_the_next_start_removes(tmp_path, monkeypatch):
    # A kill (SIGKILL, OOM) mid-save leaves the staging file: its name must be one remove_stale_staging deletes, and
    # must not hold `hpc_ckpt_`, from which Lightning numbers the next SLURM save.
    staged, real_save = [], torch.save

    def save_and_look(obj, handle):
        staged.extend(tmp_path.iterdir())
        real_save(obj, handle)

    monkeypatch.setattr(torch, "save", save_and_look)
    AtomicCheckpointIO().save_checkpoint({"global_step": 3}, tmp_path / "hpc_ckpt_3.ckpt")
    (staging,) = staged
    assert AtomicCheckpointIO.is_staging(staging) and "hpc_ckpt_" not in staging.name
    staging.write_bytes(b"half")  # what the kill leaves
    assert AtomicCheckpointIO.remove_stale_staging(tmp_path) == [staging]
    assert [path.name for path in tmp_path.iterdir()] == ["hpc_ckpt_3.ckpt"]


def test_a_refused_save_outside_a_run_folder_calls_only_a_readable_neighbour_whole(tmp_path):
    torch.save({"global_step": 2, "weights": torch.zeros(1000)}, tmp_path / "step-2.ckpt")
    assert after_a_refused_save(tmp_path / "step-4.ckpt").startswith("the previous checkpoints are whole")
    truncate(tmp_path / "step-2.ckpt")  # a resume from it would fail
    assert after_a_refused_save(tmp_path / "step-4.ckpt").startswith("the run holds no checkpoint yet")


def test_a_refused_evaluation_write_in_a_run_with_a_checkpoint_says_resume_not_start_again(tmp_path):
    """An evaluation (<run>/eval/step-N.json) lies beside no checkpoint: only its run folder's checkpoints tell whether
    the run can resume. Looking beside the file alone told a run with a whole last.ckpt to start again from nothing."""
    run = make_run(tmp_path, "r", {"checkpoints/last.ckpt": 100}, steps={"checkpoints/last.ckpt": 4})
    assert after_a_refused_save(run / "eval" / "step-000006.json").startswith("the previous checkpoints are whole")


def test_a_refused_save_in_a_run_with_a_whole_checkpoint_says_to_resume_it_not_to_start_again(tmp_path):
    """The remedy is what the user runs next: "start it again" there would train from step 0 and drop the steps the
    whole checkpoint holds, so the line must name --resume of the run folder."""
    run = make_run(tmp_path, "r", {"checkpoints/last.ckpt": 100}, steps={"checkpoints/last.ckpt": 4})
    line = after_a_refused_save(run / "checkpoints" / "step-000006.ckpt")
    assert line.endswith("make room and resume the run (--resume <run folder>)") and "start it again" not in line


def test_a_remote_checkpoint_path_is_saved_remotely_not_into_a_local_folder(tmp_path, monkeypatch):
    import fsspec

    monkeypatch.chdir(tmp_path)  # where a local writer would make the folder "memory:"
    remote = fsspec.filesystem("memory")  # fsspec's in-process store, as s3:// would be a bucket
    try:
        AtomicCheckpointIO().save_checkpoint({"global_step": 1}, "memory://bucket/run/last.ckpt")
        assert remote.exists("/bucket/run/last.ckpt")
    finally:
        if remote.exists("/bucket"):  # the store outlives the test
            remote.rm("/bucket", recursive=True)
    assert list(tmp_path.iterdir()) == []


def test_train_resume_from_a_truncated_last_ckpt_is_one_error_line_and_status_2(tmp_path, capsys):
    from test_reliability import tiny_args

    from training.train import main as train_main

    assert train_main(tiny_args(tmp_path, "cut", max_steps=4)) == 0
    checkpoints = tmp_path / "out" / "tiny" / "cut" / "checkpoints"
    truncate(checkpoints / "last.ckpt")
    capsys.readouterr()
    resume = ["--recipe", "tiny", "--output-root", str(tmp_path / "out"), "--resume", str(checkpoints / "last.ckpt")]
    assert train_main(resume) == 2
    line = one_error_line(capsys)
    kept = [path.name for path in checkpoints.glob("step-*.ckpt")]  # the top 1 (steps 2 and 4 tie here: the later)
    assert kept == ["step-4.ckpt"]
    assert line == (f"error: --resume {checkpoints / 'last.ckpt'}: checkpoint {checkpoints / 'last.ckpt'} is unreadable "
                    f"(truncated?); resume from an earlier one: {checkpoints.resolve() / 'step-4.ckpt'}")
    # Its run folder (as a requeued SLURM job resumes) takes that one, and says why
    assert train_main([*resume[:-1], str(checkpoints.parent)]) == 0
    assert (f"[train] {checkpoints / 'last.ckpt'} is unreadable (truncated?): resuming from "
            f"{checkpoints / 'step-4.ckpt'}, the run's newest readable checkpoint") in capsys.readouterr().out


def test_a_deepspeed_folders_client_state_is_read_without_deepspeed_or_is_one_line(tmp_path):
    # What a DeepSpeed resume is checked against before DeepSpeed loads the shards (training/train.py; the launch
    # itself is tests/training/test_deepspeed.py's slow test): Lightning's dict, saved in the tag's first model state.
    folder = tmp_path / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint\n")
    client_state = {"drafter_config": {"block_size": 8}, "hyper_parameters": {"lora_rank": 0}, "global_step": 2,
                    "module": {"drafter.fc.weight": torch.ones(3, 2)}}
    torch.save(client_state, folder / "checkpoint" / "mp_rank_00_model_states.pt")
    read = deepspeed_client_state(folder)
    assert read["drafter_config"] == {"block_size": 8} and read["global_step"] == 2
    assert torch.equal(read["module"]["drafter.fc.weight"], torch.ones(3, 2))
    truncate(folder / "checkpoint" / "mp_rank_00_model_states.pt")
    with pytest.raises(DDTreeError, match=r"^CKPT .*last.ckpt: cannot read checkpoint/mp_rank_00_model_states.pt \("):
        deepspeed_client_state(folder)


def test_a_zero3_folders_step_and_client_state_are_read_from_rank_0s_model_states(tmp_path):
    # ZeRO-3 names each rank's model-state file zero_pp_rank_<r>_mp_rank_00_model_states.pt: read as ZeRO-2's
    # mp_rank_00_model_states.pt only, every ZeRO-3 resume stopped at once and its checkpoints ranked at step -1.
    folder = tmp_path / "last.ckpt"
    (folder / "checkpoint").mkdir(parents=True)
    (folder / "latest").write_text("checkpoint")
    client_state = {"global_step": 7, "drafter_config": {"block_size": 8}, "hyper_parameters": {"lora_rank": 0},
                    "module": {"drafter.fc.weight": torch.empty(0)}}  # ZeRO-3: the weights are in the optimizer shards
    torch.save(client_state, folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    torch.save({"global_step": 7}, folder / "checkpoint" / "zero_pp_rank_1_mp_rank_00_model_states.pt")
    assert saved_step(folder) == 7
    read = deepspeed_client_state(folder)
    assert read["global_step"] == 7 and read["drafter_config"] == {"block_size": 8}
    (folder / "checkpoint" / "zero_pp_rank_0_mp_rank_00_model_states.pt").unlink()  # rank 0's is missing
    assert saved_step(folder) == -1
    with pytest.raises(DDTreeError, match=r"^CKPT .*last.ckpt: checkpoint/ holds neither mp_rank_00_model_states.pt nor "
                       r"zero_pp_rank_0_mp_rank_00_model_states.pt \(it holds zero_pp_rank_1_mp_rank_00_model_states.pt\)"):
        deepspeed_client_state(folder)


# ----------------------------------------------------------------------------- reading


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(path, module): a real checkpoint of a tiny DistillModule at step 7, in a run folder."""
    torch.manual_seed(0)
    module = DistillModule(target="tiny-random", num_layers=1, block_size=4, target_layer_ids=[0, 2, 4],
                           target_dtype="float32")
    module.configure_model()
    history = [{"step": 7, "summary": {}, "seconds": 1.0}]
    # epoch as Lightning writes it beside global_step: a step read from it would be another number
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 7,
                  "epoch": 0, "callbacks": {"AcceptanceEvaluation": {"history": history}}}
    module.on_save_checkpoint(checkpoint)
    run = tmp_path_factory.mktemp("run")
    (run / "checkpoints").mkdir()
    path = run / "checkpoints" / "last.ckpt"
    torch.save(checkpoint, path)
    return path, module


@pytest.fixture
def loads(monkeypatch):
    """The paths torch.load is called with, in order."""
    calls = []
    real_load = torch.load

    def counting_load(f, *args, **kwargs):
        calls.append(Path(f) if isinstance(f, (str, Path)) else f)
        return real_load(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", counting_load)
    return calls


def test_a_checkpoint_is_read_once_into_its_drafter_step_and_settings(saved, loads):
    path, module = saved
    checkpoint = load_checkpoint(path)
    assert loads == [path]
    assert checkpoint.step == 7 and checkpoint.hyper_parameters["target"] == "tiny-random"
    assert checkpoint.callbacks["AcceptanceEvaluation"]["history"][0]["step"] == 7
    expected = module.drafter.state_dict()
    found = checkpoint.drafter.state_dict()
    assert found.keys() == expected.keys()
    assert all(torch.equal(found[key], expected[key]) for key in expected)


def test_make_export_reads_the_checkpoint_once(saved, loads, tmp_path):
    path, _ = saved
    assert training.publish.main([str(path.parent.parent), "--out", str(tmp_path / "export"), "--ckpt", "last"]) == 0
    assert loads.count(path) == 1
    assert (tmp_path / "export" / "model.safetensors").is_file()


@pytest.mark.parametrize("file_order", [["step-2", "step-4", "step-6", "last"],  # the order the run saved them in
                                        ["step-4", "step-2", "step-6", "last"]])  # a copy's (cp -r, scp -r, rsync)
def test_the_newest_finite_checkpoint_is_the_highest_finite_step_whatever_the_file_times(saved, tmp_path, file_order):
    """After a divergence the error line says `make train RESUME=<it>`: in a copied run folder, ordered by file time,
    it named step-2 over step-4 and the user threw two steps away."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    checkpoint = torch.load(saved[0], weights_only=False)
    for name, step in [("step-2", 2), ("step-4", 4), ("step-6", 6), ("last", 6)]:
        diverged = step == 6  # the update of step 6 blew the weights up
        state = {key: torch.full_like(value, float("nan")) if diverged and value.is_floating_point() else value
                 for key, value in checkpoint["state_dict"].items()}
        torch.save({**checkpoint, "state_dict": state, "global_step": step}, run / "checkpoints" / f"{name}.ckpt")
    for when, name in enumerate(file_order):
        os.utime(run / "checkpoints" / f"{name}.ckpt", (1000 + when, 1000 + when))
    assert newest_finite_checkpoint(run) == run / "checkpoints" / "step-4.ckpt"


def test_a_half_precision_drafter_of_large_finite_weights_is_not_taken_for_diverged():
    """Summed in float16, 90,000 weights of 1.0 overflow to inf: a float16 checkpoint would be refused as diverged."""
    layer = torch.nn.Linear(300, 300, bias=False).half()
    torch.nn.init.ones_(layer.weight)
    assert non_finite_tensors(layer) == 0
    layer.weight.data[0, 0] = float("nan")
    assert non_finite_tensors(layer) == 1


def test_a_folder_that_is_no_deepspeed_checkpoint_is_named_as_such_before_any_consolidation(tmp_path):
    """Consolidating it would fail on its missing shards with DeepSpeed's message, which names no 'latest' file."""
    folder = tmp_path / "copied.ckpt"
    (folder / "checkpoint").mkdir(parents=True)  # a DeepSpeed folder copied without its `latest` tag
    with pytest.raises(DDTreeError, match=rf"^CKPT {folder} is a folder but not a DeepSpeed checkpoint \(no 'latest'"):
        load_checkpoint(folder)


def test_a_checkpoint_path_that_does_not_exist_says_where_checkpoints_are(tmp_path):
    """`python -m training.export <mistyped>.ckpt OUT`: one line: no such checkpoint, and where to look."""
    missing = tmp_path / "run" / "checkpoints" / "bset.ckpt"
    with pytest.raises(DDTreeError, match=rf"^CKPT {re.escape(str(missing))}: no such checkpoint; give a .ckpt file "
                                          r"from outputs/<recipe>/<run>/checkpoints"):
        load_checkpoint(missing)


def test_the_recorded_evaluation_is_the_one_of_the_checkpoints_own_step():
    """`make eval` prints it as the logged tau and publish checks a bench reproduces it: another step's row would be
    taken for this checkpoint's, and a step never evaluated would get one."""
    rows = [{"step": 4, "summary": {"tau": 1.9}}, {"step": 8, "summary": {"tau": 2.6}}]
    callbacks = {"AcceptanceEvaluation": {"history": rows}}
    assert recorded_evaluation(Checkpoint(Path("step-8.ckpt"), None, 8, {}, callbacks)) == rows[1]
    assert recorded_evaluation(Checkpoint(Path("step-6.ckpt"), None, 6, {}, callbacks)) is None


# Named here, not taken from RESUME_KEYS: a key dropped from it would drop its case too.
@pytest.mark.parametrize("lacking",
                         ["pytorch-lightning_version", "global_step", "loops", "state_dict", "drafter_config"])
def test_a_checkpoint_lacking_any_one_key_a_resume_needs_is_refused_naming_it(saved, tmp_path, lacking):
    """Another project's Lightning checkpoint lacks only drafter_config: let through, Lightning's resume stopped on a
    KeyError traceback."""
    checkpoint = torch.load(saved[0], weights_only=False)
    checkpoint.update({"pytorch-lightning_version": "2.4.0", "loops": {}})  # as Lightning's trainer saves them
    path = tmp_path / "other-project.ckpt"
    torch.save({key: value for key, value in checkpoint.items() if key != lacking}, path)
    with pytest.raises(DDTreeError, match=rf"--resume {re.escape(str(path))} is not a training checkpoint of this "
                                          rf"project \(it has no {lacking}\): give a run's last.ckpt"):
        check_resumable(path)


def test_a_file_torch_saved_that_is_not_a_dict_is_refused_to_resume_naming_every_key(tmp_path):
    """A tensor or a list saved with torch.save has none of a checkpoint's keys: let through, Lightning's resume stopped
    on a traceback."""
    path = tmp_path / "weights.ckpt"
    torch.save([torch.zeros(2)], path)
    with pytest.raises(DDTreeError, match=rf"--resume {re.escape(str(path))} is not a training checkpoint of this "
                                          r"project \(it has no pytorch-lightning_version, global_step, loops, "
                                          r"state_dict, drafter_config\)"):
        check_resumable(path)


def test_a_checkpoint_pickling_a_class_this_environment_lacks_is_refused_to_resume_in_one_line(tmp_path, monkeypatch):
    """Another project's checkpoint may pickle its own classes (its hyperparameters' config object, say): torch.load
    stops on a ModuleNotFoundError, not a RuntimeError, and that must be the one line too, not a traceback."""
    other_project = types.ModuleType("other_project")

    class Settings:
        pass

    Settings.__module__, Settings.__qualname__ = "other_project", "Settings"
    other_project.Settings = Settings
    monkeypatch.setitem(sys.modules, "other_project", other_project)
    path = tmp_path / "other-project.ckpt"
    torch.save({"hyper_parameters": Settings()}, path)
    monkeypatch.delitem(sys.modules, "other_project")  # the other project is not installed here
    with pytest.raises(DDTreeError, match=rf"^--resume {re.escape(str(path))} is not a PyTorch checkpoint "
                                          r"\(ModuleNotFoundError: No module named 'other_project'\); give a run's"):
        check_resumable(path)


def refused_line(command: str, run: Path, tmp_path: Path, capsys) -> str:
    """`make eval` or `make export` of <run>/checkpoints/last.ckpt: exit status 2 and nothing written; its error line."""
    if command == "eval":
        status = training.evaluate.main(["--recipe", "tiny", "--ckpt", str(run / "checkpoints" / "last.ckpt")])
    else:
        status = training.publish.main([str(run), "--out", str(tmp_path / "export"), "--ckpt", "last"])
    assert status == 2
    assert not (tmp_path / "export").exists() and not (run / "eval").exists()
    return one_error_line(capsys)


def edited_run(path: Path, tmp_path: Path, edit) -> tuple[Path, Path]:
    """A run folder whose checkpoints/last.ckpt is the checkpoint at `path` after edit(checkpoint) changed it in place:
    (the run folder, that file)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    edited = run / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    edit(checkpoint)
    torch.save(checkpoint, edited)
    return run, edited


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_truncated_checkpoint_is_one_error_line_and_status_2(saved, tmp_path, capsys, command):
    path, _ = saved
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    truncated = run / "checkpoints" / "last.ckpt"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # a copy cut off mid-write
    line = refused_line(command, run, tmp_path, capsys)
    assert f"CKPT {truncated} is not a PyTorch checkpoint" in line and "give a .ckpt from the run" in line


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("lacking", ["drafter_config", "global_step"])  # another project's; a weights-only re-save
def test_a_checkpoint_lacking_its_config_or_step_is_one_error_line(saved, tmp_path, capsys, command, lacking):
    """A drafter checkpoint lacking global_step, unless refused first, is read to its end and stops on a KeyError
    traceback; only the one lacking drafter_config was tried."""
    run, edited = edited_run(saved[0], tmp_path, lambda checkpoint: checkpoint.pop(lacking))
    line = refused_line(command, run, tmp_path, capsys)
    assert f"CKPT {edited} is not a drafter checkpoint of this project (no drafter_config/global_step)" in line


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("value", ["nan", "inf"])  # an overflow diverges to inf, not only to NaN
def test_a_checkpoint_with_non_finite_weights_is_refused_not_scored_or_shipped(saved, tmp_path, capsys, command, value):
    """Lossless decoding scores any drafter at tau >= 1.0: one whose weights diverged would read as measured, and
    an export would ship noise."""
    def diverge(checkpoint):
        name = next(key for key in checkpoint["state_dict"] if key.startswith("drafter."))
        checkpoint["state_dict"][name] = torch.full_like(checkpoint["state_dict"][name], float(value))

    run, diverged = edited_run(saved[0], tmp_path, diverge)
    line = refused_line(command, run, tmp_path, capsys)
    assert f"CKPT {diverged}: 1 of the drafter's parameter tensors hold NaN or inf" in line and "step-N.ckpt" in line


@pytest.mark.parametrize("command", ["eval", "export"])
@pytest.mark.parametrize("renamed_to", [None, "drafter.fc_proj.weight"])  # dropped, or under another version's name
def test_a_checkpoint_whose_weights_do_not_match_its_config_is_refused_naming_the_weight(saved, tmp_path, capsys,
                                                                                        command, renamed_to):
    """A weight the config needs, missing from the checkpoint, would start from random values: finite, so the NaN
    check passes it, and the export's load-back compares it with itself. torch's strict error named no weight in the
    line shown ("Error(s) in loading state_dict for DFlashDraftModel:")."""
    def drop(checkpoint):
        weight = checkpoint["state_dict"].pop("drafter.fc.weight")
        if renamed_to:
            checkpoint["state_dict"][renamed_to] = weight

    run, edited = edited_run(saved[0], tmp_path, drop)
    line = refused_line(command, run, tmp_path, capsys)
    assert line.startswith(f"error: CKPT {edited}: its weights do not match its drafter_config (the config needs "
                           "weight fc.weight, absent from the weights"), line
    assert ("the weights hold fc_proj.weight, which the config has no place for" in line) == bool(renamed_to), line
    assert " more" not in line and line.endswith("; give a checkpoint as training/train.py wrote it"), line


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_checkpoint_with_a_weight_of_another_shape_is_refused_naming_it(saved, tmp_path, capsys, command):
    """torch raises on a shape that differs whatever `strict` is; its first line named no weight either."""
    def narrow(checkpoint):
        weights = checkpoint["state_dict"]
        weights["drafter.fc.weight"] = weights["drafter.fc.weight"][:, :-1].clone()
        shapes.append(list(weights["drafter.fc.weight"].shape))

    shapes = []
    run, edited = edited_run(saved[0], tmp_path, narrow)
    line = refused_line(command, run, tmp_path, capsys)
    assert line.startswith(f"error: CKPT {edited}: its weights do not match its drafter_config (size mismatch for "
                           f"fc.weight: copying a param with shape torch.Size({shapes[0]}) from "
                           "checkpoint"), line


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_make_eval_limit_below_one_names_the_flag_not_the_config(saved, capsys, limit):
    path, _ = saved
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(path), "--limit", limit]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"error: --limit {limit} must be at least 1; omit it to use eval.limit of ") and "tiny.yaml" in line


def test_make_eval_refuses_an_out_it_could_not_write_before_evaluating(saved, tmp_path, capsys):
    path, _ = saved
    (tmp_path / "afile").write_text("mine")
    for out, message in ((tmp_path, "is a folder; give a file path"), (tmp_path / "afile" / "x.json", "is a file, not a folder")):
        assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(path), "--out", str(out)]) == 2
        assert message in one_error_line(capsys)
    assert (tmp_path / "afile").read_text() == "mine"
    # an existing file, the checkpoint itself among them (it was replaced by results JSON), only when asked
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(path), "--out", str(tmp_path / "afile")]) == 2
    assert f"--out {tmp_path / 'afile'} exists; pass --overwrite to replace it" in one_error_line(capsys)
    # a checkpoint, the measured one or another (it was replaced by results JSON), never, even when asked
    other = tmp_path / "other" / "checkpoints" / "step-3.ckpt"  # another run's
    other.parent.mkdir(parents=True)
    shutil.copy(path, other)
    # a shard of a DeepSpeed checkpoint folder copied out of its run: no checkpoints/ above it (mutation review 15, E08)
    shard = tmp_path / "copied" / "last.ckpt" / "checkpoint" / "mp_rank_00_model_states.pt"
    shard.parent.mkdir(parents=True)
    shard.write_bytes(b"shard")
    for out in (path, other, path.parent / "results.json", other.parent / "results.json", shard):
        assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(path), "--out", str(out), "--overwrite"]) == 2
        assert f"--out {out} is a checkpoint or lies among a run's checkpoints" in one_error_line(capsys)
    assert (tmp_path / "afile").read_text() == "mine" and path.stat().st_size > 1000
    assert other.stat().st_size == path.stat().st_size and not (path.parent / "results.json").exists()
    assert shard.read_bytes() == b"shard"


def test_make_eval_out_is_no_file_the_run_or_the_recipe_reads(saved, tmp_path, capsys, monkeypatch):
    """`ARGS="--out X --overwrite"` replaced the run's config.yaml (its resume then stopped with a traceback), the
    recipe's eval.prompts (every later eval and train refused it) or eval/step-N.json (the model card's record), as
    `ddtree bench --out` never does: refused before the target loads, even with --overwrite, and nothing written."""
    path, _ = saved
    prompts = tmp_path / "prompts.jsonl"
    shutil.copyfile(Path(training.evaluate.__file__).parents[1] / "data" / "eval_prompts.jsonl", prompts)
    config = yaml.safe_load(training.evaluate.recipe_path("tiny").read_text())
    config["trainer"]["precision"] = "32-true"  # (no precision probe)
    config["eval"]["prompts"] = str(prompts)
    # the evaluations it lets write check where they wrote, not what they measured: the primary budget alone, 4 tokens
    # (the recipe's 3 budgets of 16 tokens were 5 of this test's 7 s on a 2-core AVX2 EPYC)
    config["eval"].update(budgets=[config["eval"]["primary_budget"]], max_new_tokens=4)
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(path, run / "checkpoints" / "last.ckpt")
    (run / "eval").mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    (recipes / "tiny.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setattr(training.evaluate, "recipe_path", lambda name: recipes / f"{name}.yaml")
    for name in ("corpus.safetensors", "eval/step-000007.json", "report.md", "drafter/config.json"):
        (run / name).parent.mkdir(exist_ok=True)
        (run / name).write_text("training's")
    before = {file: file.read_bytes() for file in tmp_path.rglob("*") if file.is_file()}

    def refused(out: Path, ckpt: Path = run / "checkpoints" / "last.ckpt") -> str:
        assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(ckpt), "--out", str(out), "--overwrite"]) == 2
        line = one_error_line(capsys)
        # without --overwrite, the same line: not one that suggests --overwrite, which is then refused
        assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(ckpt), "--out", str(out)]) == 2
        assert one_error_line(capsys) == line
        return line

    assert refused(run / "config.yaml") == (f"error: --out {run / 'config.yaml'} is the file the eval settings are read "
                                            "from: the results would replace it; give another --out")
    assert refused(prompts) == f"error: --out {prompts} is the eval.prompts file: the results would replace it; give another --out"
    with monkeypatch.context() as here:  # the same file given relative to the working folder (mutation review 15, E07)
        here.chdir(tmp_path)
        assert refused(Path("prompts.jsonl")).startswith("error: --out prompts.jsonl is the eval.prompts file: ")
    assert refused(recipes / "tiny.yaml").startswith(f"error: --out {recipes / 'tiny.yaml'} is the recipe: ")
    for inside in ("corpus.safetensors", "eval/step-000007.json", "eval/step-000010.json", "report.md",
                   "drafter/config.json", "data.json", "tau.png", "eval/accepted_depths.csv", "csv/x.json",
                   "eval/abandoned-after-step-3/step-000005.json", "eval/stopped-at-step-000008.json",
                   "tensorboard"):  # one of its folders, not made yet (mutation review 15, E04)
        assert refused(run / inside) == (
            f"error: --out {run / inside} is {inside} of the run {run}, one of the files its training writes, which "
            "the results would replace; give a new file, such as its eval/checkpoint-<name>.json (the default), or a "
            "path outside the run")
    # a loose checkpoint reads the recipe, another run's files are that run's
    loose = tmp_path / "loose.ckpt"
    shutil.copyfile(path, loose)
    assert refused(recipes / "tiny.yaml", loose).startswith(
        f"error: --out {recipes / 'tiny.yaml'} is the file the eval settings are read from: ")
    assert "is eval/step-000007.json of the run" in refused(run / "eval" / "step-000007.json", loose)
    loose.unlink()
    assert {file: file.read_bytes() for file in tmp_path.rglob("*") if file.is_file()} == before
    # its own eval outputs, in eval/ or a branch's eval/abandoned-after-step-N/, and new files nothing reads it may write
    for mine in ("eval/checkpoint-mine.json", "eval/abandoned-after-step-3/checkpoint-mine.json", "eval/bf16.json",
                 "notes/eval.json", "results.json"):
        assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(run / "checkpoints" / "last.ckpt"),
                                       "--limit", "1", "--out", str(run / mine)]) == 0
        assert json.loads((run / mine).read_text())["step"] == 7


@pytest.mark.parametrize("target_dtype, fast, measured", [
    ("auto", torch.bfloat16, "bfloat16"),  # the recipes' own: the target runs in the precision
    ("float32", torch.bfloat16, "float32"),  # the checkpoint's model.target_dtype, as training ran the target
    ("bfloat16", torch.float32, "bfloat16"),
])
def test_make_eval_of_a_loose_checkpoint_writes_beside_it(saved, short_tiny, tmp_path, capsys, monkeypatch,
                                                          target_dtype, fast, measured):
    """With no run's config.yaml it reads the recipe, whose precision `auto` is resolved as training resolves it
    (stubbed here, bf16 being what the AVX2 CPU would not pick): it was read as fp32 on every machine before. The
    checkpoint's model.target_dtype still decides the target's dtype: ignoring it, an fp32-trained run was measured
    against a bf16 target where `auto` picks bf16, and every test passed (mutation review 19, gap 3 / E05)."""
    from ddtree.precision import Choice

    path, _ = saved
    loose = tmp_path / "loose" / "x.ckpt"
    loose.parent.mkdir()
    saved_dict = torch.load(path, map_location="cpu", weights_only=False)
    saved_dict["hyper_parameters"]["target_dtype"] = target_dtype
    torch.save(saved_dict, loose)
    stub = lambda device: Choice(fast, "stubbed")  # noqa: E731
    monkeypatch.setattr(training.evaluate, "fast_precision", stub, raising=False)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr().out
    assert f"[precision] trainer.precision auto -> {stub('cpu').lightning} (stubbed)" in printed
    assert f"target tiny-random in {measured}" in printed
    # a --limit measurement is named for it: the checkpoint's own name holds what `make export` reports
    written = tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json"
    assert not (tmp_path / "loose" / "eval" / "checkpoint-x.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loose"]  # nothing above the checkpoint's folder
    # and it decodes that many prompts, not the recipe's eval.limit of 3: a --limit left unapplied still wrote
    # checkpoint-x-limit1.json, over 3 prompts (mutation review 19, gap 2 / E03)
    results = json.loads(written.read_text())
    assert "1 prompts of data/eval_prompts.jsonl" in printed
    assert (results["settings"]["limit"], results["settings"]["num_prompts"], len(results["prompts"])) == (1, 1, 1)
    assert results["settings"]["dtype"] == measured


def test_make_eval_shows_a_tau_no_round_measured_as_a_dash(saved, tmp_path, capsys, monkeypatch):
    """Every prompt ending on its first token leaves no verification round: the table printed "nan" for it (the
    report, card and training's line say "-")."""
    path, _ = saved
    loose = tmp_path / "loose" / "x.ckpt"
    loose.parent.mkdir()
    shutil.copy(path, loose)
    every_token_stops = lambda target, tokenizer: list(range(target.config.vocab_size))  # noqa: E731
    monkeypatch.setattr(training.evaluate, "stop_token_ids", every_token_stops)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    table = capsys.readouterr().out.split("accepted depth: rounds\n", 1)[1].split("results written", 1)[0]
    rows = [line.split() for line in table.splitlines()]
    assert rows and all(row[1:5] == ["-", "-", "-", "0"] for row in rows), table
    assert "nan" not in table


def test_make_evals_row_prints_tau_logged_expected_and_rounds_each_under_its_heading(saved, short_tiny, tmp_path,
                                                                                     capsys, monkeypatch):
    """A random drafter measures an expected tau next to its tau (1.001 to 1.000): the "expected" column printing the
    tau passed every test, and so did "rounds" printing the tokens, while results.json held the right figures."""
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)  # its logged tau of 1.5 is shown
    stats = {"tau": 2.5, "expected_tau": 3.125, "rounds": 12, "tree_nodes": 8.0, "new_tokens": 31,
             "accepted_depth_counts": {0: 2, 2: 10}}
    monkeypatch.setattr(AcceptanceEvaluation, "measure",
                        lambda self, *args, **kwargs: {"summary": {"dflash": stats}, "prompts": []})
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr().out.splitlines()
    header = next(line for line in printed if line.startswith("method "))
    row = next(line for line in printed if line.startswith("dflash "))
    assert header.split()[:5] == ["method", "tau", "logged", "expected", "rounds"]
    assert row.split() == ["dflash", "2.500", "1.500", "3.125", "12", "0:2", "2:10"]


def test_make_evals_logged_column_shows_each_budgets_own_logged_tau(saved, short_tiny, tmp_path, capsys, monkeypatch):
    """Each ddtree@N row is compared with the tau training logged at that budget: one read at another budget (or the
    chain's) puts a figure beside it that measures another tree, and reads as a gain or a loss that never happened."""
    path, _ = saved
    logged = {key: {"tau": tau, "expected_tau": tau} for key, tau in
              (("dflash", 1.5), ("ddtree@4", 2.25), ("ddtree@8", 2.75))}
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1, logged)
    stats = {"tau": 2.5, "expected_tau": 2.5, "rounds": 1, "tree_nodes": 8.0, "new_tokens": 3,
             "accepted_depth_counts": {2: 1}}
    monkeypatch.setattr(AcceptanceEvaluation, "measure",
                        lambda self, *args, **kwargs: {"summary": dict.fromkeys(logged, stats), "prompts": []})
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    rows = {line.split()[0]: line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0] in logged}
    assert rows == {"dflash": "1.500", "ddtree@4": "2.250", "ddtree@8": "2.750"}


def test_make_evals_results_of_a_checkpoints_folder_outside_a_run_go_beside_that_folder(tmp_path):
    """A checkpoints/ folder copied without its run's config.yaml: the results go into eval/ beside it, as a run's
    would. Written into checkpoints/eval/, they lay among the checkpoints, where --out is refused (mutation review 15,
    E10)."""
    copied = tmp_path / "copied" / "checkpoints" / "step-4.ckpt"
    copied.parent.mkdir(parents=True)
    copied.write_bytes(b"")
    assert training.evaluate.default_results_file(copied, None) == \
        (tmp_path / "copied" / "eval" / "checkpoint-step-4.json").resolve()


def test_make_eval_of_an_abandoned_branchs_checkpoint_reads_its_run_and_writes_beside_its_branchs_evaluations(
        saved, tmp_path, capsys):
    """A checkpoint a resume moved to checkpoints/abandoned-after-step-N/ read the recipe (another target's by
    default: refused) and wrote into the checkpoints folder; eval/ is the current branch's, whose last.ckpt of the same
    name is another drafter."""
    path, _ = saved
    run = tmp_path / "run"
    branch = run / "checkpoints" / "abandoned-after-step-3"
    branch.mkdir(parents=True)
    shutil.copy(path, branch / "last.ckpt")
    config = yaml.safe_load((REPO_ROOT / "recipes" / "tiny.yaml").read_text())
    config["eval"]["max_new_tokens"] = 5  # the run's own setting, not the recipe's 16
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    assert training.evaluate.main(["--ckpt", str(branch / "last.ckpt"), "--limit", "1"]) == 0  # no --recipe
    assert f"settings from {run / 'config.yaml'}" in capsys.readouterr().out
    written = run / "eval" / "abandoned-after-step-3" / "checkpoint-last-limit1.json"
    assert json.loads(written.read_text())["settings"]["max_new_tokens"] == 5
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*.json")) == [written.relative_to(run).as_posix()]


def test_make_eval_of_a_run_whose_relative_eval_prompts_are_not_found_from_here_says_where_before_loading(
        saved, tmp_path, capsys, monkeypatch):
    """Run from another folder than training's, the run's relative eval.prompts was found missing only once the
    target had loaded (minutes for a large one), and the line said "give a JSONL of held-out
    prompts", which no option of make eval takes."""
    path, _ = saved
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(path, run / "checkpoints" / "last.ckpt")
    config = yaml.safe_load((REPO_ROOT / "recipes" / "tiny.yaml").read_text())  # eval.prompts: data/eval_prompts.jsonl
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(training.evaluate, "load_frozen_target",
                        lambda *args, **kwargs: pytest.fail("loaded the target"))
    assert training.evaluate.main(["--run", str(run), "--ckpt", "last"]) == 2
    assert one_error_line(capsys) == (
        f"error: eval.prompts=data/eval_prompts.jsonl (from {run / 'config.yaml'}): no such file in {tmp_path}; a "
        "relative path is read from the folder training was launched in: evaluate from there")


# How the `short_tiny` recipe's evaluation measures with --limit 1 (AcceptanceEvaluation.measurement()): `make eval
# --limit 1` of a checkpoint that recorded it compares like for like
TINY_LIMIT_1 = {"prompts": "data/eval_prompts.jsonl", "limit": 1, "max_new_tokens": 4, "lookup": None, "redraft": None}


@pytest.fixture(scope="module")
def short_tiny_recipe(tmp_path_factory) -> Path:
    """The tiny recipe with its evaluation at the primary budget alone, 4 tokens (TINY_LIMIT_1's)."""
    config = yaml.safe_load(training.evaluate.recipe_path("tiny").read_text())
    config["eval"].update(budgets=[config["eval"]["primary_budget"]], max_new_tokens=TINY_LIMIT_1["max_new_tokens"])
    path = tmp_path_factory.mktemp("recipes") / "tiny.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def short_tiny(short_tiny_recipe, monkeypatch):
    """`--recipe tiny` reads short_tiny_recipe: the make eval tests that take it check what is printed, written and
    compared with the logged tau, not what the recipe's 3 budgets of 16 tokens measure (those were ~1.3 s of each
    evaluation on a 2-core AVX2 EPYC)."""
    recipe_path = training.evaluate.recipe_path
    monkeypatch.setattr(training.evaluate, "recipe_path",
                        lambda name: short_tiny_recipe if name == "tiny" else recipe_path(name))


def loose_copy(path: Path, folder: Path, measurement: dict | None = None, summary: dict | None = None) -> Path:
    """The checkpoint copied outside any run folder as <folder>/x.ckpt, its step's history row holding `summary`
    (default: a logged dflash tau of 1.5), measured with `measurement` (AcceptanceEvaluation.measurement())."""
    loose = folder / "x.ckpt"
    loose.parent.mkdir()
    saved_dict = torch.load(path, map_location="cpu", weights_only=False)
    summary = summary or {"dflash": {"tau": 1.5, "expected_tau": 1.25}}
    state = {"history": [{"step": 7, "summary": summary, "seconds": 1.0}]}
    if measurement is not None:
        state["measurement"] = measurement
    saved_dict["callbacks"] = {"AcceptanceEvaluation": state}
    torch.save(saved_dict, loose)
    return loose


def test_make_eval_refuses_a_recipe_for_another_target_than_the_loose_checkpoints(saved, tmp_path, capsys):
    """Outside a run folder the eval settings come from --recipe, by default smollm2-135m's: a tiny-random checkpoint
    was measured with that recipe's prompts, budgets and max_new_tokens, as if they were its run's."""
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose")
    assert training.evaluate.main(["--ckpt", str(loose)]) == 2
    line = one_error_line(capsys)
    assert f"smollm2-135m.yaml: model.target 'smollm2-135m' is not CKPT {loose}'s " in line
    assert "target 'tiny-random'" in line and "RECIPE=<name> (--recipe <name>) (recipes for 'tiny-random': tiny)" in line
    assert not (tmp_path / "loose" / "eval").exists()


@pytest.mark.parametrize("max_new_tokens, dtype, prompts", [  # 4: short_tiny's
    (4, None, None), (8, None, None), (4, "float16", None), (4, None, "the same"), (4, None, "others"),
])
def test_make_eval_shows_the_logged_tau_only_where_training_measured_the_same_way(saved, short_tiny, tmp_path, capsys,
                                                                                   max_new_tokens, dtype, prompts):
    """A tau logged with other prompts, limit, max_new_tokens, lookup, redraft or target dtype measures something
    else: it was printed and stored as "logged" beside the new one all the same, and so was one measured on other
    prompts of a file of the same name (regenerated or edited: found in a review). A dtype or prompts fingerprint not
    recorded (checkpoints written before it was) is not known: compared as the same."""
    from ddtree.bench import load_prompts, prompts_fingerprint
    from ddtree.targets import load_tokenizer

    path, _ = saved
    first = prompts_fingerprint(load_prompts(REPO_ROOT / "data" / "eval_prompts.jsonl", load_tokenizer("tiny-random"), 1))
    fingerprint = {None: {}, "the same": {"prompts_sha256": first}, "others": {"prompts_sha256": "0" * 64}}[prompts]
    # the tiny recipe's eval section with --limit 1, but for max_new_tokens; float16: a dtype `auto` never picks
    measurement = {**TINY_LIMIT_1, "max_new_tokens": max_new_tokens, **({"dtype": dtype} if dtype else {}), **fingerprint}
    loose = loose_copy(path, tmp_path / "loose", measurement)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr()
    row = next(line for line in printed.out.splitlines() if line.startswith("dflash "))
    written = json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())
    stored, now = written["logged"], written["settings"]["dtype"]
    assert written["settings"]["prompts_sha256"] == first  # what it measured on, as `ddtree bench` records it
    if max_new_tokens == 4 and dtype is None and prompts != "others":  # the recipe's: the same measurement
        assert row.split()[2] == "1.500" and stored["val/tau_dflash"] == 1.5
    else:
        assert row.split()[2] == "-" and stored is None
        changed = ("eval.max_new_tokens 8 -> 4" if max_new_tokens == 8 else f"the target's dtype float16 -> {now}"
                   if dtype else f"the contents of eval.prompts data/eval_prompts.jsonl: prompts_sha256 000000000000... "
                   f"-> {first[:12]}...")
        assert f"[eval] training measured step 7 otherwise ({changed}): no logged tau to compare with" in printed.err
    assert f"target tiny-random in {now}" in printed.out  # the dtype it ran in, recorded as training records it


def test_make_eval_shows_no_logged_tau_where_training_did_not_record_how_it_measured(saved, short_tiny, tmp_path,
                                                                                     capsys):
    """A checkpoint whose evaluation state holds no measurement (written before training recorded it) does not say
    which prompts, limit or max_new_tokens its logged tau was measured with: shown beside the new one all the same,
    the two read as a like-for-like comparison (mutation review 15, E02)."""
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose")  # its step's history row, logged tau 1.5, and no measurement
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr()
    row = next(line for line in printed.out.splitlines() if line.startswith("dflash "))
    assert row.split()[2] == "-"
    assert json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())["logged"] is None
    assert "[eval] training did not record how it measured step 7: no logged tau to compare with" in printed.err


def test_make_eval_of_a_step_training_did_not_evaluate_shows_no_logged_tau(saved, short_tiny, tmp_path, capsys):
    """A checkpoint of a step training did not evaluate (a requeue's hpc_ckpt, a stop off the evaluation grid) holds
    earlier steps' rows and how they were measured, but no row of its own step: nothing to compare with, and read as
    one, a TypeError traceback after every prompt was decoded (mutation review 15, E03)."""
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)  # the same measurement
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["callbacks"]["AcceptanceEvaluation"]["history"][0]["step"] = 4  # an earlier step's; the file is step 7's
    torch.save(checkpoint, loose)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr()
    row = next(line for line in printed.out.splitlines() if line.startswith("dflash "))
    assert row.split()[2] == "-" and "[eval]" not in printed.err
    assert json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())["logged"] is None


def test_make_eval_of_a_corpus_run_away_from_its_corpus_shows_no_logged_tau(saved, short_tiny, tmp_path, capsys):
    """A model.corpus checkpoint with no corpus.safetensors of its run beside it is decoded without the training
    replies grafted into its trees, which training's evaluation grafted: its logged tau, shown beside the new one,
    measured another decoding (mutation review 15, E16)."""
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)  # all but the corpus measure alike
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"]["corpus"] = True
    torch.save(checkpoint, loose)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr()
    said = f"[eval] {loose} was trained with model.corpus, but no corpus.safetensors of its run is beside it"
    assert said in printed.err
    row = next(line for line in printed.out.splitlines() if line.startswith("dflash "))
    written = json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())
    assert row.split()[2] == "-" and written["logged"] is None and written["settings"]["corpus"] is False


def test_make_eval_marks_a_target_adapter_retrained_since_as_not_comparable(saved, short_tiny, tmp_path, capsys):
    """The checkpoint records the sha256 of its target adapter's files: measured against the adapter retrained in
    place since, the logged tau (training's, against the adapter as it was) was printed beside the new one."""
    from peft import LoraConfig, get_peft_model

    from ddtree.targets import load_target
    from training.peft_utils import adapter_fingerprint

    def save_adapter(seed):
        torch.manual_seed(seed)
        config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
        get_peft_model(load_target("tiny-random")[0], config).save_pretrained(tmp_path / "adapter")

    path, _ = saved
    save_adapter(0)
    adapter = str(tmp_path / "adapter")
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"].update(target_adapter=adapter, target_adapter_sha256=adapter_fingerprint(adapter))
    torch.save(checkpoint, loose)
    evaluate = ["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]

    def logged_column() -> str:
        printed = capsys.readouterr()
        return next(line for line in printed.out.splitlines() if line.startswith("dflash ")).split()[2], printed.err

    assert training.evaluate.main(evaluate) == 0
    column, err = logged_column()
    assert column == "1.500" and "[eval]" not in err  # the adapter it trained against
    recorded = json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())["settings"]
    assert recorded["target_adapter"] == adapter and recorded["target_adapter_sha256"] == adapter_fingerprint(adapter)
    save_adapter(1)  # retrained where it was
    assert training.evaluate.main(evaluate) == 0
    column, err = logged_column()
    assert column == "-" and f"[eval] {loose} was trained against target adapter {adapter} as its files were then, " \
        "and they have changed since (retrained?)" in err
    assert json.loads((tmp_path / "loose" / "eval" / "checkpoint-x-limit1.json").read_text())["logged"] is None
    # a checkpoint written before the files' sha256 was recorded: not known, so no change (mutation review 15, E15)
    checkpoint["hyper_parameters"].pop("target_adapter_sha256")
    torch.save(checkpoint, loose)
    assert training.evaluate.main(evaluate) == 0
    column, err = logged_column()
    assert column == "1.500" and "[eval]" not in err


def test_make_eval_measures_against_the_target_adapter_the_run_trained_with(saved, tmp_path, monkeypatch):
    """The checkpoint's model.target_adapter is folded into the target it decodes with, as training folded it in:
    measured against the base target instead, the taus were another target's while results.json still recorded the
    adapter, and every test passed (mutation review 19, gap 1 / E10)."""
    from peft import LoraConfig, get_peft_model

    from ddtree.targets import load_target
    from training.callbacks import AcceptanceEvaluation
    from training.peft_utils import adapter_fingerprint
    from training.target import load_frozen_target

    torch.manual_seed(0)
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)  # (not a no-op: B is not zero)
    get_peft_model(load_target("tiny-random")[0], config).save_pretrained(tmp_path / "adapter")
    adapter = str(tmp_path / "adapter")
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose")
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"].update(target_adapter=adapter, target_adapter_sha256=adapter_fingerprint(adapter))
    torch.save(checkpoint, loose)
    measured = []

    def measure(self, target, *args, **kwargs):
        measured.append(target.get_decoder().layers[0].self_attn.q_proj.weight.detach().clone())
        return {"summary": {}, "prompts": []}

    monkeypatch.setattr(AcceptanceEvaluation, "measure", measure)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0

    def q_proj(model):
        return model.get_decoder().layers[0].self_attn.q_proj.weight

    trained = q_proj(load_frozen_target("tiny-random", torch.float32, adapter)[0])  # (the saved run's target_dtype)
    assert len(measured) == 1 and measured[0].dtype == torch.float32
    assert torch.equal(measured[0], trained)
    assert not torch.equal(measured[0], q_proj(load_target("tiny-random", torch.float32)[0]))


def test_make_eval_of_a_checkpoint_naming_no_target_or_an_absolute_adapter_no_folder_now_is_one_line(saved, tmp_path,
                                                                                                    capsys):
    """A checkpoint another module wrote (no model.target) is named as such, not a KeyError; one trained against an
    adapter at an absolute path that is gone says to put it back, not to evaluate from another folder."""
    run, edited = edited_run(saved[0], tmp_path, lambda checkpoint: checkpoint["hyper_parameters"].pop("target"))
    assert refused_line("eval", run, tmp_path, capsys) == (
        f"error: CKPT {edited} names no target: it was not written by training.module.DistillModule")
    gone = tmp_path / "gone" / "adapter"
    shutil.rmtree(run)
    run, edited = edited_run(saved[0], tmp_path,
                             lambda checkpoint: checkpoint["hyper_parameters"].update(target_adapter=str(gone)))
    assert refused_line("eval", run, tmp_path, capsys) == (
        f"error: {edited} was trained against target adapter {gone} (its model.target_adapter), which is no folder "
        "now: put the adapter it trained against back there")


def test_make_eval_of_a_run_whose_eval_section_has_an_unknown_field_names_the_file(saved, tmp_path, capsys):
    path, _ = saved
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copyfile(path, run / "checkpoints" / "last.ckpt")
    config = yaml.safe_load(training.evaluate.recipe_path("tiny").read_text())
    config["eval"]["budgetz"] = [8]
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    line = refused_line("eval", run, tmp_path, capsys)
    assert line.startswith(f"error: {run / 'config.yaml'}: bad eval section (") and "budgetz" in line, line


def test_make_eval_out_outside_the_checkpoints_run_is_the_users_file(saved, tmp_path):
    """--out beside the run, not in it, is no run file: taken (it was compared with the run's paths as if inside)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}")
    training.evaluate.check_out_is_no_input(tmp_path / "results" / "config.yaml", run, {})
    with pytest.raises(DDTreeError, match="is config.yaml of the run"):
        training.evaluate.check_out_is_no_input(run / "config.yaml", run, {})


def test_make_eval_of_a_target_adapter_not_found_from_here_says_so_and_where_to_run(saved, short_tiny, tmp_path,
                                                                                    monkeypatch, capsys):
    """The checkpoint keeps model.target_adapter as its launch gave it, relative to the folder training ran in: make
    eval from another folder said the adapter's files "have changed since (retrained?)", and then failed on a
    model.target_adapter the user had not given."""
    from peft import LoraConfig, get_peft_model

    from ddtree.targets import load_target
    from training.peft_utils import adapter_fingerprint

    launch = tmp_path / "launch"  # where training ran: its adapter and, through data/, the recipe's eval.prompts
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(load_target("tiny-random")[0], config).save_pretrained(launch / "adapters" / "lora")
    (launch / "data").symlink_to(REPO_ROOT / "data")
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"].update(target_adapter="adapters/lora",
                                          target_adapter_sha256=adapter_fingerprint(launch / "adapters" / "lora"))
    torch.save(checkpoint, loose)
    evaluate = ["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]

    monkeypatch.chdir(tmp_path)
    assert training.evaluate.main(evaluate) == 2
    err = capsys.readouterr().err
    assert "changed since" not in err and "[eval]" not in err
    errors = [line for line in err.splitlines() if line.startswith("error")]
    assert errors == [f"error: {loose} was trained against target adapter adapters/lora (its model.target_adapter, a "
                      f"path relative to the folder training was launched in), which is no folder from here "
                      f"({tmp_path}): evaluate from that folder, where the path leads to the adapter"], errors
    monkeypatch.chdir(launch)  # as it says: the same adapter, so training's tau is shown beside the new one
    assert training.evaluate.main(evaluate) == 0
    printed = capsys.readouterr()
    assert "[eval]" not in printed.err
    assert next(line for line in printed.out.splitlines() if line.startswith("dflash ")).split()[2] == "1.500"


def test_make_eval_of_a_target_adapter_under_tilde_finds_it_in_the_home_folder(saved, short_tiny, tmp_path,
                                                                               monkeypatch, capsys):
    """Training took `model.target_adapter: ~/lora` as the home folder's (training/peft_utils.py); make eval of its
    checkpoint said the adapter was "a path relative to the folder training was launched in" and no folder from here."""
    from peft import LoraConfig, get_peft_model

    from ddtree.files import cache_dir
    from ddtree.targets import load_target
    from training.peft_utils import adapter_fingerprint

    # the converted targets stay where they are (under the moved home, tiny-random was converted again: ~50 s)
    monkeypatch.setenv("DDTREE_CACHE", str(cache_dir()))
    monkeypatch.setenv("HOME", str(tmp_path))
    config = LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False)
    get_peft_model(load_target("tiny-random")[0], config).save_pretrained(tmp_path / "lora")
    path, _ = saved
    loose = loose_copy(path, tmp_path / "loose", TINY_LIMIT_1)
    checkpoint = torch.load(loose, map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"].update(target_adapter="~/lora",
                                          target_adapter_sha256=adapter_fingerprint(tmp_path / "lora"))
    torch.save(checkpoint, loose)
    assert training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose), "--limit", "1"]) == 0
    printed = capsys.readouterr()
    assert "error" not in printed.err and "[eval]" not in printed.err  # the same adapter: training's tau beside


def test_a_run_that_left_its_layer_ids_to_an_older_default_resumes_on_its_checkpoints_ids(tmp_path, capsys):
    """Before 2026-12-03 a target under 8 layers defaulted to the published spread with repeats ([1, 2, 2, 2, 3] on
    tiny's 6); such a run's config.yaml says null, today's default differs, and its resume was refused with advice
    to drop a setting it never gave (found in a review)."""
    from test_reliability import tiny_args

    from ddtree.files import read_yaml_mapping
    from training.train import main as train_main

    old_default = [1, 2, 2, 2, 3]
    assert train_main([*tiny_args(tmp_path, "old", max_steps=2), f"--model.target_layer_ids={old_default}"]) == 0
    run = tmp_path / "out" / "tiny" / "old"
    config = (run / "config.yaml").read_text()
    assert f"target_layer_ids:\n  - {old_default[0]}" in config  # what an old run's config.yaml held instead: null
    (run / "config.yaml").write_text(config.replace(
        "target_layer_ids:\n" + "".join(f"  - {i}\n" for i in old_default), "target_layer_ids: null\n"))
    capsys.readouterr()
    assert train_main(["--output-root", str(tmp_path / "out"), "--resume", str(run), "--trainer.max_steps=4"]) == 0
    assert (run / "checkpoints" / "step-4.ckpt").is_file()
    assert read_yaml_mapping(run / "config.yaml")["model"]["target_layer_ids"] == old_default


def test_a_run_whose_checkpoints_do_not_record_the_dtype_is_refused_a_resume_in_another_precision(tmp_path, capsys):
    """Checkpoints written before 2026-12-03 keep no dtype in their measurement: a resume in another precision was
    accepted silently, ranked fp32 taus against the old bf16 ones and rewrote config.yaml to a precision the old
    steps never ran in (found in a review). The run's config.yaml says what they ran in."""
    from test_reliability import tiny_args

    from ddtree.files import read_yaml_mapping
    from training.train import main as train_main

    assert train_main([*tiny_args(tmp_path, "old", max_steps=2), "--trainer.precision=bf16-mixed"]) == 0
    run = tmp_path / "out" / "tiny" / "old"
    for path in (run / "checkpoints").glob("*.ckpt"):  # as older code wrote them (best.ckpt: a link to one)
        if path.is_symlink():
            continue
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
        checkpoint["callbacks"]["AcceptanceEvaluation"]["measurement"].pop("dtype")
        torch.save(checkpoint, path)
    capsys.readouterr()
    resume = ["--output-root", str(tmp_path / "out"), "--resume", str(run), "--trainer.max_steps=4"]
    assert train_main([*resume, "--trainer.precision=32-true"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith(
        "error: this run measured its checkpoints' tau otherwise than the resume would (the target's dtype bfloat16 "
        "-> float32): resume with the run's trainer.precision"), errors
    assert read_yaml_mapping(run / "config.yaml")["trainer"]["precision"] == "bf16-mixed"
    assert not (run / "checkpoints" / "step-4.ckpt").exists()


def test_the_runs_dtype_a_resume_checks_is_its_target_dtype_over_its_precisions(tmp_path):
    """run_target_dtype reads config.yaml as DistillModule ran the target: model.target_dtype wins over
    trainer.precision's. Read from the precision alone, a run trained with target_dtype bfloat16 under 32-true was
    refused its own plain resume ("the target's dtype float32 -> bfloat16") where its checkpoints do not record
    the dtype."""
    from training.train import run_target_dtype

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"model": {"target_dtype": "bfloat16"}, "trainer": {"precision": "32-true"}}))
    assert run_target_dtype(config) == "bfloat16"
    config.write_text(yaml.safe_dump({"model": {"target_dtype": None}, "trainer": {"precision": "bf16-mixed"}}))
    assert run_target_dtype(config) == "bfloat16"
    assert run_target_dtype(tmp_path / "missing.yaml") is None


def test_make_eval_out_is_refused_over_a_run_file_of_the_checkpoints_run_though_it_has_no_checkpoints_folder(tmp_path):
    """The run of an hpc_ckpt_N.ckpt (SLURM's requeue save, in the run folder itself) holds no checkpoints/ folder, so
    only the checkpoint's own run names it a run: an --out of its report.md would overwrite what training wrote."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("model: {}\n")
    (run / "report.md").write_text("the run's report\n")
    with pytest.raises(DDTreeError, match="report.md of the run"):
        training.evaluate.check_out_is_no_input(run / "report.md", run, {})


def test_make_eval_out_beside_a_checkpoints_folder_outside_a_run_is_the_users(tmp_path):
    """A checkpoints/ folder copied without its config.yaml is no run: a report.md beside it is the user's to write,
    while a folder holding a config.yaml and checkpoints/ keeps its report.md (training writes it)."""
    copied = tmp_path / "copied"
    (copied / "checkpoints").mkdir(parents=True)
    training.evaluate.check_out_is_no_input(copied / "report.md", None, {})
    (copied / "config.yaml").write_text("model: {}\n")
    with pytest.raises(DDTreeError, match="report.md of the run"):
        training.evaluate.check_out_is_no_input(copied / "report.md", None, {})


def test_an_out_in_a_folder_of_the_users_under_eval_is_not_a_run_file():
    """Training's records are in eval/ and in a resume's eval/abandoned-after-step-N/ only: a step-N.json in a folder
    of the user's own under eval/ (eval/bf16/) is a new file, which make eval may write."""
    assert training.evaluate.is_run_file(Path("eval/abandoned-after-step-4/step-3.json"))
    assert training.evaluate.is_run_file(Path("eval/step-3.json"))
    assert not training.evaluate.is_run_file(Path("eval/bf16/step-3.json"))


def test_a_run_whose_only_save_a_cut_short_deepspeed_last_ckpt_is_named_not_called_empty(tmp_path):
    """checkpoint.save_top_k 0 keeps last.ckpt only: when its first DeepSpeed save is killed, the run folder holds a
    last.ckpt/ with its `saving` marker and no `latest`. The refusal names it, so the user knows a save began and the
    run folder cannot be resumed; "no checkpoint yet" sent them looking for a save that never ran."""
    cut = make_run(tmp_path / "outputs", "cut", {})
    (cut / "checkpoints" / "last.ckpt").mkdir()
    (cut / "checkpoints" / "last.ckpt" / SAVING_MARKER).write_text("")
    with pytest.raises(DDTreeError, match=r"no whole checkpoint: last.ckpt in checkpoints/ is a save cut short"):
        find_resume(str(cut), tmp_path / "outputs")


def test_a_linked_checkpoint_outside_a_run_names_the_folder_its_config_is_missing_from(tmp_path):
    """A checkpoint reached through a link is read from where the link points, so the missing config.yaml is the one
    beside that run's checkpoints/, not beside the link: the user is sent to the folder that needs it."""
    real = tmp_path / "copied" / "checkpoints" / "step-2.ckpt"
    real.parent.mkdir(parents=True)
    torch.save({"global_step": 2}, real)
    link = tmp_path / "links" / "a" / "step-2.ckpt"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    with pytest.raises(DDTreeError) as error:
        find_resume(str(link), tmp_path / "outputs")
    assert str(error.value) == (f"--resume {link}: {(tmp_path / 'copied').resolve()}/config.yaml is missing, so the "
                                "run cannot be resumed exactly")


def test_a_last_ckpt_that_is_an_empty_zip_is_refused_as_unreadable(tmp_path):
    """A zip archive with no entries (a copy that wrote only the directory) holds no state: its directory reads, but
    a Lightning resume or an evaluation of it would fail after the model loaded. It is refused up front, naming the
    run's readable checkpoint instead."""
    run = make_run(tmp_path / "outputs", "run", {"checkpoints/step-2.ckpt": 100, "checkpoints/last.ckpt": 200})
    last = run / "checkpoints" / "last.ckpt"
    zipfile.ZipFile(last, "w").close()
    with pytest.raises(DDTreeError) as error:
        find_checkpoint("last", tmp_path / "outputs")
    assert str(error.value) == (f"CKPT=last: checkpoint {last} is unreadable (truncated?); give an earlier one as "
                                f"CKPT: {run / 'checkpoints' / 'step-2.ckpt'}")


def test_make_export_takes_best_and_last_that_are_deepspeed_folders(tmp_path):
    """Under a DeepSpeed strategy last.ckpt and the step best.ckpt links to are folders of shards: CKPT=best and
    CKPT=last take them as they take a .ckpt file, not report that they do not exist."""
    run = make_run(tmp_path, "run", {"checkpoints/step-2.ckpt/": 100, "checkpoints/last.ckpt/": 200},
                   best="step-2.ckpt")
    assert find_run_checkpoint(run, "last") == ((run / "checkpoints" / "last.ckpt").resolve(), "last")
    assert find_run_checkpoint(run, "best") == ((run / "checkpoints" / "step-2.ckpt").resolve(), "best -> step-2.ckpt")


# ----------------------------------------------------------------------------- pinned by a mutation review


def test_the_newest_run_is_dated_by_its_newest_save_not_its_oldest(tmp_path):
    """A run that saved step-1 long ago and last.ckpt since is newer than a run whose only save came between: dated by
    its oldest file, 'last' took the other run's."""
    root = tmp_path / "tiny"
    long = make_run(root, "long", {"checkpoints/step-1.ckpt": 100, "checkpoints/last.ckpt": 500})
    make_run(root, "short", {"checkpoints/last.ckpt": 300})
    assert find_checkpoint("last", root) == long / "checkpoints" / "last.ckpt"
    assert find_resume("last", root) == (long / "checkpoints" / "last.ckpt", long.resolve())


def test_only_a_folder_named_abandoned_after_step_under_checkpoints_is_an_abandoned_branch(tmp_path):
    """A user's checkpoints/kept/ is no branch a resume left, nor is an abandoned-after-step-N/ outside checkpoints/:
    taken for one, their checkpoints were refused a resume and evaluated against another branch's eval/ folder."""
    run = make_run(tmp_path, "r", {"checkpoints/abandoned-after-step-2/step-6.ckpt": 50,
                                   "checkpoints/kept/step-4.ckpt": 60,
                                   "exports/abandoned-after-step-2/step-6.ckpt": 70})
    branch = run / "checkpoints" / "abandoned-after-step-2" / "step-6.ckpt"
    assert abandoned_branch(branch) == (run.resolve(), "abandoned-after-step-2")
    assert abandoned_branch(run / "checkpoints" / "kept" / "step-4.ckpt") is None
    assert abandoned_branch(run / "exports" / "abandoned-after-step-2" / "step-6.ckpt") is None


def test_a_run_folder_that_holds_a_file_named_latest_is_still_a_run_folder(tmp_path):
    """A folder with a `latest` file looks like a DeepSpeed checkpoint; its config.yaml says it is a run."""
    run = make_run(tmp_path, "r", {"checkpoints/last.ckpt": 100})
    (run / "latest").write_text("notes\n")
    check_run_folder(run)
    assert find_checkpoint("last", tmp_path, run) == (run / "checkpoints" / "last.ckpt").resolve()


@pytest.mark.parametrize("config, top_k", [("checkpoint: {save_top_k: 3}\n", 3),
                                           ("checkpoint: {save_top_k: -1}\n", -1),
                                           ("checkpoint: {save_top_k: '0'}\n", None),
                                           ("checkpoint: {save_last: true}\n", None),
                                           ("seed_everything: 0\n", None)])
def test_configured_top_k_is_the_configs_integer_or_none(tmp_path, config, top_k):
    (tmp_path / "config.yaml").write_text(config)
    assert configured_top_k(tmp_path) == top_k


def test_a_run_whose_checkpoints_are_all_truncated_resumes_to_a_refusal_naming_its_newest(tmp_path):
    """With nothing readable resume_point returns the newest file, so the refusal names the save cut short last."""
    run = make_run(tmp_path / "tiny", "r", {"checkpoints/step-2.ckpt": 100, "checkpoints/last.ckpt": 200})
    last = run / "checkpoints" / "last.ckpt"
    truncate(run / "checkpoints" / "step-2.ckpt")
    truncate(last)
    assert resume_point(run) == (last, None)
    with pytest.raises(DDTreeError, match=r"has no other readable checkpoint") as error:
        find_resume(str(run), tmp_path / "tiny")
    assert f"checkpoint {last} is unreadable (truncated?)" in str(error.value)


def test_removing_stale_staging_leaves_a_folder_of_that_name_alone(tmp_path):
    (tmp_path / f"{AtomicCheckpointIO.STAGING_PREFIX}kept").mkdir()
    (tmp_path / f"{AtomicCheckpointIO.STAGING_PREFIX}kept" / "note").write_text("x")
    staging = tmp_path / f"{AtomicCheckpointIO.STAGING_PREFIX}abc123"
    staging.write_bytes(b"half")
    assert AtomicCheckpointIO.remove_stale_staging(tmp_path) == [staging]
    assert [path.name for path in tmp_path.iterdir()] == [f"{AtomicCheckpointIO.STAGING_PREFIX}kept"]


def test_non_finite_tensors_counts_each_broken_tensor_once_and_none_of_a_module_without_parameters():
    assert non_finite_tensors(torch.nn.Module()) == 0
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))  # 4 tensors: 2 weights, 2 biases
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
        model[0].weight[1, 1] = float("inf")  # the same tensor: still one
        model[1].bias[0] = float("-inf")
    assert non_finite_tensors(model) == 2


def test_a_deepspeed_folder_holding_a_config_json_is_a_checkpoint_not_an_exported_drafter(tmp_path):
    run = make_run(tmp_path / "tiny", "r", {"checkpoints/step-2.ckpt/": 100})
    folder = run / "checkpoints" / "step-2.ckpt"
    (folder / "config.json").write_text("{}\n")  # written beside the shards by some savers: its `latest` decides
    assert find_checkpoint(str(folder), tmp_path / "tiny") == folder


def test_make_export_takes_a_deepspeed_folder_named_by_its_path(tmp_path):
    run = make_run(tmp_path, "run", {"checkpoints/step-2.ckpt/": 100, "checkpoints/last.ckpt/": 200})
    assert find_run_checkpoint(run, "step-2.ckpt") == ((run / "checkpoints" / "step-2.ckpt").resolve(), "step-2.ckpt")


def test_a_best_ckpt_linking_to_a_truncated_step_is_called_truncated_not_gone(tmp_path):
    run = make_run(tmp_path / "tiny", "r", {"checkpoints/step-2.ckpt": 100, "checkpoints/last.ckpt": 200},
                   best="step-2.ckpt")
    truncate(run / "checkpoints" / "step-2.ckpt")
    with pytest.raises(DDTreeError) as error:
        find_checkpoint("best", tmp_path / "tiny")
    best, last = run / "checkpoints" / "best.ckpt", run / "checkpoints" / "last.ckpt"
    assert str(error.value) == (f"CKPT=best: checkpoint {best} is unreadable (truncated?); give an earlier one as "
                                f"CKPT: {last}")


def test_a_refused_save_outside_a_run_folder_counts_only_ckpt_neighbours(tmp_path):
    torch.save({"global_step": 2}, tmp_path / "weights.pt")  # a zip archive, but no checkpoint a resume takes
    assert after_a_refused_save(tmp_path / "step-4.ckpt").startswith("the run holds no checkpoint yet")


def test_an_exported_drafter_folder_is_refused_by_load_checkpoint_as_such(tmp_path):
    (tmp_path / "export").mkdir()
    (tmp_path / "export" / "config.json").write_text("{}\n")
    with pytest.raises(DDTreeError, match=r"is an exported drafter folder, not a training checkpoint"):
        load_checkpoint(tmp_path / "export")


def test_weights_outside_the_drafter_in_a_checkpoints_state_dict_are_left_out(saved, tmp_path):
    path, module = saved
    checkpoint = torch.load(path, weights_only=False)
    state = {**checkpoint["state_dict"], "target_norm.weight": torch.ones(3)}  # not the drafter's: never loaded
    torch.save({**checkpoint, "state_dict": state}, tmp_path / "extra.ckpt")
    found = load_checkpoint(tmp_path / "extra.ckpt").drafter.state_dict()
    assert all(torch.equal(found[key], value) for key, value in module.drafter.state_dict().items())


def test_a_lora_checkpoint_that_left_its_target_modules_unset_merges_its_adapters_on_the_default_modules(saved):
    """lora_target_modules None (unset) in a checkpoint's hyper_parameters means the default modules, as in training:
    merged, each adapted weight is W + (alpha / rank) * B @ A."""
    from ddtree.configuration_dflash import DFlashDrafterConfig
    from ddtree.modeling_dflash import DFlashDraftModel
    from training.checkpoints import drafter_from_weights
    from training.peft_utils import DEFAULT_LORA_MODULES, add_drafter_lora

    config = torch.load(saved[0], weights_only=False)["drafter_config"]
    torch.manual_seed(0)
    lora = add_drafter_lora(DFlashDraftModel(DFlashDrafterConfig.from_dict(config)), 2, 4.0, 0.0, DEFAULT_LORA_MODULES)
    weights = {key: torch.randn_like(value) if "lora_B" in key else value for key, value in lora.state_dict().items()}
    hyper_parameters = {"lora_rank": 2, "lora_alpha": 4.0, "lora_dropout": 0.0, "lora_target_modules": None}
    drafter = drafter_from_weights(config, hyper_parameters, weights)
    (base,) = [key for key in weights if key.endswith("layers.0.self_attn.q_proj.base_layer.weight")]
    a, b = weights[base.replace("base_layer", "lora_A.default")], weights[base.replace("base_layer", "lora_B.default")]
    expected = weights[base] + (4.0 / 2) * b @ a
    assert torch.allclose(drafter.state_dict()["layers.0.self_attn.q_proj.weight"], expected, atol=1e-5)
