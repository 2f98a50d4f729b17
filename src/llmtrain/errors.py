"""What every layer raises for what the user can fix, and how a process ends with it. A leaf: it
imports nothing of llmtrain."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from typing import NoReturn


class UserError(Exception):
    """Something the user can fix; the CLI prints it as one line, without a traceback."""


# Keys of a rank's torchrun error file (cli.error_lines writes it, training/torchrun.py reads
# it): the user error's lines, and whether the run's logs/error.txt holds the run's line.
USER_ERROR, IN_ERROR_TXT = "llmtrain_user_error", "llmtrain_in_error_txt"


# Libraries whose modules take CPython's teardown a noticeable time: ~1.3 s for torch and
# transformers, 0.15-0.2 s for datasets (pandas, pyarrow; `llmtrain prepare`'s 3% of a 50 MiB corpus).
HEAVY_MODULES = ("torch", "transformers", "datasets")


def exit_process(code: int) -> NoReturn:
    """Ends the process with `code` as sys.exit would, less CPython's teardown of every module,
    once one of HEAVY_MODULES is loaded: on every rank, every start and every restart, and at
    the end of every prepare. The atexit handlers still run (logging closes its files) and the
    standard streams are flushed; the trainer's and prepare's own files are closed by then."""
    if any(name in sys.modules for name in HEAVY_MODULES):
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)
