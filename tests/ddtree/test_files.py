"""ddtree/files.py's staged folders: what a writer killed outright (SIGKILL, the OOM killer) leaves is removed by the
next writer of the same folder on the same host, and nothing another writer may still be using; and its strict JSON.

    .venv/bin/pytest -q tests/ddtree/test_files.py
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree.errors import DDTreeError
from ddtree.files import (WriteFailed, atomic_file, cache_dir, check_output_file, check_output_folder,
                          files_an_export_would_lose, format_bytes, free_bytes, not_a_file, path_argument,
                          read_yaml_mapping, refused_write_as_error, staged_folder, staging_owner,
                          write_results_json)

ROOT = Path(__file__).resolve().parents[2]

KILLED_WRITER = """
import pathlib, sys, time
from ddtree.files import staged_folder, staging_owner
with staged_folder(sys.argv[1]) as staging:
    (staging / "model.safetensors").write_bytes(b"0" * 4096)
    marker = pathlib.Path(sys.argv[2])
    marker.with_name("marker.tmp").write_text(str(staging))
    marker.with_name("marker.tmp").replace(marker)  # whole when it appears: the test reads it as soon as it exists
    time.sleep(60)
"""


def a_dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid  # (a PID is reused only after the kernel's counter wraps: not within a test)


def test_a_staging_folder_a_sigkilled_writer_left_is_removed_by_the_next_writer(tmp_path, capsys):
    """SIGKILL skips staged_folder's clean-up: the export's, merge's or conversion's hidden staging folder (up to the
    drafter's or dataset's size) stayed beside the destination for good. The next write of that folder removes it."""
    out, marker = tmp_path / "drafter", tmp_path / "staging"
    writer = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(out), str(marker)],
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not marker.exists() and writer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    left = Path(marker.read_text())
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert left.is_dir() and left.parent == tmp_path and left.name.startswith(".drafter-")  # what the kill left
    with staged_folder(out) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["drafter", "staging"]
    err = capsys.readouterr().err.strip()
    assert err == (f"[ddtree] removed {left}: what process {writer.pid} left of drafter when it was killed while "
                   "writing it"), err


def test_staging_folders_a_writer_may_still_be_using_are_left_alone(tmp_path, capsys):
    """Only this host's (and PID namespace's) folders of this destination whose process is gone: a running process's,
    another host's (a shared file system), another destination's, and a name staged_folder does not make stay."""
    host, namespace, _ = staging_owner().split(".")
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = a_dead_pid()
    try:
        kept = [tmp_path / f".drafter-{host}.{namespace}.{running.pid}-abcd1234",  # its writer still runs
                tmp_path / f".drafter-{host}x.{namespace}.{dead}-abcd1234",  # another host's
                tmp_path / f".drafter-{host}.{namespace}1.{dead}-abcd1234",  # another PID namespace's
                tmp_path / f".drafter-x-{host}.{namespace}.{dead}-abcd1234",  # destination drafter-x's
                tmp_path / ".drafter-abcd1234",  # named before writers were recorded: the age rule of a cache's
                tmp_path / f".drafter-{host}.{namespace}.{dead}-notes"]  # not mkdtemp's 8 characters
        removed = tmp_path / f".drafter-{host}.{namespace}.{dead}-abcd1234"
        for folder in (*kept, removed):
            folder.mkdir()
            (folder / "half").write_bytes(b"0")
        with staged_folder(tmp_path / "drafter") as staging:
            (staging / "config.json").write_text("{}")
    finally:
        running.kill()
        running.wait()
    assert all(folder.is_dir() for folder in kept) and not removed.exists()
    assert (tmp_path / "drafter" / "config.json").is_file()
    assert capsys.readouterr().err.count("[ddtree] removed") == 1


def test_a_staging_folder_of_another_users_running_writer_is_left_alone(tmp_path, monkeypatch, capsys):
    """os.kill(pid, 0) on another user's process raises PermissionError, not ProcessLookupError: in a shared cache or
    output folder that writer is running, and removing its folder would fail it."""
    host, namespace, _ = staging_owner().split(".")
    theirs = a_dead_pid()  # answers as another user's live process below; without that answer it would be removed
    kill = os.kill

    def not_permitted(pid, signal_number):
        if pid == theirs:
            raise PermissionError(errno.EPERM, "Operation not permitted")
        return kill(pid, signal_number)

    monkeypatch.setattr(os, "kill", not_permitted)
    folder = tmp_path / f".drafter-{host}.{namespace}.{theirs}-abcd1234"
    folder.mkdir()
    with staged_folder(tmp_path / "drafter") as staging:
        (staging / "config.json").write_text("{}")
    assert folder.is_dir()
    assert capsys.readouterr().err == ""


def test_a_killed_writers_staging_folder_is_removed_on_a_host_whose_name_has_dashes(tmp_path, monkeypatch, capsys):
    """Cluster hosts are named gpu-node-7.cluster: the name a staging folder records must parse back (no '-' or '.'
    in its host), or a SIGKILLed writer's folder there was never recognised as this host's and stayed for good."""
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-node-7.cluster")
    host, namespace, _ = staging_owner().split(".")
    assert host == "gpu_node_7"
    left = tmp_path / f".drafter-{host}.{namespace}.{a_dead_pid()}-abcd1234"
    left.mkdir()
    with staged_folder(tmp_path / "drafter") as staging:
        (staging / "config.json").write_text("{}")
    assert not left.exists()
    assert capsys.readouterr().err.count("[ddtree] removed") == 1


def test_containers_sharing_a_hostname_name_their_staging_folders_apart(monkeypatch):
    """Containers on one host may share its name, each with PIDs of its own: the PID namespace in the name keeps one
    container's writer from taking another's live writer (the same PID, gone in its own namespace) for dead."""
    def owner_in(namespace: str) -> str:
        monkeypatch.setattr(os, "readlink", lambda path: f"pid:[{namespace}]")
        return staging_owner()

    assert owner_in("4026531836") != owner_in("4026532741")
    assert owner_in("4026531836").split(".")[1] == "4026531836"


def test_a_folder_whose_rename_into_place_fails_puts_the_old_one_back(tmp_path, monkeypatch):
    """The old folder is renamed aside before the new one's rename, which can still fail (EBUSY, EXDEV, EACCES): the
    earlier export is then back under its name, not left under a hidden one."""
    out = tmp_path / "export"
    out.mkdir()
    (out / "model.safetensors").write_text("the old export")
    rename = Path.rename

    def busy(self, target):
        if self.name.startswith(".export-"):  # the staging folder's (the old one goes aside as .export.replaced-)
            raise OSError(errno.EBUSY, "Device or resource busy")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", busy)
    with pytest.raises(OSError), staged_folder(out) as staging:
        (staging / "model.safetensors").write_text("the new export")
    assert (out / "model.safetensors").read_text() == "the old export"
    assert [path.name for path in tmp_path.iterdir()] == ["export"]


def test_an_aside_an_earlier_delete_left_does_not_block_the_next_replacement(tmp_path, monkeypatch):
    """Each replaced folder goes aside under a name of its own: one name for all, the aside a failed delete left (a
    file held open on NFS) made every later export of that folder fail at its last rename, after all the work."""
    out = tmp_path / "export"
    rmtree = shutil.rmtree

    def refusing(path, *args, **kwargs):
        if ".replaced-" in Path(path).name and not kwargs.get("ignore_errors"):
            raise PermissionError(errno.EPERM, "Operation not permitted", str(Path(path) / "held"))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", refusing)
    for version in ("first", "second", "third"):
        with staged_folder(out) as staging:
            (staging / "model.safetensors").write_text(version)
    assert (out / "model.safetensors").read_text() == "third"
    asides = sorted((path / "model.safetensors").read_text() for path in tmp_path.glob(".export.replaced-*"))
    assert asides == ["first", "second"]


def test_an_output_file_in_a_folder_that_can_be_read_but_not_written_is_refused_before_the_work(tmp_path, monkeypatch):
    """A read-only mount still lets a process read and enter its folders: the check asks for write access, or the
    results were refused only after the decode. (Simulated per access mode: root may write anywhere.)"""
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: not (Path(path) == tmp_path and mode & os.W_OK)
                        and access(path, mode))
    out = tmp_path / "results.json"
    with pytest.raises(DDTreeError, match=rf"^cannot write {out}: {tmp_path} is not writable here"):
        check_output_file(out)


@pytest.mark.parametrize("text", ["", "# a recipe of comments alone\n", "\n\n"])
def test_a_yaml_file_of_nothing_but_comments_or_blanks_is_no_settings(tmp_path, text):
    """An empty recipe (or config.yaml) sets nothing: every setting keeps its default."""
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    assert read_yaml_mapping(path) == {}


def test_a_nan_or_an_infinity_in_results_is_written_as_null(tmp_path):
    """A prompt with no verification round has a NaN tau. Left in, json.dump(allow_nan=False) raises a ValueError
    after the whole decode, one that is no WriteFailed, so not even the stdout fallback keeps the results."""
    path = tmp_path / "results.json"
    write_results_json(path, {"tau": math.nan, "per_prompt": (1.0, math.inf), "nested": [{"x": -math.inf}]})
    written = json.loads(path.read_text(), parse_constant=pytest.fail)  # a bare NaN or Infinity fails here
    assert written == {"tau": None, "per_prompt": [1.0, None], "nested": [{"x": None}]}


def test_free_space_is_the_disk_the_path_would_be_made_on(tmp_path, monkeypatch):
    """Feature extraction checks its disk before writing, and a full disk's error says how much is free: measured
    elsewhere (the working folder, another mount), a full disk passes the check and the figures mislead."""
    measured = []
    monkeypatch.setattr("shutil.disk_usage", lambda path: measured.append(Path(path)) or SimpleNamespace(free=0))
    monkeypatch.chdir(tmp_path.parent)
    (tmp_path / "out").mkdir()
    free_bytes(tmp_path / "out" / "features" / "shard-0")
    assert measured == [tmp_path / "out"]


def test_files_and_folders_written_in_one_step_take_the_users_umask(tmp_path):
    """mkstemp and mkdtemp make their files 0600 and folders 0700, whatever the umask: a shared group's results and
    exports would be readable by their writer alone. Given the mode open() and mkdir() would give, and no more: a
    umask of 027 keeps them from other users."""
    umask = os.umask(0o027)
    try:
        with atomic_file(tmp_path / "results.json") as handle:
            handle.write("{}")
        with staged_folder(tmp_path / "export") as staging:
            (staging / "weights").mkdir()
            (staging / "weights" / "model.safetensors").write_text("weights")
    finally:
        os.umask(umask)
    modes = {path.relative_to(tmp_path).as_posix(): path.stat().st_mode & 0o777 for path in tmp_path.rglob("*")}
    assert modes == {"results.json": 0o640, "export": 0o750, "export/weights": 0o750,
                     "export/weights/model.safetensors": 0o640}


def test_a_link_in_a_staged_folder_leaves_the_mode_of_the_file_it_points_to(tmp_path):
    """The umask is given to what the folder holds, not through a link it holds to a file elsewhere: chmod follows
    links, and a private file outside (0600, a token say) would have been made readable to the group."""
    private = tmp_path / "elsewhere" / "secret"
    private.parent.mkdir()
    private.write_text("hf_secret")
    private.chmod(0o600)
    umask = os.umask(0o022)
    try:
        with staged_folder(tmp_path / "export") as staging:
            (staging / "secret").symlink_to(private)
    finally:
        os.umask(umask)
    assert (tmp_path / "export" / "secret").is_symlink() and private.stat().st_mode & 0o777 == 0o600


def test_an_atomic_file_reaches_the_disk_before_it_takes_the_name(tmp_path, monkeypatch):
    """Renamed before an fsync, a machine that stops (a crash, a preemption) can leave results.json naming a file
    cut short, where the old one was whole: the bytes written are synced, then renamed."""
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.fstat(fd).st_size))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", Path(dst).name))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    with atomic_file(tmp_path / "results.json") as handle:
        handle.write("{}")
    assert events == [("fsync", 2), ("replace", "results.json")]


def test_a_full_disk_behind_torchs_own_error_is_one_line_with_the_disks_reason(tmp_path):
    """torch.save into a file object turns the full disk's OSError into a RuntimeError raised while handling it, whose
    text says only that the write stopped short: the OSError it was raised from names the reason and so the remedy."""
    path = tmp_path / "weights.pt"
    with pytest.raises(DDTreeError) as raised:
        with atomic_file(path, "wb"):
            try:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 201600 vs 201488")
    line = str(raised.value)
    assert line.startswith(f"cannot write {path} (No space left on device; ") and line.endswith(
        " free): free some space there, or give another path")
    assert list(tmp_path.iterdir()) == []


def test_not_a_file_says_what_was_found_where_an_input_file_was_meant(tmp_path):
    """Every input check said "no such file" of a folder (eval.prompts=data/, --calibration out/), sending the user to
    look for a typo in a path that is there."""
    (tmp_path / "file.jsonl").write_text("{}\n")
    (tmp_path / "folder").mkdir()
    os.mkfifo(tmp_path / "pipe")
    assert not_a_file(tmp_path / "file.jsonl") is None
    assert not_a_file(tmp_path / "folder") == "a folder, not a file"
    assert not_a_file(tmp_path / "missing.jsonl") == "no such file"
    assert not_a_file(tmp_path / "pipe") == "not a regular file"  # read twice where pipes are not asked for
    assert not_a_file(tmp_path / "pipe", pipe_ok=True) is None
    assert not_a_file(tmp_path / "folder", pipe_ok=True) == "a folder, not a file"


def write_refusal(path: Path) -> str:
    """The one line an atomic write to `path` is refused with."""
    with pytest.raises(DDTreeError) as error, atomic_file(path) as handle:
        handle.write("{}")
    return str(error.value)


def test_a_file_where_a_folder_of_the_path_goes_is_named_not_the_folder_mkdir_could_not_make(tmp_path):
    """mkdir's error names the deepest folder it cannot make ("Not a directory: .../sub"), not the file in the way."""
    (tmp_path / "results.json").write_text("the user's file")
    out = tmp_path / "results.json" / "sub" / "step-100.json"
    assert write_refusal(out) == (f"cannot write {out}: {tmp_path / 'results.json'} is a file, not a folder; give a "
                                  "path in a writable folder")


def test_a_folder_that_cannot_be_made_is_named_with_the_oss_reason(tmp_path):
    """A name too long to make: the OS's reason and the folder it names, one line (its look-up for a file in the way
    raised ENAMETOOLONG too, a traceback)."""
    too_long = tmp_path / ("a" * 300)
    assert write_refusal(too_long / "results.json") == (f"cannot write {too_long / 'results.json'}: "
                                                        f"{os.strerror(errno.ENAMETOOLONG)} ({too_long}); give a path "
                                                        "in a writable folder")


@pytest.mark.parametrize("text", ["", "  ", "\t"])
def test_a_path_flag_of_nothing_but_blanks_is_refused(text):
    """A path of blanks only (a variable holding a space) names no file anyone meant: refused as an empty one is."""
    with pytest.raises(argparse.ArgumentTypeError, match="expected a path, got an empty string"):
        path_argument(text)


@pytest.mark.parametrize("name", ["a" * 300 + "/results.json", "a" * 300 + ".json"])
def test_a_results_path_too_long_to_look_up_is_refused_before_the_work_in_one_line(tmp_path, name):
    """`--out` with a name over 255 bytes: its look-up before the work (is it a folder?) raised ENAMETOOLONG, a
    traceback, where the OS's reason belongs in the usual one line."""
    with pytest.raises(DDTreeError) as error:
        check_output_file(tmp_path / name)
    assert str(error.value) == (f"cannot write {tmp_path / name}: {os.strerror(errno.ENAMETOOLONG)}; give a path in "
                                "a writable folder")


@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_file_or_a_link_where_the_folder_goes_is_refused_before_the_work_and_kept(tmp_path, kind):
    """An export or a conversion into a path a file holds (OUT=results.json), let through, would rename the file aside
    to a hidden name, put the folder in its place and warn that the file could not be deleted: the user's file gone
    from its name, and found out only after the work."""
    out = tmp_path / "results.json"
    if kind == "file":
        out.write_text("the user's file")
    else:
        out.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    worked = []
    with pytest.raises(DDTreeError) as error, staged_folder(out) as staging:
        worked.append(staging)
    assert str(error.value) == (f"{out} exists and is not a folder (a file or a link): give a folder path, or remove "
                                "it first")
    assert worked == []
    assert [path.name for path in tmp_path.iterdir()] == ["results.json"]
    assert out.is_symlink() if kind == "link" else out.read_text() == "the user's file"


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_ddtree_cache_is_the_default_cache_not_the_working_folder(tmp_path, monkeypatch, value):
    """`DDTREE_CACHE= make train` (or an `export DDTREE_CACHE=` left in a profile) reads as unset, as an empty
    XDG_CACHE_HOME does: taken as a path, "" is the working folder, and converted targets and feature stores (gigabytes
    at recipe scale) were written into the checkout without a word."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DDTREE_CACHE", value)
    assert cache_dir() == tmp_path / ".cache" / "ddtree"


def test_a_ddtree_cache_under_home_is_expanded(tmp_path, monkeypatch):
    """A quoted `DDTREE_CACHE="~/scratch/ddtree"` reaches the process with its tilde: taken as it is, the cache was a
    folder named "~" in the working folder."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("DDTREE_CACHE", "~/scratch/ddtree")
    assert cache_dir() == tmp_path / "scratch" / "ddtree"


def test_a_users_file_named_like_a_download_extra_counts_as_what_an_export_would_lose(tmp_path):
    """Only .cache/huggingface itself (what a Hub download leaves) may go with an earlier export: a user's
    .cache/huggingface-notes.txt beside it is theirs, and --overwrite must refuse rather than delete it."""
    (tmp_path / "config.json").write_text(json.dumps({"dflash_config": {}}))
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "huggingface-notes.txt").write_text("mine")
    assert files_an_export_would_lose(tmp_path) == [".cache/"]


def test_a_config_with_block_size_alone_is_an_earlier_export(tmp_path):
    """A drafter config is told by either field: one saved before dflash_config existed holds block_size alone, and
    its folder is an earlier export that --overwrite may replace, not a folder of the user's files."""
    (tmp_path / "config.json").write_text(json.dumps({"block_size": 16}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert files_an_export_would_lose(tmp_path) == []


def test_the_refusal_counts_the_files_it_does_not_name(tmp_path):
    """The error names five of the files replacing the folder would delete and counts the rest, so that count must
    be of those left unnamed: seven files are five named and 2 more."""
    for n in range(7):
        (tmp_path / f"notes-{n}.txt").write_text("mine")
    with pytest.raises(DDTreeError, match=r"notes-4\.txt and 2 more;"):
        check_output_folder(tmp_path, overwrite=True)


def test_free_space_under_a_gigabyte_is_given_in_megabytes():
    """A full disk's line says how much is free: a few megabytes read as "0.0 MB" said the disk had nothing left
    when it had room for a smaller file."""
    assert format_bytes(5_300_000) == "5.3 MB"
    assert format_bytes(2_500_000_000) == "2.50 GB"


def test_a_write_to_a_read_only_filesystem_is_one_line_saying_to_make_it_writable(tmp_path):
    """A read-only mount (a finished job's scratch, a squashfs) refuses a write as a full disk does: the user's to
    fix, so one line with what to do, not a traceback that reads as a bug."""
    with pytest.raises(WriteFailed) as failure:
        with refused_write_as_error(tmp_path / "results.json"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / "results.json"))
    assert failure.value.remedy == "make its filesystem writable"
    assert str(failure.value).startswith(f"cannot write {tmp_path / 'results.json'} (Read-only file system")
