"""torchrun for recipes/launch_torchrun.sh (`make train NODES=n`): the same launch, ending as its processes did.

    python -m training.launch --nnodes 2 --nproc-per-node 8 ... -m training.train --recipe qwen3-8b ...

torchrun ends any failed launch with its ChildFailedError report (every failed rank, then the agent's own traceback)
and exit status 1, whatever the processes said: bad input, which training.train states in one line with exit status 2,
looked like a crash three dozen lines long, and a SIGTERM from a scheduler ended in a SignalException traceback with
status 1. Here the launch's status is its first failed process's (128 + the signal for one killed by a signal), the
report is one line after the processes' own, and a signal to the launch is 128 + its number, as a shell reports it.
A rendezvous that fails before any process starts (MASTER_PORT in use on node 0, a MASTER_ADDR no node answers at)
was torchrun's 39-line traceback: here it is one error line naming MASTER_ADDR:MASTER_PORT, with exit status 2.
"""

from __future__ import annotations

import signal
import sys

from torch.distributed import DistNetworkError, DistStoreError
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous.api import RendezvousError
from torch.distributed.run import parse_args, run

from ddtree.errors import USAGE_ERROR, error_line


def exit_status(exitcode: int) -> int:
    """A process's status as a shell gives it: its exit code, or 128 + N for one killed by signal N (exitcode -N)."""
    return exitcode if exitcode > 0 else 128 - exitcode if exitcode < 0 else 1


def first_failure(error: ChildFailedError):
    """(rank, failure) of the process that failed first. torchrun records the processes it then stopped with SIGTERM
    as failures too, stamped within the same second: those are the last choice."""
    failures = error.failures
    own = {rank: failure for rank, failure in failures.items() if failure.exitcode != -signal.SIGTERM} or failures
    rank = min(own, key=lambda r: own[r].timestamp)
    return rank, own[rank]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as error:
        rank, failure = first_failure(error)
        status = exit_status(failure.exitcode)
        # Not an "error:" line: the processes printed theirs (the same one from each rank, for bad input).
        print(f"[launch] rank {rank} failed first, with exit status {status}; its own lines above say why",
              file=sys.stderr)
        return status
    except (DistNetworkError, DistStoreError, RendezvousError) as error:  # before any process started
        # torchrun's static rendezvous (--master-addr/--master-port) has no endpoint of its own; --standalone sets one
        where = (f"the rendezvous endpoint {args.rdzv_endpoint}" if args.rdzv_endpoint
                 else f"MASTER_ADDR:MASTER_PORT {args.master_addr}:{args.master_port}")
        print(f"error: torchrun could not meet the other nodes at {where}: {error_line(error)}; give another "
              "MASTER_PORT (the same on every node) if that port is in use on node 0, and check that MASTER_ADDR is "
              "node 0's address", file=sys.stderr)
        return USAGE_ERROR
    except SignalException as error:
        print(f"[launch] stopped by {error.sigval.name}", file=sys.stderr)
        return 128 + int(error.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
