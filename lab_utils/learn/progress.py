"""Progress bars that stay quiet when headless.

A text bar (plain ``tqdm`` on stdout), in JupyterLab as in a terminal: not ``tqdm.auto``'s widget,
because a saved notebook keeps no widget state, so JupyterLab shows "Error displaying widget: model
not found" for every bar when the notebook is opened again. When :func:`headless`, carriage-return
bars would fill the saved output, so they are disabled.
"""

from __future__ import annotations

import os
import sys


def headless() -> bool:
    """True under ``python -m lab_utils run`` (``LAB_HEADLESS=1``), in workers and batch jobs, or without
    a terminal or notebook."""
    if os.environ.get("LAB_HEADLESS") == "1":
        return True
    if "ipykernel" in sys.modules:
        return False
    return not sys.stderr.isatty()


def progress(iterable, total: int | None = None, desc: str | None = None, **kw):
    """A text ``tqdm`` bar over ``iterable`` that clears itself when done; disabled when :func:`headless`."""
    from tqdm import tqdm

    if headless():
        return tqdm(iterable, total=total, desc=desc, disable=True, **kw)
    return tqdm(iterable, total=total, desc=desc, leave=False, file=sys.stdout, mininterval=1.0, **kw)
