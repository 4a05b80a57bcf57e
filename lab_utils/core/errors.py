"""Errors the lab raises on purpose.

Every check of user input raises :class:`LabError` with one sentence that says what is
wrong and how to fix it, *before* any expensive work starts. It subclasses
``ValueError`` so callers that already catch bad values keep working.
"""

from __future__ import annotations


class LabError(ValueError):
    """Bad input or an unusable environment, explained in one sentence with the fix."""


class LaunchError(LabError):
    """A distributed run failed: a rank died, or the run exceeded its timeout."""
