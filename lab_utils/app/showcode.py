"""Show, in a notebook, the code that takes a number: one hop from the cell to the source.

Each notebook has a "How this is measured" cell that calls :func:`show_source` on the
function behind its headline number (the training loop, the communication probe, the
all-reduce timing loop, ...). It prints the function's own source, with the file and
line it comes from, so a student reads exactly what ran, not a paraphrase of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

from IPython.display import Markdown, display


def source_markdown(obj: Callable[..., Any] | type) -> str:
    """Markdown for ``obj``'s source: a heading with its qualified name, file and first line,
    then the code (docstring included) as a Python block."""
    target = inspect.unwrap(obj)
    lines, first = inspect.getsourcelines(target)
    path = Path(inspect.getsourcefile(target) or "?")
    try:
        where = path.relative_to(Path(__file__).resolve().parents[2])  # the checkout
    except ValueError:
        where = path
    name = f"{target.__module__}.{target.__qualname__}"
    return f"**`{name}`** ({where}, line {first})\n\n```python\n{''.join(lines).rstrip()}\n```"


def show_source(*objs: Callable[..., Any] | type) -> None:
    """Display each function's or class's source in the notebook (as text outside one)."""
    display(Markdown("\n\n".join(source_markdown(o) for o in objs)))
