"""A disk that fills while a file is written (a checkpoint, the tokenized cache, bench's, calibrate's or make eval's
results, a converted target): one line, nothing half-written left, and nothing that was measured lost.

    OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/training/test_disk_full.py -q

On a real full disk (a 120 MB tmpfs filled to 700 KB free) torch.save, writing into a file object, turns the OS's
ENOSPC into a RuntimeError ("[enforce fail at inline_container.cc:672] unexpected pos") raised while handling it: a
test that raised a bare OSError in place of torch.save passed while the real failure was a traceback. Here the files
are real, on a disk modelled with ROOM bytes free: the OS's writes succeed up to it, cut one short, then fail with
ENOSPC, and torch.save itself raises what it raises on the tmpfs. (/dev/full fails every write, the first buffered
bytes too, so the file's close raises a second OSError over torch's RuntimeError: not what a full disk does.)
"""

from __future__ import annotations

import errno
import io
import json
import os
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import SafetensorError

import ddtree.cli
import ddtree.files
import toy_data  # tests/training/toy_data.py
import training.evaluate
from ddtree.calibration import CALIBRATION_FILE, load_calibration
from ddtree.errors import DDTreeError
from ddtree.files import os_error_in, write_failure
from ddtree.modeling_dflash import DFlashDraftModel
from ddtree.targets import build_drafter_config, save_converted
from training.checkpoint_paths import SAVING_MARKER
from training.checkpoints import AtomicCheckpointIO
from training.data import DistillDataModule

ROOM = 16 * 1024  # bytes free on the modelled disk: less than a checkpoint or the tokenized cache needs
FREE = r"\d+\.\d+ [MG]B free"  # the free space a line names (of the real disk under tmp_path, which others share)


class DiskWithRoom(io.FileIO):
    """A file on a disk with `room` bytes free, written as the OS writes it: whole, then one short write, then ENOSPC."""

    def __init__(self, descriptor: int, room: int):
        super().__init__(descriptor, "wb")
        self.room = room

    def write(self, data) -> int:
        data = memoryview(data)
        if not self.room and len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = super().write(data[:self.room])
        self.room -= written
        return written


@pytest.fixture
def full_disk(monkeypatch):
    """Every file ddtree.files.atomic_file stages (where checkpoints and the tokenized cache are written) lies on a disk
    with ROOM bytes free; every other file is as it was."""
    fill_disk(monkeypatch)


def fill_disk(monkeypatch, under: Path | None = None, room: int = ROOM) -> None:
    """full_disk from this point on (tests/training/test_eval_callback.py fills it in the middle of a run); only for
    the files staged `under` a folder where given (the system's temporary folder, say, is on another disk), with
    `room` bytes free."""
    staged = set()
    real_fdopen = os.fdopen

    def mkstemp(*args, **kwargs):
        descriptor, name = tempfile.mkstemp(*args, **kwargs)
        if under is None or Path(name).is_relative_to(under):
            staged.add(descriptor)
        return descriptor, name

    def fdopen(descriptor, mode="r", *args, **kwargs):
        if descriptor not in staged:
            return real_fdopen(descriptor, mode, *args, **kwargs)
        staged.discard(descriptor)
        buffered = io.BufferedWriter(DiskWithRoom(descriptor, room))
        return buffered if "b" in mode else io.TextIOWrapper(buffered, **kwargs)

    monkeypatch.setattr(ddtree.files, "tempfile", SimpleNamespace(mkstemp=mkstemp, mkdtemp=tempfile.mkdtemp))
    monkeypatch.setattr(os, "fdopen", fdopen)


def test_a_checkpoint_save_on_a_full_disk_is_one_line_and_keeps_the_previous_one(tmp_path, full_disk):
    path = tmp_path / "checkpoints" / "last.ckpt"
    path.parent.mkdir()
    torch.save({"global_step": 2}, path)  # the previous save, whole
    with pytest.raises(DDTreeError) as error:
        AtomicCheckpointIO().save_checkpoint({"global_step": 4, "weights": torch.zeros(100_000)}, path)
    assert str(error.value) == (f"cannot write the checkpoint {path}: No space left on device; the previous checkpoints "
                                "are whole: make room and resume the run (--resume <run folder>)")
    assert [p.name for p in path.parent.iterdir()] == ["last.ckpt"]  # no staging file left
    assert torch.load(path)["global_step"] == 2


def test_a_first_checkpoint_save_on_a_full_disk_says_to_start_the_run_again(tmp_path, full_disk):
    """With no checkpoint saved before, `--resume <run folder>` answers that the run has no checkpoint yet."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("seed_everything: 0\n")
    path = run / "checkpoints" / "step-5.ckpt"
    with pytest.raises(DDTreeError) as error:
        AtomicCheckpointIO().save_checkpoint({"global_step": 5, "weights": torch.zeros(100_000)}, path)
    assert str(error.value) == (f"cannot write the checkpoint {path}: No space left on device; the run holds no "
                                "checkpoint yet: make room and start it again (the same command)")
    assert list((run / "checkpoints").iterdir()) == []


def test_a_tokenized_cache_on_a_full_disk_is_one_line_naming_the_setting(tmp_path, full_disk):
    data = toy_data.write_conversations(tmp_path / "conversations.jsonl", 200, 10, 40)  # ~40 KB tokenized
    cache = tmp_path / "tokenized"
    dm = DistillDataModule(target="tiny-random", data_path=str(data), max_length=128, cache_dir=str(cache))
    with pytest.raises(DDTreeError) as error:
        dm.prepare_data()
    message = str(error.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"cannot write the tokenized cache {dm.cache_path(dm.load_tokenizer())} (No space left "
                              "on device; ")
    assert message.endswith("free some space there, or set data.cache_dir to a folder on a disk with room")
    assert [p.name for p in cache.iterdir()] == ["digests.json"]  # (small) no staging file, no cache cut short


def test_the_os_error_behind_a_failure_is_found_where_it_was_raised_from_or_while_handling():
    def chained(error: BaseException, context: BaseException | None = None, cause: BaseException | None = None):
        error.__context__, error.__cause__ = context, cause  # as `raise error from cause` inside `except context`
        return error

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert os_error_in(full) is full
    assert os_error_in(chained(RuntimeError("unexpected pos"), context=full)) is full  # torch.save's
    assert os_error_in(chained(RuntimeError("wrapped"), cause=full)) is full
    assert os_error_in(chained(RuntimeError("a bug"), context=KeyError("x"))) is None


def test_the_os_error_behind_a_failed_write_is_read_from_safetensors_and_torch_too():
    quota = write_failure(SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)"))
    assert quota.errno == errno.EDQUOT and quota.strerror == os.strerror(errno.EDQUOT)
    # torch.save into a path (DeepSpeed's shards) on a full disk: its C++ writer names no errno
    short = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 201600 vs 201488")
    short.__context__ = RuntimeError("basic_ios::clear: iostream error")
    assert write_failure(short).errno is None and "unexpected pos 201600 vs 201488" in str(write_failure(short))
    # safetensors' I/O error without the OS's code: still a failed write (no errno to say which), not a traceback
    unnumbered = write_failure(SafetensorError("Error while serializing: I/O error: No space left on device"))
    assert unnumbered.errno is None and str(unnumbered) == "No space left on device"
    assert write_failure(SafetensorError("invalid tensor layout")) is None  # bugs keep their traceback
    assert write_failure(RuntimeError("a bug")) is None
    assert write_failure(OSError("Can't load tokenizer")) is None  # (transformers' OSErrors name no errno)


def test_any_file_the_disk_refuses_is_one_line_and_leaves_no_staging_file(tmp_path, full_disk):
    """Every other writer (a run's data.json and drafter/, make export, data/regenerate.py, the ablation tables, ...)
    let the OSError through: a traceback (found in a review)."""
    path = tmp_path / "data.json"
    with pytest.raises(DDTreeError) as error:
        ddtree.files.write_json_atomic(path, {"rows": list(range(10_000))})
    assert re.fullmatch(re.escape(f"cannot write {path} (No space left on device; ") + FREE
                        + re.escape("): free some space there, or give another path"), str(error.value)), error.value
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("failure, raised", [
    (OSError(errno.EFBIG, os.strerror(errno.EFBIG)), DDTreeError),  # a file-size limit (ulimit -f)
    (OSError(errno.EIO, os.strerror(errno.EIO)), OSError),  # a failing disk, not a place to make room in: a traceback
])
def test_a_folder_the_disk_refuses_names_the_folder_not_its_staging_name(tmp_path, failure, raised):
    out = tmp_path / "drafter"
    with pytest.raises(raised) as error:
        with ddtree.files.staged_folder(out) as staging:
            (staging / "config.json").write_text("{}")
            raise failure
    if raised is DDTreeError:
        assert str(error.value).startswith(f"cannot write {out} (File too large; ")
        assert str(error.value).endswith("): raise the file-size limit (ulimit -f), or give another path")
    assert list(tmp_path.iterdir()) == []


def test_a_file_the_disk_refuses_inside_a_staged_folder_names_the_folder(tmp_path, full_disk):
    """A writer that fills its staged folder with atomic files: the line names the folder, not the file inside the
    staging folder, a hidden path that is gone by the time the line is read."""
    out = tmp_path / "drafter"
    with pytest.raises(DDTreeError) as error, ddtree.files.staged_folder(out) as staging:
        ddtree.files.write_json_atomic(staging / "config.json", {"rows": list(range(10_000))})
    assert re.fullmatch(re.escape(f"cannot write {out} (No space left on device; ") + FREE
                        + re.escape("): free some space there, or give another path"), str(error.value)), error.value
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the target cache and DeepSpeed


class Unsaveable:
    """A converted target (and its tokenizer) whose save fails as `failure`."""

    def __init__(self, failure: Exception):
        self.failure = failure

    def save_pretrained(self, folder):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise self.failure

    def get_memory_footprint(self) -> int:
        return 13 * 2**20


@pytest.mark.parametrize("failure, said, remedy", [
    (OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), os.strerror(errno.EDQUOT),
     "free some space within your disk quota"),
    # what safetensors says under `ulimit -f`
    (SafetensorError("Error while serializing: I/O error: File too large (os error 27)"), os.strerror(errno.EFBIG),
     "raise the file-size limit (ulimit -f)"),
])
def test_a_target_conversion_over_a_quota_or_a_file_size_limit_is_one_line(tmp_path, failure, said, remedy):
    """Only ENOSPC was one line: a quota (EDQUOT) or a file-size limit (EFBIG) was a traceback (found in a review)."""
    folder = tmp_path / "targets" / "tiny"
    with pytest.raises(DDTreeError) as error:
        save_converted(Unsaveable(failure), Unsaveable(failure), folder, {"source": "x"})
    assert re.fullmatch(re.escape(f"cannot save the converted target tiny in {folder.parent} ({said}; ") + FREE
                        + re.escape(f"; it needs about 13 MiB): {remedy}, or set DDTREE_CACHE to a folder on another "
                                    "disk"), str(error.value)), str(error.value)
    assert list(folder.parent.iterdir()) == []  # neither the target nor a staging folder


@pytest.mark.parametrize("earlier", [True, False])
def test_a_deepspeed_checkpoint_the_disk_refuses_is_one_line_and_keeps_its_marker(tmp_path, monkeypatch, earlier):
    """torch.save into DeepSpeed's shard files says only "unexpected pos" on a full disk: a 90-line traceback from
    every rank (found in a review). One line, as AtomicCheckpointIO's; the folder cut short keeps its marker, and it
    is no checkpoint to resume from (its `latest` is an earlier save's)."""
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from training.strategies import DrafterDeepSpeed

    def full_disk_save(self, checkpoint, filepath, storage_options=None):
        try:
            raise RuntimeError("basic_ios::clear: iostream error")
        except RuntimeError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 201600 vs 201488")

    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", full_disk_save)
    monkeypatch.setattr(DrafterDeepSpeed, "is_global_zero", True)
    monkeypatch.setattr(DrafterDeepSpeed, "barrier", lambda self, name=None: None)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("seed_everything: 0\n")
    for name in ["last.ckpt"] + (["step-2.ckpt"] if earlier else []):  # whole DeepSpeed folders of earlier saves
        (run / "checkpoints" / name).mkdir(parents=True)
        (run / "checkpoints" / name / "latest").write_text("global_step2")
    path = run / "checkpoints" / "last.ckpt"
    with pytest.raises(DDTreeError) as error:
        object.__new__(DrafterDeepSpeed).save_checkpoint({}, path)  # no engine: only the save's failure is under test
    then = ("the previous checkpoints are whole: make room and resume the run (--resume <run folder>)" if earlier else
            "the run holds no checkpoint yet: make room and start it again (the same command)")
    assert str(error.value) == (f"cannot write the checkpoint {path}: the write stopped short (torch: unexpected pos "
                                f"201600 vs 201488); {then}")
    assert (path / SAVING_MARKER).is_file()


def test_a_deepspeed_save_that_fails_for_another_reason_keeps_its_traceback(tmp_path, monkeypatch):
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from training.strategies import DrafterDeepSpeed

    def failing_save(self, checkpoint, filepath, storage_options=None):
        raise RuntimeError("a bug")

    monkeypatch.setattr(DeepSpeedStrategy, "save_checkpoint", failing_save)
    monkeypatch.setattr(DrafterDeepSpeed, "is_global_zero", True)
    monkeypatch.setattr(DrafterDeepSpeed, "barrier", lambda self, name=None: None)
    with pytest.raises(RuntimeError, match="a bug"):
        object.__new__(DrafterDeepSpeed).save_checkpoint({}, tmp_path / "last.ckpt")


# ----------------------------------------------------------------------------- what was measured is kept


@pytest.fixture
def other_temporary_folder(tmp_path, monkeypatch):
    """The system's temporary folder ($TMPDIR), on a disk with room."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def error_lines(capsys) -> tuple[str, list[str]]:
    """stdout, and the lines of stderr that say an error (not the progress bars)."""
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return captured.out, [line for line in captured.err.splitlines() if line.startswith("error")]


@pytest.mark.parametrize("temporary_folder_full", [False, True])
def test_bench_results_the_disk_refuses_are_one_line_and_kept(tmp_path, monkeypatch, capsys, other_temporary_folder,
                                                              temporary_folder_full):
    """The decode ran, then the write of --out failed with a traceback and every result was lost (found in a
    review). They go to the temporary folder, or, where that is full too, to stdout."""
    full = tmp_path / "full"
    full.mkdir()
    fill_disk(monkeypatch, under=None if temporary_folder_full else full, room=0)
    out = full / "b.json"
    status = ddtree.cli.main(["bench", "--target", "tiny-random", "--drafter", "random", "--prompts",
                              "data/eval_prompts.jsonl", "--limit", "1", "--methods", "ar,ddtree", "--budgets", "4",
                              "--max-new-tokens", "4", "--dtype", "float32", "--out", str(out)])
    stdout, err = error_lines(capsys)
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot write {out} (No space left on device; ")
    if temporary_folder_full:
        assert err[0].endswith("the results are printed above, on stdout: free some space there, or give another --out")
        results = json.loads(stdout[stdout.index("\n{") + 1:])
        assert list(other_temporary_folder.iterdir()) == []  # the copy that failed is not left there
    else:
        (kept,) = other_temporary_folder.glob("ddtree-kept-*/b.json")
        assert err[0].endswith(f"the results are saved in {kept} instead: free some space there, or give another --out")
        results = json.loads(kept.read_text())
    assert set(results["summary"]) == {"ar", "ddtree@4"} and results["settings"]["limit"] == 1
    assert list(full.iterdir()) == []  # no staging file


def test_a_calibration_the_disk_refuses_is_one_line_and_kept(tmp_path, monkeypatch, capsys, tiny_target,
                                                             other_temporary_folder):
    target, tokenizer = tiny_target
    folder = tmp_path / "drafter"
    torch.manual_seed(0)
    DFlashDraftModel(build_drafter_config(target, tokenizer, "tiny-random", num_layers=1)).save_pretrained(folder)
    before = sorted(path.name for path in folder.iterdir())
    fill_disk(monkeypatch, under=folder, room=0)
    status = ddtree.cli.main(["calibrate", "--target", "tiny-random", "--drafter", str(folder), "--prompts",
                              "data/eval_prompts.jsonl", "--limit", "2", "--budgets", "8", "--max-new-tokens", "8",
                              "--dtype", "float32"])
    _, err = error_lines(capsys)
    (kept,) = other_temporary_folder.glob(f"ddtree-kept-*/{CALIBRATION_FILE}")
    assert status == 2 and len(err) == 1, err
    assert re.fullmatch(re.escape(f"error: ddtree calibrate: cannot write {folder / CALIBRATION_FILE} (No space left on "
                                  "device; ") + FREE
                        + re.escape(f"); what was learned is saved in {kept} instead: free some space there and move "
                                    f"it into {folder} (generate and bench take it meanwhile with --calibration "
                                    f"{kept})"), err[0]), err[0]
    assert load_calibration(kept).frozen  # a whole calibration file
    assert sorted(path.name for path in folder.iterdir()) == before


@pytest.fixture
def loose_checkpoint(tmp_path):
    """A checkpoint of a tiny DistillModule outside a run folder: make eval writes beside it, in its eval/."""
    from training.module import DistillModule

    torch.manual_seed(0)
    module = DistillModule(target="tiny-random", num_layers=1, block_size=4, target_layer_ids=[0, 2, 4],
                           target_dtype="float32")
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams), "global_step": 7}
    module.on_save_checkpoint(checkpoint)
    path = tmp_path / "loose" / "x.ckpt"
    path.parent.mkdir()
    torch.save(checkpoint, path)
    return path


def test_make_eval_results_the_disk_refuses_are_one_line_and_kept(loose_checkpoint, monkeypatch, capsys,
                                                                   other_temporary_folder):
    fill_disk(monkeypatch, under=loose_checkpoint.parent, room=0)
    status = training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose_checkpoint), "--limit", "1"])
    _, err = error_lines(capsys)
    out = loose_checkpoint.parent / "eval" / "checkpoint-x-limit1.json"
    (kept,) = other_temporary_folder.glob("ddtree-kept-*/checkpoint-x-limit1.json")
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: cannot write {out} (No space left on device; ")
    assert err[0].endswith(f"the results are saved in {kept} instead: free some space there, or give another --out")
    assert json.loads(kept.read_text())["step"] == 7
    assert list(out.parent.iterdir()) == []


def test_make_evals_default_results_file_that_cannot_be_written_is_refused_before_the_checkpoint_loads(
        loose_checkpoint, monkeypatch, capsys):
    """Only an explicit --out was checked: a run on a read-only mount (someone else's, an archive's) was decoded whole,
    then its <run>/eval/checkpoint-<name>.json failed (found in a review). The mount is simulated: root writes
    anywhere."""
    folder = loose_checkpoint.parent
    access = ddtree.files.os.access
    monkeypatch.setattr(ddtree.files.os, "access", lambda path, mode: Path(path) != folder and access(path, mode))
    monkeypatch.setattr(training.evaluate, "load_checkpoint", lambda path: pytest.fail("loaded the checkpoint first"))
    status = training.evaluate.main(["--recipe", "tiny", "--ckpt", str(loose_checkpoint)])
    _, err = error_lines(capsys)
    assert status == 2 and err == [f"error: cannot write {folder / 'eval' / 'checkpoint-x.json'}: {folder} is not "
                                   "writable here; give --out a path in a writable folder"]
