"""torchrun for recipes/launch_torchrun.sh (`make train NODES=n`): the same launch, ending as its processes did.

    python -m training.launch --nnodes 2 --nproc-per-node 8 ... -m training.train --recipe qwen3-8b ...

torchrun ends any failed launch with its ChildFailedError report (every failed rank, then the agent's own traceback)
and exit status 1, whatever the processes said: bad input, which training.train states in one line with exit status 2,
looked like a crash three dozen lines long, and a SIGTERM from a scheduler ended in a SignalException traceback with
status 1. Here the launch's status is its first failed process's (128 + the signal for one killed by a signal), the
report is one line after the processes' own, and a signal to the launch is 128 + its number, as a shell reports it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def exit_status(exitcode: int) -> int:
    """A process's status as a shell gives it: its exit code, or 128 + N for one killed by signal N (exitcode -N)."""
    return exitcode if exitcode > 0 else 128 - exitcode if exitcode < 0 else 1


def main(argv: list[str] | None = None) -> int:
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as error:
        rank, failure = error.get_first_failure()
        status = exit_status(failure.exitcode)
        # Not an "error:" line: the processes printed theirs (the same one from each rank, for bad input).
        print(f"[launch] {len(error.failures)} process(es) of this node failed, first rank {rank} with exit status "
              f"{status}; its own lines above say why", file=sys.stderr)
        return status
    except SignalException as error:
        print(f"[launch] stopped by {error.sigval.name}", file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
