"""`ddtree`, the console script, and `python -m ddtree`: the command line is parsed before torch and transformers load
(ddtree/arguments.py), so `--help` and a bad flag answer at once; then ddtree/cli.py runs the command."""

from __future__ import annotations

import sys

from .arguments import build_parser
from .errors import command


@command
def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(sys.argv[1:] if argv is None else argv)  # --help, a bad flag: exits here
    from .cli import main as run  # torch, transformers

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
