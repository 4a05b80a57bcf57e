"""Progress bars that stay quiet when headless.

``tqdm.auto`` draws a widget in JupyterLab and a text bar in a terminal. In a notebook
executed headless (``python -m lab_utils run`` sets ``LAB_HEADLESS=1``) or under a
batch job, carriage-return bars would fill the saved output, so they are disabled.
"""

from __future__ import annotations

import os
import sys


def headless() -> bool:
    """True under ``python -m lab_utils run``, in workers, or without a terminal/notebook."""
    if os.environ.get("LAB_HEADLESS") == "1":
        return True
    if "ipykernel" in sys.modules:
        return False
    return not sys.stderr.isatty()


def progress(iterable, total: int | None = None, desc: str | None = None, **kw):
    """``tqdm.auto.tqdm`` over ``iterable``; a disabled plain ``tqdm`` when :func:`headless` (the
    notebook flavour would warn about missing widgets even when disabled)."""
    if headless():
        from tqdm import tqdm

        return tqdm(iterable, total=total, desc=desc, disable=True, **kw)
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, **kw)
