"""User errors and the one exit-code rule every command of this project follows.

    @command
    def main(argv: list[str] | None = None) -> int: ...    # raises DDTreeError on bad input

    if __name__ == "__main__":
        sys.exit(main())                                   # main(argv) returns the exit status

A `DDTreeError` is bad input a user can fix (a value, a file, a setting): the command prints its
message as one line, `error: ...`, and exits with status 2, like argparse does for a bad flag.
An interrupted command (Ctrl-C) exits with 130, the shell's code for SIGINT; one stopped by SIGTERM (a scheduler's time
limit, `timeout`, `kill`) exits with 143 the same way (SigtermRaises); and one whose output's reader went away
(`ddtree generate ... | head`) exits quietly with 141, the shell's code for SIGPIPE.
Anything else is a bug and keeps its traceback (status 1).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import select
import signal
import sys
import threading
from typing import Callable

USAGE_ERROR = 2  # bad input: what argparse uses for a bad flag
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
TERMINATED = 143  # 128 + SIGTERM, what a shell reports for a process a scheduler (SLURM, `timeout`) or `kill` stopped
STDOUT_CLOSED = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader closed the pipe (`... | head`)
PACKAGES = ("ddtree", "training", "data")  # this project's, whose modules are commands run with python -m


class DDTreeError(ValueError):
    """Bad input a user can fix; `run_cli` prints its message as one line and exits with status 2."""


class Terminated(BaseException):
    """A SIGTERM, raised where the command is (SigtermRaises) as Ctrl-C raises KeyboardInterrupt: a BaseException, so
    that no `except Exception` takes it, and the `finally` blocks on its way out remove what was half-written."""


class SigtermRaises:
    """The SIGTERM handler every command runs under (run_cli): it raises Terminated, so a SIGTERM takes Ctrl-C's way
    out. Python's default action ended the process at once, silently, with no `finally`: a staging folder
    (staged_folder's .<name>-xxxxxxxx, a run's .drafter-xxxxxxxx) or a fresh run's folder and lock stayed behind
    (found in a review, 2026-12-04). `raising` False only notes the signal in `received`: training.ablate between two
    variants' launches, where the next one then stops before it starts. It raises once per command: SLURM signals
    every process of a step and a launcher forwards the signal too, and a second Terminated, raised as the first one's
    `finally` blocks ran, left their staging folders (found in a review, 2026-12-04); SIGKILL is a scheduler's way to
    insist.

    Inside Lightning's fit, Lightning's handler takes over and calls this one as the handler it replaced (restoring it
    as fit ends): this one then does nothing, and the stop is Lightning's (training.callbacks.SigtermAtStepBoundary:
    where a step ends, saved, on every rank). A process forked from this one ends at the signal as it did before,
    running none of the parent's clean-up; training's DataLoader workers ignore it (training.data.ignore_sigterm)."""

    def __init__(self, raising: bool = True):
        self.pid = os.getpid()
        self.received = False
        self.raising = raising

    def __call__(self, signum, frame) -> None:
        if signal.getsignal(signal.SIGTERM) is not self:  # called by Lightning's handler, in fit
            return
        if os.getpid() != self.pid:  # a forked child, which inherited this handler: the default action
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if self.received and self.raising:  # already stopping: a second SIGTERM (a launcher forwarding the
            return  # scheduler's, a parent passing its own on) raised again inside the first one's `finally` clean-up
        self.received = True
        if self.raising:
            raise Terminated


@contextlib.contextmanager
def sigterm_raises():
    """SigtermRaises as the SIGTERM handler while the block runs, where SIGTERM has its default action: a handler the
    caller set (training.ablate's around its variants' launches) or an ignored SIGTERM is left as it is."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, SigtermRaises())
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class CommandParser(argparse.ArgumentParser):
    """argparse for this project's commands: a bad or missing flag is one line as well (`error: ...; see PROG --help`),
    status 2, instead of argparse's usage block (its subcommands' parsers are of this class too). An option is spelled
    in full: argparse took `--output` for `--output-root`, which slipped past recipes/slurm.sbatch's refusal of the
    run-folder options, and a prefix that stops being unique as options are added would change meaning."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        main = getattr(sys.modules.get("__main__"), "__spec__", None)  # run as `python -m training.evaluate`, say
        if not args and "prog" not in kwargs and main is not None and main.name.split(".")[0] in PACKAGES:
            kwargs["prog"] = f"python -m {main.name}"  # argparse would say "evaluate.py", which cannot be run
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"error: {message}; see {self.prog} --help\n")


def first_and_count(names: list[str]) -> str:
    """The first of `names` and how many more, for a one-line error: "fc.weight and 2 more"."""
    return names[0] + (f" and {len(names) - 1} more" if len(names) > 1 else "")


def error_line(error: BaseException) -> str:
    """The one line printed for a user error: its message's first line (multi-line messages are cut). An error raised
    in a DataLoader worker comes back as torch re-raises it, its message a heading and the worker's traceback: the line
    is then the original message's, from the traceback's last entry."""
    text = str(error).strip()
    return worker_message(text) or (text.splitlines()[0] if text else type(error).__name__)


def worker_message(text: str) -> str | None:
    """The original message of an error torch re-raised from a DataLoader worker ("Caught DDTreeError in DataLoader
    worker process 0.\nOriginal Traceback (most recent call last):\n ... \nddtree.errors.DDTreeError: <message>"), or
    None for any other text. The traceback's last line naming the error is the raised one's: an earlier one is a chained
    error's."""
    heading = re.match(r"Caught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback", text)
    if heading is None:
        return None
    named = re.compile(rf"(?:[\w.]+\.)?{heading.group(1)}: (.+)")
    for line in reversed(text.splitlines()):
        if match := named.fullmatch(line):
            return match.group(1).strip()
    return None


def run_cli(main: Callable[[list[str] | None], int | None], argv: list[str] | None = None) -> int:
    """Run a command's main(argv) under the exit-code rule above and return the status for sys.exit."""
    try:
        with sigterm_raises():
            status = int(main(argv) or 0)
        sys.stdout.flush()  # what is still buffered: a closed pipe raises here, not at exit
        return status
    except DDTreeError as error:
        print(f"error: {error_line(error)}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED
    except Terminated:
        print("stopped by SIGTERM", file=sys.stderr)
        return TERMINATED
    except BrokenPipeError:
        if not stdout_closed():  # another pipe (a child process, a socket) broke: a failure, with its traceback
            raise
        # stdout's reader is gone: nothing more can be shown, and no traceback is wanted. Python's own exit flushes
        # stdout again and would print the same error; writes to /dev/null cannot fail. (Python ignores SIGPIPE, so
        # the write raised instead of the signal ending the process.)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return STDOUT_CLOSED


def stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has closed it: polling its write end then reports an error."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor (a captured stdout), or no poll here
        return False


def check_text(text: str, where: str) -> str:
    """`text` as given, or one line naming `where` if it is not valid Unicode: a lone surrogate, which is what Python
    makes of a command-line argument's bytes that are not UTF-8 and what a JSON "\\ud800" escape (text cut in the middle
    of a UTF-16 pair) reads as. A tokenizer refuses one with a TypeError that names neither the text nor its place."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DDTreeError(f"{where}: not valid UTF-8 text (a lone surrogate, U+{ord(text[error.start]):04X}, at "
                          f"character {error.start + 1}: bytes in another encoding, or text cut mid-character); "
                          "give it as UTF-8") from None
    return text


def command(main: Callable[[list[str] | None], int | None]) -> Callable[[list[str] | None], int]:
    """Decorate a command's main(argv) so that calling it applies `run_cli` and returns the exit status."""

    @functools.wraps(main)
    def wrapped(argv: list[str] | None = None) -> int:
        return run_cli(main, argv)

    return wrapped
