"""The two editions of the explanation, and the claims that would give a graded answer away.

**Discussion cells.** A master cell tagged ``discussion`` explains a result or answers a graded
question. ``make student`` replaces each run of consecutive discussion cells by one pointer line
(:func:`without_discussion`); ``make discussion`` keeps them, for the instructor to publish after the
deadline. The masters keep everything and run as the lab.

**Give-aways.** Every graded question names the claims that state its answer: a hand-graded one in the
paragraph ``**Give-aways:** `phrase`; `phrase` `` that ends its reference answer (inside the SOLUTION
block, so no student sees it), an autograded one in ``Exercise.giveaways``. :func:`find_giveaways` lists
each phrase visible to a student before the question's answer cell: in that notebook (markdown, code,
and the outputs of an executed copy) or in any earlier one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from lab_utils.app.grading.exercises import EXERCISES

DISCUSSION_TAG = "discussion"
DISCUSSION_POINTER = "*Discussed after the deadline.*"
GIVEAWAYS_LABEL = "**Give-aways:**"
_MARK = re.compile(r"# (BEGIN|END) (QUESTION|SOLUTION|TESTS|PROMPT)")


def _source(cell: dict) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else str(s)


def is_discussion(cell: dict) -> bool:
    return DISCUSSION_TAG in (cell.get("metadata", {}).get("tags") or [])


def without_discussion(cells: Sequence[dict]) -> list[dict]:
    """``cells`` with each run of consecutive discussion cells replaced by one pointer cell."""
    out: list[dict] = []
    previous = False
    for c in cells:
        if not is_discussion(c):
            out.append(c)
            previous = False
            continue
        if not previous:
            out.append({"cell_type": "markdown", "id": f"d-{c.get('id', len(out))}"[:64], "metadata": {},
                        "source": DISCUSSION_POINTER})
        previous = True
    return out


def phrases(reference_markdown: str) -> tuple[str, ...]:
    """The backticked phrases of the ``**Give-aways:**`` paragraph of a reference answer."""
    at = reference_markdown.find(GIVEAWAYS_LABEL)
    if at < 0:
        return ()
    paragraph = re.split(r"\n\s*\n", reference_markdown[at + len(GIVEAWAYS_LABEL):], maxsplit=1)[0]
    return tuple(p.strip() for p in re.findall(r"`([^`]+)`", paragraph) if p.strip())


def normalized(text: str) -> str:
    """``text`` as phrases are matched: lower case, markdown emphasis and code marks (* _ `) removed,
    white space folded to one blank."""
    return re.sub(r"\s+", " ", re.sub(r"[*_`]", "", text.lower())).strip()


def matches(phrase: str, text_normalized: str) -> bool:
    """Whether ``phrase`` (plain, or a regex after ``re:``) occurs in normalized text."""
    if phrase.startswith("re:"):
        return re.search(phrase[3:], text_normalized) is not None
    return normalized(phrase) in text_normalized


def _outputs_text(cell: dict) -> str:
    parts = []
    for o in cell.get("outputs") or []:
        if "text" in o:
            parts.append(_source({"source": o["text"]}))
        for mime in ("text/markdown", "text/plain", "text/html"):
            if mime in (o.get("data") or {}):
                parts.append(_source({"source": o["data"][mime]}))
    return "\n".join(parts)


def cell_text(cell: dict, outputs: bool = True) -> str:
    """What a student sees of a cell: its source, and (``outputs``) what it printed or displayed."""
    text = _source(cell)
    return text + "\n" + _outputs_text(cell) if outputs else text


@dataclass(frozen=True)
class Seen:
    """One notebook as a student reads it: the text before each question's answer cell, and all of it."""
    before: dict[str, str]   # question name -> everything visible above its answer cell
    whole: str


def student_view(cells: Sequence[dict], answer_cell_question) -> Seen:
    """``cells`` of a student notebook read top to bottom; ``answer_cell_question(cell)`` names the
    question whose answer cell ``cell`` is (None for other cells)."""
    before: dict[str, str] = {}
    seen: list[str] = []
    for c in cells:
        q = answer_cell_question(c)
        if q and q not in before:
            before[q] = "\n".join(seen)
        seen.append(cell_text(c))
    return Seen(before, "\n".join(seen))


def master_view(cells: Sequence[dict], question_names: Iterable[str]) -> Seen:
    """An (executed) master notebook as its student copy shows it: without discussion cells, solution
    blocks and hidden tests; a question's answer cell is where its SOLUTION block starts."""
    names: Iterator[str] = iter(question_names)
    before: dict[str, str] = {}
    seen: list[str] = []
    block: list[str] = []
    current = None
    for c in cells:
        first = _source(c).strip().split("\n", 1)[0].strip()
        mark = _MARK.fullmatch(first) if c.get("cell_type") == "raw" else None
        if mark:
            kind, what = mark.groups()
            if kind == "BEGIN":
                block.append(what)
                if what == "QUESTION":
                    current = next(names, None)
                elif what == "SOLUTION" and current and current not in before:
                    before[current] = "\n".join(seen)
            elif block:
                block.pop()
            continue
        if is_discussion(c) or "SOLUTION" in block:
            continue
        if "TESTS" in block and re.match(r"^\s*#.*\bhidden\b", _source(c).lstrip(), re.IGNORECASE):
            continue
        seen.append(cell_text(c))
    return Seen(before, "\n".join(seen))


def find_giveaways(books: Sequence[tuple[str, Seen]], giveaways: dict[str, Sequence[str]],
                   where: str = "") -> list[str]:
    """One line per give-away phrase a student can read before its question's answer cell: in the
    question's notebook above it, or anywhere in an earlier notebook of ``books`` (in lab order)."""
    found = []
    earlier = ""
    for book, seen in books:
        for q, text in seen.before.items():
            visible = normalized(earlier + "\n" + text)
            found += [f"{book}{where}, {q}: '{p}' is visible before its answer cell"
                      for p in giveaways.get(q, ()) if matches(p, visible)]
        earlier += "\n" + seen.whole
    return found


def all_giveaways(masters: Iterable) -> dict[str, tuple[str, ...]]:
    """Question name -> its give-away phrases, for every question of the parsed masters
    (:class:`lab_utils.app.grading.notebooks.Master`): a hand-graded one's from its reference answer, an
    autograded one's from its Exercise."""
    return {q.name: phrases(q.reference) if q.manual else EXERCISES[q.name].giveaways
            for m in masters for q in m.questions}
