"""torchrun without its own traceback: `python -m llmtrain.training.torchrun ARGS` is
`torchrun ARGS` (same options, same agent), except that when a worker fails it ends with
torchrun's failure summary, which names the first failure and shows a user error's one line,
and exit code 1, instead of a Python traceback of the launcher printed above that summary.
submit.sh --local and train.slurm start training through it."""

from __future__ import annotations

import logging
import os
import sys

# The same end-of-run race in C++: the other agent's last store operation finds the socket
# closed, and c10d logs a warning with a 30-frame stack dump. This agent process only (c10
# reads TORCH_CPP_LOG_LEVEL once, when torch loads) logs C++ errors but not warnings; the
# workers it starts get the variable as the user set it.
_USER_CPP_LOG_LEVEL = os.environ.get("TORCH_CPP_LOG_LEVEL")
os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.run import main  # noqa: E402

if _USER_CPP_LOG_LEVEL is None:
    del os.environ["TORCH_CPP_LOG_LEVEL"]
else:
    os.environ["TORCH_CPP_LOG_LEVEL"] = _USER_CPP_LOG_LEVEL


class _EndOfRunRace(logging.Filter):
    """Drops one warning: at the end of a multi-node run the first node's agent, which hosts the
    rendezvous, can exit before another node's agent marks the rendezvous closed, and that agent
    then says it "has failed to shutdown the rendezvous". Every worker has ended by then (the
    agents passed their exit barrier), so nothing is lost; the line only reads like a failure."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "has failed to shutdown the rendezvous" not in record.getMessage()


def launch(argv: list[str] | None = None) -> int:
    logging.getLogger("torch.distributed.elastic.rendezvous.dynamic_rendezvous").addFilter(_EndOfRunRace())
    try:
        main(argv)  # @record inside copies the first failure into torchrun's error file
    except ChildFailedError as e:
        sys.stderr.write(f"{e}\n")  # the summary (ChildFailedError's message)
        return 1
    return 0


if __name__ == "__main__":
    from ..cli import exit_process
    exit_process(launch())
