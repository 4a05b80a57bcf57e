"""Which notebook, section, table and figure answers which question of the assignment.

One ordered list (:data:`SECTIONS`, the assignment's numbering as SPEC.md gives it, gathered from the
``SECTIONS`` each notebook's package defines in its ``__init__``) is the single source for everything that
names a question: the question map (:func:`question_map_markdown`, ``docs/generated/question-map.md``,
written by ``make docs``), the hand-in (:func:`lab_utils.app.handin.build`), every notebook's "For your
report" cell (:func:`for_your_report_markdown`), the questions each notebook's title names
(:func:`labels_for`) and the order of ``results/<profile>/report.md``. The GPT (notebooks 06 and 07) is
the *Part 2 project* an earlier cohort did, not a question of the assignment; the extras are not either.
The lab's own exercises are named "Exercise NN-a", never with a number that could be the assignment's.

**Where answers are written.** A question graded by hand (``by_hand``: its otter name) is
answered once, in its notebook, in the cell under "<key> (graded by hand, N points)": the
student edition has that cell, ``make grade`` collects its text into the gradebook and
``grades/feedback/<student>.md`` next to the autograded points, so the grader reads every
student's answer in one place, beside the numbers it quotes. The report holds the tables and
figures, the formula Q3.2 asks for first, and every other question (``report``); its section
names the notebook cell instead of asking the hand-graded question a second time.
"""

from __future__ import annotations

import pkgutil
import re
import textwrap
from importlib import import_module
from pathlib import Path

from lab_utils.experiments.shared.sections import PART2, Section
from lab_utils.learn.errors import LabError

#: Every key of the assignment, in its order (the test's one table checks SECTIONS against it).
ASSIGNMENT_KEYS = ("Q1", "Q2", "Q3.1", "Q3.2", "Q4.1", "Q4.2", "Q5", "Q6", "Q7")

#: The report's parts, in its order: the set-up, the assignment's questions, the Part 2 project, the extras.
REPORT_KEYS = ("Setup", *ASSIGNMENT_KEYS, PART2, "Extra")


def _report_place(section: Section) -> tuple[int, bool, int]:
    """Where ``section`` goes in the report: its key's place in :data:`REPORT_KEYS`, then its ``order``
    (None: after those with one; the sort is stable, so equal places keep notebook order)."""
    if section.key not in REPORT_KEYS:
        raise LabError(f"Section key {section.key!r} of notebook {section.notebook} is not a part of the "
                       f"report; use one of: {', '.join(REPORT_KEYS)}.")
    return REPORT_KEYS.index(section.key), section.order is None, section.order or 0


#: Every notebook's package (``lab_utils/experiments/nNN_name/``), in notebook order. Its ``__init__`` holds
#: the notebook's ``SECTIONS``; its experiment module is not imported, so the question map, the hand-in and
#: the runner's report load without torch. The registry lists the same packages' experiment modules
#: (tests/test_architecture.py checks that the two agree).
_EXPERIMENTS_DIR = Path(__file__).resolve().parents[1] / "experiments"   # lab_utils/experiments/
PACKAGES = tuple(import_module(f"lab_utils.experiments.{m.name}")
                 for m in sorted(pkgutil.iter_modules([str(_EXPERIMENTS_DIR)]), key=lambda m: m.name)
                 if m.ispkg and re.fullmatch(r"n\d\d_\w+", m.name))

#: Every section of the report, in its order: each notebook package's ``SECTIONS``, ordered by
#: :func:`_report_place`.
SECTIONS: tuple[Section, ...] = tuple(sorted(
    (s for package in PACKAGES for s in package.SECTIONS), key=_report_place))


def section_of(question: str) -> Section | None:
    """The section a graded question (otter name: an exercise or a hand-graded answer) belongs to."""
    return next((s for s in SECTIONS if question in s.exercises or question == s.by_hand), None)


def exercise_letter(question: str) -> str:
    """An autograded exercise's letter in its notebook ("q04_ring_bytes" -> "b", as "Exercise 04-b")."""
    nn = question[1:3]
    ordered = [q for s in SECTIONS if s.notebook[:2] == nn for q in s.exercises]
    return "abcdefghij"[ordered.index(question)] if question in ordered else ""


def gradebook_column(question: str) -> str:
    """The gradebook's column for a graded question: the assignment's question, a short name and
    where it is, e.g. ``Q3.2 ring bytes (04-b)`` (Exercise 04-b) or ``Q1 report (01, by hand)``; the
    otter name itself for a question this map does not know."""
    section = section_of(question)
    if section is None:
        return question
    nn, short = question[1:3], question[4:].replace("_", " ")
    where = f"{nn}, by hand" if question == section.by_hand else f"{nn}-{exercise_letter(question)}"
    return f"{section.label} {short} ({where})"


def sections_for(notebook: str) -> list[Section]:
    """The sections a notebook answers (``"01"`` or ``"01_batch_size_sweep"``)."""
    return [s for s in SECTIONS if s.notebook.startswith(str(notebook))]


def labels_for(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: the questions a notebook answers, for its title cell."""
    return ", ".join(dict.fromkeys(s.key for s in sections_for(notebook)))


def question_map_markdown() -> str:
    """The question map (``docs/generated/question-map.md``): question, notebook, section (cell), tables,
    figures, graded by hand."""
    lines = ["| question | notebook | cell (section) | tables (`tables/<name>.md`) | figures "
             "(`figures/<name>.png`) | graded by hand in the notebook |", "|---|---|---|---|---|---|"]
    for s in SECTIONS:
        tables = ", ".join(f"`{t}`" for t in s.tables) or "(in the notebook)"
        figures = ", ".join(f"`{f}`" for f in s.figures) or "-"
        cell = s.cell.replace("|", "\\|")
        by_hand = f"`{s.by_hand}`" if s.by_hand else "-"
        lines.append(f"| **{s.key}** {s.title} | `{s.notebook}` | {cell} | {tables} | {figures} "
                     f"| {by_hand} |")
    return "\n".join(lines)


def _wrapped(text: str, first: str = "", rest: str = "") -> list[str]:
    """``text`` wrapped at 96 columns (Markdown renders it the same; the notebook's diff stays readable)."""
    return textwrap.wrap(text, 96, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False)


def for_your_report_markdown(notebook: str) -> str:
    """A notebook's "For your report" cell: per report section, the tables and figures ``make report`` puts
    in and the questions answered in the report (the hand-in's own words), and which question is graded by
    hand in the cell below."""
    lines = ["## For your report", ""]
    lines += _wrapped("`make report` writes your report (README, \"Handing in\"): it puts in your tables and "
                      "figures and leaves a slot for each of your answers. From this notebook:")
    for s in sections_for(notebook):
        shown = [f"`tables/{t}`" for t in s.tables] + [f"`figures/{f}.png`" for f in s.figures]
        what = f"In the report: {', '.join(shown)}." if shown else "No table or figure."
        end = "" if s.title.endswith("?") else "."
        then = " Then answer:" if s.report or s.first else ""
        lines += [""] + _wrapped(f"**{s.label}** · {s.title}{end} {what}{then}")
        if s.report or s.first:
            lines.append("")
        if s.first:
            lines += _wrapped(f"First, the formula. {s.first}", "- ", "  ")
        for q in s.report:
            lines += _wrapped(q, "- ", "  ")
    labels = [f"**{s.by_hand_label})**" for s in sections_for(notebook) if s.by_hand]
    if len(labels) == 1:
        lines += [""] + _wrapped(f"{labels[0]} is answered in the cell below, in this notebook, and graded "
                                 "there; the report does not ask it again.")
    elif labels:
        lines += [""] + _wrapped(f"{', '.join(labels[:-1])} and {labels[-1]} are answered in the cells "
                                 "below, in this notebook, each in its own cell, and graded there; the "
                                 "report does not ask them again.")
    return "\n".join(lines)


def by_hand_prompt(section: Section, points: int) -> str:
    """The prompt of a notebook's hand-graded cell: its bold label, then what it asks."""
    return "\n".join(_wrapped(f"**{section.by_hand_label}, {points} points).** {section.by_hand_asks}"))
