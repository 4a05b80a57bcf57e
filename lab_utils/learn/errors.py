"""Errors the lab raises on purpose. A check of user input raises :class:`LabError` *before* any expensive
work starts; it subclasses ``ValueError`` so callers that already catch bad values keep working.
"""

from __future__ import annotations


def first_line(e: object, limit: int = 200) -> str:
    """The first line of an exception's message (or of any text), stripped and cut to ``limit``
    characters: what a row's reason or a one-line error quotes. ``""`` for an empty message."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


def error_line(e: BaseException, limit: int = 200) -> str:
    """``"<class>: <first line>"`` (:func:`first_line`), or the class alone for an empty message."""
    first = first_line(e, limit)
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


class LabError(ValueError):
    """Bad input or an unusable environment, explained in one sentence: what is wrong and the fix."""


class LaunchError(LabError):
    """A launched run failed: a rank died, or the run exceeded its time limit. ``failure``: what the
    failing rank wrote before it ended (``status`` "oom" or "error", ``reason``, ``rank``,
    ``config_index``: :func:`lab_utils.engine.records.read_failures`), or None."""

    def __init__(self, message: str, failure: dict | None = None):
        super().__init__(message)
        self.failure = failure


class WriteError(LabError):
    """A result could not be written (a full disk, a quota, no permission); one sentence says where."""


def write_failure(e: OSError, folder, what: str) -> str:
    """One sentence for a failed write of ``what`` into ``folder``, naming the fix (a full disk or an
    exceeded quota is the common case on a cluster's shared file system)."""
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"No space left on the device holding {folder} ({e.strerror}): {what} was not saved. "
                f"Free space there, or set LAB_RESULTS_DIR to a folder on a larger disk, then run "
                f"again; records already stored are kept.")
    return f"Could not write {what} in {folder} ({e.strerror}); check that folder, then run again."


def check_positive_int(value: object, what: str) -> int:
    """Reject anything but a whole number >= 1, naming the parameter."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise LabError(f"{what} must be a whole number of at least 1, got {value!r}.")
    return value


def check_choice(value: object, choices, what: str):
    """Reject a value that is not one of ``choices``, naming the valid ones."""
    if value not in choices:
        raise LabError(f"Unknown {what} {value!r}; use one of: {', '.join(map(str, choices))}.")
    return value
