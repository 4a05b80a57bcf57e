"""A table as a notebook shows it: one line per row, as wide as the notebook (the narrow view).

A saved table (``results/<profile>/tables/<name>.csv`` and ``.md``) keeps every column and every word.
In JupyterLab a wide table runs off the right edge (the efficiency of Table 1 out of sight) and a long
reason in one cell makes its row several lines tall. :func:`narrow_view` therefore

- moves every text longer than :data:`LONG_TEXT` characters into a numbered note under the table
  (``OOM: batch 512 needs… [1]``; one note per distinct text), and
- shows a table wider than :data:`WIDTH` characters as its maker's view (``df.attrs["view"]``, set by
  the function that builds the table: the columns a reader needs first), naming the columns left out and
  the CSV that holds them, or else splits it into parts that fit, each repeating the row's key columns
  (the configuration) so that every part reads on its own.

The cells arrive as display text (:func:`lab_utils.engine.store.formatted_frame`); nothing is recomputed.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass

#: About how many characters of table fit across a notebook in JupyterLab at its default font (a
#: 1366-pixel screen with the file browser open shows about 1,000 pixels of output, about 6.7 pixels
#: per character of a cell, measured in Chromium; 140 left some tables 5% too wide).
WIDTH = 130
#: ``df.attrs`` keys: the columns of a table's narrow view, and where the whole table was saved.
VIEW, SAVED = "view", "saved_csv"
#: A cell text longer than this (characters) goes into a note under the table.
LONG_TEXT = 36
#: The key columns repeated in every part: by default the table's first ones, at most this many.
KEY_COLUMNS = 3


def with_view(df, columns: Sequence[str]):
    """``df`` with its narrow view set: the ``columns`` a notebook shows first when the whole table is too
    wide (the rest stay in the saved CSV, which the view names). Returns ``df``."""
    df.attrs[VIEW] = list(columns)
    return df


def _width(header: str, cells: Sequence[str]) -> int:
    """A column's width in characters: its widest cell, or its header's longest word (headers wrap at
    blanks), plus the padding between columns."""
    words = max((len(w) for w in str(header).split()), default=0)
    return max([words, *(len(c) for c in cells)]) + 3


def _short(text: str, limit: int) -> str:
    cut = text[:limit].rsplit(" ", 1)[0] if " " in text[:limit] else text[:limit]
    return cut.rstrip(" ,;:(") + "…"


@dataclass
class TableView:
    """What :func:`lab_utils.engine.store.display_table` returns: the table's parts (pandas ``Styler``
    objects, or frames without jinja2) and its notes. A notebook cell ending with it renders it as HTML."""
    parts: list
    notes: list[str]

    def to_html(self) -> str:
        between = "<p style='margin: 0.2em 0; font-size: smaller'><em>continued: more columns of the same " \
                  "rows</em></p>"
        tables = [p.to_html() for p in self.parts]
        notes = "".join(f"<p style='margin: 0.1em 0; font-size: smaller'>[{i}] {html.escape(n)}</p>"
                        for i, n in enumerate(self.notes, 1))
        return between.join(tables) + notes

    def _repr_html_(self) -> str:
        return self.to_html()

    def __repr__(self) -> str:
        text = "\n\n".join((p.data if hasattr(p, "data") else p).to_string(index=False) for p in self.parts)
        return text + "".join(f"\n[{i}] {n}" for i, n in enumerate(self.notes, 1))


def narrow_view(text, numeric: Sequence[str], key: Sequence[str] | int | None = None,
                width: int = WIDTH, long_text: int = LONG_TEXT, view: Sequence[str] | None = None,
                saved: str | None = None) -> TableView:
    """The narrow view of ``text`` (a DataFrame of display strings); ``numeric``: its right-aligned columns;
    ``key``: the columns every part repeats (names, or how many leading ones; default up to
    :data:`KEY_COLUMNS`, fewer for a narrow table); ``view``: the columns to show when the table is too
    wide; ``saved``: the CSV file of the whole table."""
    text = text.copy()
    notes: list[str] = []
    if view and sum(_width(c, text[c].tolist()) for c in text.columns) > width:
        left_out = [c for c in text.columns if c not in view]
        text = text[[c for c in view if c in text.columns]]
        if left_out:
            where = f"in {saved}" if saved else "in the saved table (results/<profile>/tables/)"
            notes.append(f"{len(left_out)} more column(s) {where}: {', '.join(map(str, left_out))}")
    for col in text.columns:
        if col in numeric:
            continue
        cells = []
        for cell in text[col].tolist():
            if len(cell) > long_text:
                if cell not in notes:
                    notes.append(cell)
                cell = f"{_short(cell, long_text)} [{notes.index(cell) + 1}]"
            cells.append(cell)
        text[col] = cells
    columns = list(text.columns)
    if isinstance(key, int) or key is None:
        n = min(KEY_COLUMNS, max(1, len(columns) // 4)) if key is None else key
        key = columns[:n]
    key = [c for c in key if c in columns]
    widths = {c: _width(c, text[c].tolist()) for c in columns}
    rest = [c for c in columns if c not in key]
    groups: list[list[str]] = []
    room = max(width - sum(widths[c] for c in key), width // 3)
    for c in rest:
        if groups and sum(widths[d] for d in groups[-1]) + widths[c] <= room:
            groups[-1].append(c)
        else:
            groups.append([c])
    parts = [_styled(text[key + g] if len(groups) > 1 else text, numeric) for g in groups or [[]]]
    return TableView(parts, notes)


def _styled(frame, numeric: Sequence[str]):
    try:
        styler = frame.style.hide(axis="index")
    except ImportError:  # Styler needs jinja2; without it the formatted frame still reads well
        return frame
    styler = styler.set_properties(**{"white-space": "nowrap"})
    right = [c for c in frame.columns if c in numeric]
    if right:
        styler = styler.set_properties(subset=right, **{"text-align": "right"})
    return styler
