"""A disk that fills while torch.save writes a checkpoint or the tokenized cache: one line, nothing half-written left.

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
import os
import tempfile
from types import SimpleNamespace

import pytest
import torch

import ddtree.files
import toy_data  # tests/training/toy_data.py
from ddtree.errors import DDTreeError
from ddtree.files import os_error_in
from training.checkpoints import AtomicCheckpointIO
from training.data import DistillDataModule

ROOM = 16 * 1024  # bytes free on the modelled disk: less than a checkpoint or the tokenized cache needs


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


def fill_disk(monkeypatch) -> None:
    """full_disk from this point on (tests/training/test_eval_callback.py fills it in the middle of a run)."""
    staged = set()
    real_fdopen = os.fdopen

    def mkstemp(*args, **kwargs):
        descriptor, name = tempfile.mkstemp(*args, **kwargs)
        staged.add(descriptor)
        return descriptor, name

    def fdopen(descriptor, mode="r", *args, **kwargs):
        if descriptor not in staged:
            return real_fdopen(descriptor, mode, *args, **kwargs)
        staged.discard(descriptor)
        buffered = io.BufferedWriter(DiskWithRoom(descriptor, ROOM))
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
