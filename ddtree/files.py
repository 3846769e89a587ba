"""Writing files so that a reader never sees half of one, with the permissions the user's umask asks for.

    write_json_atomic(run_dir / "eval" / "step-100.json", result)
    with atomic_file(path, "wb") as f: figure.savefig(f)
    with staged_folder(out) as staging: model.save_pretrained(staging)

Temporary files and folders (tempfile.mkstemp/mkdtemp) are created owner-only (0600/0700) for
safety; once renamed into place they would stay so and nobody else on shared storage could read
a run or the cache. Every writer here gives them the modes a plain open()/mkdir() would.

A write the disk refuses (no space, a quota, a file-size limit) is one line, WriteFailed, at every writer here; results
that took a decode to measure are not lost with it (write_results_json).
"""

from __future__ import annotations

import argparse
import codecs
import errno
import json
import math
import os
import re
import shutil
import socket
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path

from safetensors import SafetensorError

from .errors import DDTreeError, error_line
from .names import CALIBRATION_FILE, CORPUS_FILE


def cache_setting() -> str | None:
    """$DDTREE_CACHE as given, or None where it is unset or empty: an empty value counts as unset, as an empty
    XDG_CACHE_HOME does (as a path it was the working folder, and the cache landed in the checkout)."""
    return os.environ.get("DDTREE_CACHE", "").strip() or None


def cache_dir() -> Path:
    """Where converted targets, regenerated data and feature stores live: $DDTREE_CACHE (a leading ~ expanded), else
    ~/.cache/ddtree."""
    given = cache_setting()
    return Path(given).expanduser() if given else Path.home() / ".cache" / "ddtree"


def current_umask() -> int:
    umask = os.umask(0)  # the only way to read it; set straight back
    os.umask(umask)
    return umask


def follow_umask(path: Path, recursive: bool = False) -> None:
    """Give `path` (and, if recursive, everything below it) the mode open()/mkdir() would have given."""
    umask = current_umask()
    paths = [Path(path), *(Path(path).rglob("*") if recursive and Path(path).is_dir() else [])]
    for p in paths:
        if p.is_symlink():
            continue
        p.chmod((0o777 if p.is_dir() else 0o666) & ~umask)


def file_in_the_way(path: Path) -> Path | None:
    """The file standing where one of `path`'s folders should be, if any (nothing can be written under it)."""
    for parent in Path(path).parents:
        try:
            if parent.exists() and not parent.is_dir():
                return parent
        except OSError:  # a name the OS will not look up (ENAMETOOLONG): no file there, and mkdir's error says why
            continue
    return None


def why_unwritable(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (made where missing), in words; None where they can. Asked before
    long work whose result goes there (a decode, a tokenization), which otherwise learns it only at the end."""
    blocker = folder if folder.exists() and not folder.is_dir() else file_in_the_way(folder)
    if blocker is not None:
        return f"{blocker} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return error.strerror or str(error)
    return None if os.access(folder, os.W_OK | os.X_OK) else "the folder is not writable"  # (a read-only mount)


@contextmanager
def unwritable_as_error(path: Path):
    """A place that cannot be written (a file where a folder should be, no permission) as one DDTreeError line."""
    try:
        yield
    except OSError as error:
        # mkdir names the deepest folder it could not make, not the file in the way: find that file.
        blocker = file_in_the_way(path)
        if blocker is not None:
            why = f"{blocker} is a file, not a folder"
        else:
            why = (error.strerror or str(error)) + (f" ({error.filename})" if error.filename else "")
        raise DDTreeError(f"cannot write {path}: {why}; give a path in a writable folder") from None


def os_error_in(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: `error` itself, or one it was raised from or while handling. torch.save into
    a file object turns a full disk's OSError into a RuntimeError ("[enforce fail at inline_container.cc] unexpected
    pos") raised while handling it; None where no OSError is behind it (a bug, not the disk)."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, OSError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def format_bytes(size: float) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


def free_bytes(path: Path) -> int:
    """The free space of the disk `path` is on (or would be, made: its nearest existing folder's)."""
    existing = next(p for p in [path, *path.parents] if p.exists())
    return shutil.disk_usage(existing).free


def write_failure(error: BaseException) -> OSError | None:
    """The OS's error behind a failed write, or None where `error` is no failed write (a bug: it keeps its traceback).

    Three shapes: an OSError with an errno, `error` itself or one it was raised from or while handling (os_error_in);
    safetensors' own error type, the OS's error in its text ("Error while serializing: I/O error: Disk quota exceeded
    (os error 122)"); and torch.save into a path (DeepSpeed's shards), whose C++ writer says only "[enforce fail at
    inline_container.cc:672] . unexpected pos 201600 vs 201488" when the disk takes less than it is given (an OSError
    without an errno here: it does not say why)."""
    cause = os_error_in(error)
    if cause is not None and cause.errno is not None:
        return cause
    text = str(error)
    if isinstance(error, SafetensorError):
        code = re.search(r"\(os error (\d+)\)", text)
        if code:
            return OSError(int(code.group(1)), os.strerror(int(code.group(1))))
        io_error = re.search(r"I/O error: (.+)", text)
        return OSError(io_error.group(1)) if io_error else None
    short = re.search(r"unexpected pos \d+ vs \d+", text)
    if isinstance(error, RuntimeError) and "inline_container" in text and short:
        return OSError(f"the write stopped short (torch: {short.group(0)})")
    return None


# What a place that takes no more bytes answers a write (its errno), and what makes it take them. Only these are one
# line at every writer (refused_write_as_error); anything else keeps its traceback: a failing disk (EIO), a bug.
DISK_REFUSALS = {
    errno.ENOSPC: "free some space there",
    errno.EDQUOT: "free some space within your disk quota",
    errno.EFBIG: "raise the file-size limit (ulimit -f)",
    errno.EROFS: "make its filesystem writable",
}
STOPPED_SHORT = "free some space there (or raise the quota or file-size limit that stopped it)"  # no errno said which


class WriteFailed(DDTreeError):
    """A write the disk refused (DISK_REFUSALS): one line naming the file, the OS's reason, the free space and what to
    do. A writer that knows a better place to point to (a setting, a resume) words its own line from `why` (the reason
    and the free space) and `remedy`."""

    def __init__(self, path: str | Path, cause: OSError):
        self.path, self.cause = Path(path), cause
        self.reason = cause.strerror or str(cause)
        try:
            self.why = f"{self.reason}; {format_bytes(free_bytes(self.path.parent))} free"
        except OSError:  # (the disk cannot say: the reason alone)
            self.why = self.reason
        # (another errno comes only from training/feature_store.py, which words every failed write of a build)
        self.remedy = STOPPED_SHORT if cause.errno is None else DISK_REFUSALS.get(cause.errno, "free some space there")
        super().__init__(f"cannot write {self.path} ({self.why}): {self.remedy}, or give another path")


@contextmanager
def refused_write_as_error(path: str | Path):
    """A write into `path` that the disk refuses (no space, a quota, a file-size limit: DISK_REFUSALS, or a writer
    that says no errno: write_failure) as WriteFailed, one line; anything else keeps its traceback."""
    try:
        yield
    except WriteFailed as failure:  # a write nested in this one (a file inside a staged folder): named as this one
        raise WriteFailed(path, failure.cause) from None
    except DDTreeError:  # a line already (its OSError, raised from None, is still its context: os_error_in finds it)
        raise
    except Exception as error:
        cause = write_failure(error)
        if cause is None or (cause.errno is not None and cause.errno not in DISK_REFUSALS):
            raise
        raise WriteFailed(path, cause) from None


def path_argument(text: str) -> str:
    """argparse type of a path flag: an empty one (`--out "$UNSET"`) is refused, where the flag's truthiness test read
    it as left out (another default path) or Path("") as the working folder; a leading `~` is the home folder, as the
    shell makes it of `--out ~/x` but not of `--out=~/x` (which wrote into a folder named `~` here)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a path, got an empty string (an unset shell variable?)")
    return os.path.expanduser(text)


def path_type(text: str) -> Path:
    """path_argument as a Path, for the flags whose command reads a Path."""
    return Path(path_argument(text))


def home_expanded(text: str) -> str:
    """argparse type of a flag that takes a path or a word ('last', 'best'): a leading `~` is the home folder, as
    path_argument makes it, where an empty value is left to the command's own error (it names the words to give)."""
    return os.path.expanduser(text)


def not_a_file(path: str | Path, pipe_ok: bool = False) -> str | None:
    """Why an input file cannot be read, as the words an error puts after its path: "a folder, not a file", "not a
    regular file" (a device, a socket, or a pipe where pipe_ok is False: one read twice) or "no such file"; None for a
    file one can read. A folder named where a file was meant got "no such file", which sent users looking for a typo."""
    path = Path(path)
    if path.is_file() or (pipe_ok and path.exists() and not path.is_dir()):
        return None
    if path.is_dir():
        return "a folder, not a file"
    return "not a regular file" if path.exists() else "no such file"


def check_output_file(path: str | Path, flag: str = "--out", overwrite: bool | None = None,
                      instead: str = "give a path in a writable folder") -> None:
    """Refuse, before any work, a results file that could not be written at the end: a folder, or a path under a file;
    and, with overwrite=False, a file that exists (a command's own input, say: a drafter's config.json). `instead`:
    what to do about a place that cannot be written."""
    path = Path(path)
    try:
        is_folder = path.is_dir()
    except OSError as error:  # a name the OS will not look up (ENAMETOOLONG): the write at the end fails the same way
        raise DDTreeError(f"cannot write {path}: {error.strerror}; {instead}") from None
    if is_folder:
        raise DDTreeError(f"{flag} {path} is a folder; give a file path for the results JSON")
    if overwrite is False and path.exists():
        raise DDTreeError(f"{flag} {path} exists; pass --overwrite to replace it, or give another path")
    blocker = file_in_the_way(path)
    if blocker is not None:
        raise DDTreeError(f"cannot write {path}: {blocker} is a file, not a folder; {instead}")
    folder = next(parent for parent in path.absolute().parents if parent.exists())  # the file goes there, or below it
    if not os.access(folder, os.W_OK | os.X_OK):  # a read-only mount or no permission: else found after all the work
        raise DDTreeError(f"cannot write {path}: {folder} is not writable here; {instead}")


def json_problem(line: str, error: json.JSONDecodeError) -> str:
    """What is wrong with one line of JSONL, in words: where json stopped, or that the line ends too early."""
    if error.pos >= len(line.rstrip()) or error.msg.startswith("Unterminated string"):
        return "the line ends before the JSON object is complete: was it cut off?"
    return f"{error.msg.removesuffix(' at')} at column {error.colno}"  # some of json's messages end in "at"


def iter_json_lines(path: Path):
    """Yield (line number, "file:line", object) for each non-blank line of a UTF-8 JSONL file; errors name the line.

    Lines are decoded one by one, so a file in another encoding (latin-1, UTF-16) is reported at
    the line and byte where it stops being UTF-8. A leading UTF-8 byte-order mark is allowed.
    """
    try:
        handle = Path(path).open("rb")
    except OSError as error:  # another user's file, say: a PermissionError traceback, from --prompts and --corpus
        raise DDTreeError(f"{path}: cannot be read ({error.strerror or error}); give a file this user can "
                          "read") from None
    with handle as lines:
        offset = 0  # bytes before this line
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            # The mark is cut here, not by the "utf-8-sig" codec, whose error positions count from after it.
            mark = len(codecs.BOM_UTF8) if number == 1 and raw.startswith(codecs.BOM_UTF8) else 0
            try:
                line = raw[mark:].decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as error:
                bad = mark + error.start  # in `raw`
                raise DDTreeError(f"{where}: not UTF-8 (byte 0x{raw[bad]:02x} at byte offset {offset + bad} "
                                  "of the file); save it as UTF-8 JSONL, one JSON object per line") from None
            offset += len(raw)
            if not line.strip():
                continue
            try:
                yield number, where, json.loads(line)
            except json.JSONDecodeError as error:
                raise DDTreeError(f"{where}: not valid JSON ({json_problem(line, error)}); "
                                  "each line must be one JSON object") from None


def read_yaml_mapping(path: str | Path) -> dict:
    """A YAML file of sections (a recipe, a run's config.yaml) as a dict ({} when empty); a file that is not valid
    YAML, whose top level is not a mapping, or that gives a key twice in one mapping is one DDTreeError line naming
    the file and where it broke."""
    import yaml  # (a transformers dependency; only training's files are YAML)

    class UniqueKeyLoader(yaml.SafeLoader):
        """PyYAML (and jsonargparse) keep a repeated key's last value: a second `model:` section appended to a copy
        of a recipe replaced the whole first one, and that run trained a default drafter without a word."""

        def construct_mapping(self, node, deep=False):
            first_lines = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # (`<<:` merges may repeat keys, on purpose)
                key = self.construct_object(key_node)
                line = key_node.start_mark.line + 1
                if key in first_lines:
                    raise DDTreeError(f"{path}: `{key}:` at line {line} repeats the one at line {first_lines[key]} "
                                      "(YAML would keep only the last, dropping the first without a word); give "
                                      "each key once, merged into one")
                first_lines[key] = line
            return super().construct_mapping(node, deep)

    try:
        settings = yaml.load(Path(path).read_text(), Loader=UniqueKeyLoader)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise DDTreeError(f"{path}: not valid YAML{where} ({error.problem or error.context}); fix the file") from None
    except yaml.YAMLError as error:
        raise DDTreeError(f"{path}: not valid YAML ({error_line(error)}); fix the file") from None
    if settings is None:
        return {}
    if not isinstance(settings, dict):
        raise DDTreeError(f"{path}: the top level is a {type(settings).__name__}, not a mapping of sections "
                          "(model:, data:, trainer:, ...); fix the file")
    return settings


@contextmanager
def atomic_file(path: str | Path, mode: str = "w", staging_prefix: str | None = None):
    """Yield a file object beside `path`; on success it replaces `path` in one rename, else it is removed.
    The bytes reach the disk (fsync) before the rename: a machine that stops (a crash, a preemption) leaves the old
    file or the whole new one, never the new name on a file cut short. staging_prefix: the temporary file's name
    prefix (default `.<name>-`)."""
    path = Path(path)
    with unwritable_as_error(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=staging_prefix or f".{path.name}-", dir=path.parent)
    with refused_write_as_error(path):  # outside the clean-up: the free space it names is without the staging file
        try:
            with os.fdopen(fd, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as handle:
                yield handle
                handle.flush()
                os.fsync(handle.fileno())
            follow_umask(Path(staging))
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)


def write_text_atomic(path: str | Path, text: str) -> None:
    with atomic_file(path) as handle:
        handle.write(text)


def finite_json(value):
    """`value` with every NaN and infinity in it as None (null): JSON has no such numbers, and the bare NaN that Python
    writes by default is refused by other readers (jq, JavaScript, most JSON libraries)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


def write_json_atomic(path: str | Path, payload) -> None:
    """Strict JSON: a NaN or an infinity is written as null (finite_json)."""
    with atomic_file(path) as handle:
        json.dump(finite_json(payload), handle, indent=1, allow_nan=False)


def saved_elsewhere(path: Path, write) -> Path | None:
    """Where `write(copy)` put what could not be written to `path`: a file of the same name in a new folder of the
    system's temporary folder ($TMPDIR, else /tmp); None where that failed too."""
    folder = None
    try:
        folder = Path(tempfile.mkdtemp(prefix="ddtree-kept-"))
        write(folder / Path(path).name)
        return folder / Path(path).name
    except (OSError, DDTreeError):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        return None


def write_results_json(path: str | Path, payload, flag: str = "--out") -> None:
    """write_json_atomic for what a command measured (bench, make eval): where the disk refuses it (WriteFailed), the
    minutes or hours of decoding behind it are not lost: the results go to a file in the system's temporary folder
    (saved_elsewhere) or, where that fails too, to stdout, and the error line says where."""
    try:
        write_json_atomic(path, payload)
    except WriteFailed as failure:
        copy = saved_elsewhere(path, lambda copy: write_json_atomic(copy, payload))
        if copy is None:
            print(json.dumps(finite_json(payload), indent=1, allow_nan=False), flush=True)
        where = f"saved in {copy} instead" if copy else "printed above, on stdout"
        raise DDTreeError(f"cannot write {path} ({failure.why}); the results are {where}: {failure.remedy}, or give "
                          f"another {flag}") from None


def staging_owner() -> str:
    """This process as its staging folders' names record it (host.pid-namespace.pid): what lets a later writer on the
    same host tell a folder whose writer is gone (SIGKILL, the OOM killer, a job's hard time limit, all of which skip
    the clean-up) from one another process is still writing. The host has no '.' or '-', so names parse one way."""
    host = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname().split(".")[0])[:32] or "host"  # (names end at 255)
    try:  # containers on one host may share a hostname, each with its own PIDs: the namespace tells them apart
        namespace = re.sub(r"\D", "", os.readlink("/proc/self/ns/pid")) or "0"
    except OSError:
        namespace = "0"
    return f"{host}.{namespace}.{os.getpid()}"


def process_gone(pid: int) -> bool:
    """No process `pid` on this host (in this PID namespace). One of another user's counts as running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def staging_pattern(name: str) -> re.Pattern:
    """The names staged_folder gives the staging folders of a folder called `name`: .<name>-<writer>-<mkdtemp's 8
    characters>, the writer (staging_owner's host.namespace.pid) absent from those made before 2026-12-05."""
    return re.compile(rf"\.{re.escape(name)}-(?:(?P<host>[A-Za-z0-9_]+)\.(?P<namespace>\d+)\.(?P<pid>\d+)-)?"
                      r"[a-z0-9_]{8}")


def remove_orphaned_staging(destination: Path, owner: str) -> None:
    """Remove the staging folders of `destination` that a killed writer on this host left (its process is gone), each
    named in a line on stderr; `owner`: this process's staging_owner(). Without it a SIGKILLed export, merge or
    conversion left a hidden folder of up to the drafter's or the dataset's size beside it for good. A folder of
    another host, or of a process still running, is left alone: it may be being written now."""
    host, namespace, _ = owner.split(".")
    ours = staging_pattern(destination.name)
    try:
        siblings = list(destination.parent.glob(f".{destination.name}-*"))
    except OSError:
        return
    for path in siblings:
        match = ours.fullmatch(path.name)
        if not (match and match["pid"] and (match["host"], match["namespace"]) == (host, namespace)):
            continue
        pid = int(match["pid"])
        if pid != os.getpid() and process_gone(pid) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():  # (another writer may have swept it first)
                print(f"[ddtree] removed {path}: what process {pid} left of {destination.name} when it was killed "
                      "while writing it", file=sys.stderr, flush=True)


@contextmanager
def staged_folder(destination: str | Path):
    """Yield a temporary folder beside `destination`; on success rename it into place.

    An interruption or an error leaves `destination` as it was and removes the partial folder,
    so nothing half-written is ever visible under the final name. A folder being replaced is renamed aside first
    and deleted only once the new one is in place: a delete that fails (a file it may not remove, a file a server
    still holds open on NFS) leaves the new folder whole and the old one named in a warning.
    """
    destination = Path(destination)
    # Checked before the work: replacing means rmtree, which a file or a link cannot take.
    if destination.is_symlink() or (destination.exists() and not destination.is_dir()):
        raise DDTreeError(f"{destination} exists and is not a folder (a file or a link): give a folder path, "
                          "or remove it first")
    if os.path.ismount(destination):  # a mount point cannot be renamed aside or replaced (EBUSY at the end)
        raise DDTreeError(f"{destination} is a mount point, which a finished folder cannot replace: give a folder "
                          f"inside it ({destination / 'name'})")
    with unwritable_as_error(destination):
        destination.parent.mkdir(parents=True, exist_ok=True)
        owner = staging_owner()
        remove_orphaned_staging(destination, owner)
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-{owner}-", dir=destination.parent))
    with refused_write_as_error(destination):  # outside the clean-up, as atomic_file's
        try:
            yield staging
            follow_umask(staging, recursive=True)
            replace_folder(staging, destination)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def replace_folder(new: Path, destination: Path, what: str = "folder") -> None:
    """Rename the finished folder `new` to `destination`, replacing the `what` there if any: the old one is renamed
    aside first (a name of its own each time, .<name>.replaced-<8 hex>, so an aside an earlier delete could not clear
    never blocks this one), put back if the rename fails, and deleted only once the new one is in place. A delete that
    fails (a file it may not remove, one a server still holds open on NFS) leaves the new one whole and the old one
    named in a warning. staged_folder's, and the feature store's replacement of a store (training/feature_store.py)."""
    displaced = None
    if destination.exists():
        displaced = destination.with_name(f".{destination.name}.replaced-{uuid.uuid4().hex[:8]}")
        destination.rename(displaced)
    try:
        new.rename(destination)
    except BaseException:
        if displaced is not None:
            displaced.rename(destination)  # the old one back under its name
        raise
    if displaced is not None:
        try:
            shutil.rmtree(displaced)
        except OSError as error:
            print(f"warning: {destination} was written; the {what} it replaced, moved to {displaced}, could not be "
                  f"deleted ({error_line(error)}): delete it by hand", file=sys.stderr)


# The files a drafter export writes (training/export.py, training/publish.py; the weights as one file or as shards and
# their index), and the calibration.json `ddtree calibrate` adds to one, learned on the weights a new export replaces.
EXPORT_FILE_NAMES = {"config.json", "model.safetensors", "model.safetensors.index.json", "README.md",
                     "configuration_dflash.py", "modeling_dflash.py", CORPUS_FILE, CALIBRATION_FILE}
WEIGHT_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors")


# What `hf download --local-dir` writes beside a downloaded export: the Hub's .gitattributes and the download's own
# metadata (.cache/huggingface/). A folder holding them is still an export: --push-only pushes it (training/hub.py),
# and --overwrite replaces it, losing nothing the Hub does not hold.
DOWNLOAD_EXTRAS = (".gitattributes", ".cache/huggingface")


def is_download_extra(name: str) -> bool:
    """Whether a path inside an export folder (relative, with /) is one of DOWNLOAD_EXTRAS or lies inside one."""
    return any(name == extra or name.startswith(extra + "/") for extra in DOWNLOAD_EXTRAS)


def is_drafter_config(fields) -> bool:
    """Whether a parsed config.json is a DFlash drafter's (a target model's has neither field)."""
    return isinstance(fields, dict) and ("dflash_config" in fields or "block_size" in fields)


def files_an_export_would_lose(folder: Path) -> list[str]:
    """What replacing an existing folder with an export would delete that no export wrote (its entries, a folder's name
    ending in /): all of them where its config.json is not a drafter's (it is not an earlier export), else those an
    export never writes (an export is flat: any folder in it is another's, but for what a download adds:
    DOWNLOAD_EXTRAS)."""
    files = sorted(path.name + ("/" if path.is_dir() else "") for path in folder.iterdir())
    try:
        earlier_export = is_drafter_config(json.loads((folder / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        earlier_export = False
    if not earlier_export:
        return files

    def downloaded(name: str) -> bool:
        entry = folder / name
        inside = entry.rglob("*") if entry.is_dir() else [entry]
        return (name.rstrip("/") in {extra.split("/")[0] for extra in DOWNLOAD_EXTRAS}
                and all(is_download_extra(path.relative_to(folder).as_posix()) for path in inside if not path.is_dir()))

    return [name for name in files
            if name not in EXPORT_FILE_NAMES and not WEIGHT_SHARD.fullmatch(name) and not downloaded(name)]


def check_output_folder(out: Path, overwrite: bool, keep: tuple[Path, ...] = (), name: str = "OUT") -> None:
    """Refuse an export destination whose replacement would lose what nobody asked to lose. An empty folder is
    written into; `overwrite` replaces only an earlier export (its config.json a drafter's, and no file an export does
    not write: a mistyped OUT=exports or OUT=data was deleted whole); and never, even then, the working folder, the
    paths `keep` (the run and the checkpoint exported from) or one that holds any of them."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise DDTreeError(f"{name}={out} is a file; give a folder to write the export into")
    for place, what in ((Path.cwd(), "the working folder"), *((path, f"the export's source {path}") for path in keep)):
        if place.resolve().is_relative_to(out.resolve()):
            raise DDTreeError(f"{name}={out} is or holds {what}, which replacing it would delete; "
                              "give a new folder for the export")
    if not out.is_dir() or not any(out.iterdir()):
        return
    lost = files_an_export_would_lose(out)
    if lost:
        shown = ", ".join(lost[:5]) + (f" and {len(lost) - 5} more" if len(lost) > 5 else "")
        raise DDTreeError(f"{name}={out} exists and is not an earlier export: replacing it would delete {shown}; give "
                          "a new folder for the export (or move those files out), even with --overwrite")
    if not overwrite:
        switch = " (OVERWRITE=1)" if name == "OUT" else ""  # make export's; no make target runs training.export
        raise DDTreeError(f"{name}={out} exists and is not empty (an earlier export); pick another folder or pass "
                          f"--overwrite{switch} to replace it")
