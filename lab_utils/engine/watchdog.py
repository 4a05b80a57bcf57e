"""A time limit for in-process work that Python cannot interrupt.

Most long waits are bounded where they happen (a ``torchrun`` launch by the launcher's
``timeout_s``, a ``DataLoader`` batch by :data:`lab_utils.engine.config.LOADER_TIMEOUT_S`, a notebook
cell by the runner's ``--timeout``). What is left is in-process work that can block in native code:
``torch.compile``'s warm-up and the fast path's timed epochs. An exception cannot interrupt a kernel
stuck in C++, so the only way out is to end the process, after saying why. :func:`deadline` arms
two watchdogs:

1. a Python timer thread. At the limit it prints one sentence (what did not finish, within
   how long, and what to do), calls ``on_expiry`` (e.g. to store an error row, so the run
   says why it stopped), dumps every thread's stack and ends the process with exit code
   :data:`EXIT_CODE`. PyTorch releases Python's global lock while its kernels run, so this
   thread normally gets to run;
2. :mod:`faulthandler`'s watchdog, :data:`GRACE_S` later, which needs no lock: for a call
   stuck while holding it, it dumps the stacks (``Timeout (h:mm:ss)!``) and exits.

Leaving the block in time cancels both. Records already stored are never touched.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
from collections.abc import Callable, Iterator

EXIT_CODE = 3
GRACE_S = 60.0


def expiry_message(what: str, seconds: float, fix: str) -> str:
    """The one sentence printed when ``what`` has not finished within ``seconds``."""
    return f"error: {what} did not finish within {seconds:g} s, so the process is stopped; {fix}"


@contextlib.contextmanager
def deadline(seconds: float | None, what: str, fix: str,
             on_expiry: Callable[[str], None] | None = None) -> Iterator[None]:
    """End the process if the block runs longer than ``seconds`` (``None``: no limit), saying that
    ``what`` did not finish and the ``fix``; ``on_expiry(message)`` runs in the timer thread before
    the exit (its own failure is printed, not raised)."""
    if seconds is None:
        yield
        return
    if not seconds > 0:
        raise ValueError(f"a deadline must be a positive number of seconds, got {seconds!r}")
    message = expiry_message(what, seconds, fix)

    def expire() -> None:
        print(message, file=sys.stderr, flush=True)
        if on_expiry is not None:
            try:
                on_expiry(message)
            except Exception as e:  # the exit must happen whatever the callback does
                print(f"(could not record the failure: {type(e).__name__}: {e})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # The real stderr: in a Jupyter kernel sys.stderr is a stream without a file descriptor.
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(EXIT_CODE)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    faulthandler.dump_traceback_later(seconds + GRACE_S, exit=True, file=sys.__stderr__)
    try:
        yield
    finally:
        timer.cancel()
        faulthandler.cancel_dump_traceback_later()
