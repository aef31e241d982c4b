"""torchrun with a stop's exit status: `python -m harness.torchrun <torchrun's arguments> <script>.py <its flags>`
runs torch.distributed.run's own main, unchanged, and only maps how it ends. torchrun answers a Ctrl-C by forwarding
it to its ranks and waiting for them, then raises its SignalException: a traceback and status 1, after the ranks
stopped at one step with one checkpoint and exited 130. Here that ends in status 130 without the traceback (rank 0's
line names the checkpoint and the resume command), as does a run whose every failed rank exited 130 (the Ctrl-C sent
to the ranks alone). Anything else, success and errors, is torchrun's own answer."""

import signal
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun

INTERRUPTED = 128 + signal.SIGINT  # the shell's status for a Ctrl-C, as one process's stop gives (130)


def main() -> int:
    try:
        torchrun()
    except SignalException as e:
        if e.sigval != signal.SIGINT:
            raise
        return INTERRUPTED
    except ChildFailedError as e:
        if any(failure.exitcode != INTERRUPTED for failure in e.failures.values()):
            raise
        return INTERRUPTED
    return 0


if __name__ == "__main__":
    sys.exit(main())
