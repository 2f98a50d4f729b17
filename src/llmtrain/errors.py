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


def exit_process(code: int) -> NoReturn:
    """Ends the process with `code` as sys.exit would, less CPython's teardown of every module,
    which takes ~1.3 s once torch and transformers are loaded: on every rank, every start and
    every restart. The atexit handlers still run (logging closes its files) and the standard
    streams are flushed; the trainer's own files are line-buffered and closed by then."""
    if "torch" in sys.modules:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)
    sys.exit(code)
