"""The files a `ddtree` command names, checked by path in a module free of torch and transformers (and the prompt
readers' rule, `prompt_messages`, which data/regenerate.py applies before torch loads too).

The console script (ddtree/__main__.py) runs `check_input_paths` before those load, so a mistyped --drafter or
--prompts answers at once (it waited about 10 s for them on the 2-core EPYC); ddtree/cli.py reads and checks the files'
contents once they have loaded, still before the target does.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .errors import DDTreeError


def method_list(text: str) -> list[str]:
    """--methods as a list: comma-separated, blanks dropped (an empty list is refused by the command)."""
    return [method.strip() for method in text.split(",") if method.strip()]


def uses_drafter(args: argparse.Namespace) -> bool:
    """Whether the command decodes with --drafter: every method but `ar` does, calibrate always, verify-cost never."""
    if args.command == "generate":
        return args.method != "ar"
    if args.command == "bench":
        return any(method != "ar" for method in method_list(args.methods))
    return args.command == "calibrate"


def check_drafter_path(folder: Path) -> None:
    """A drafter folder holds a config.json; one line saying where it is instead, if a run folder was given."""
    if not (folder / "config.json").is_file():
        if (folder / "drafter" / "config.json").is_file():  # a training run's folder: its drafter is inside
            raise DDTreeError(f"drafter {str(folder)!r} is a training run's folder: its drafter is {folder / 'drafter'}")
        raise DDTreeError(f"drafter {str(folder)!r} is not a folder with a config.json")


def check_prompts_file(path: str | Path) -> Path:
    """The prompts file as a Path, or one line saying why it cannot be one (checked before a target loads). A pipe is
    one too (`--prompts /dev/stdin`, `<(...)`): the CLI reads the prompts once and keeps them."""
    path = Path(path)
    if path.is_dir():
        raise DDTreeError(f"prompts file {path} is a folder; give a .jsonl file with one prompt per line")
    if not path.exists():
        raise DDTreeError(f"prompts file {path} does not exist")
    return path


def check_input_paths(args: argparse.Namespace) -> None:
    """The drafter folder the command decodes with holds a config.json, and its prompts file exists: the two paths
    every run names. (--corpus and --calibration are checked with the other flags that shape trees, in cli.py.)"""
    # given, it is checked whatever the methods: under `ar` alone a mistyped path went without a word, and showed only
    # on the next dflash or ddtree run of the same command
    if getattr(args, "drafter", "random") != "random":
        check_drafter_path(Path(args.drafter))
    if getattr(args, "prompts", None) is not None:
        check_prompts_file(args.prompts)


def prompt_messages(messages: list[dict]) -> list[dict]:
    """The conversation up to its last non-assistant turn: the prompt its reply answers. A conversation file given as
    prompts (held-out conversations as bench's --prompts or eval.prompts, data/regenerate.py's prompts, whose replies
    it rewrites) ends with that reply, after which the generation prompt would open a second assistant turn."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    return messages[:end]
