"""`ddtree`, the console script, and `python -m ddtree`: the command line is parsed before torch and transformers load
(ddtree/arguments.py) and the --drafter and --prompts it names are checked (ddtree/inputs.py), so `--help`, a bad flag
or a mistyped path answer at once; then ddtree/cli.py runs the command."""

from __future__ import annotations

import sys

from .arguments import build_parser
from .errors import command
from .inputs import check_input_paths


@command
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)  # --help, a bad flag: exits here
    check_input_paths(args)  # a mistyped --drafter or --prompts
    from .cli import main as run  # torch, transformers

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
