"""``make docs``: the pages of ``docs/generated/``, written from the code that owns their content.

Each page is text the code already produces: the time budget
(:func:`lab_utils.app.time_budget.budget_markdown`
and the cost model's :data:`lab_utils.experiments.shared.estimates.ASSUMPTIONS`), the question map
(:func:`lab_utils.app.questions.question_map_markdown`) and how to hand in
(:data:`lab_utils.app.handin.HOWTO`).
The README and ``docs/*.md`` link to these pages instead of holding a copy; ``tests/test_docs.py``
writes them into a scratch folder and fails when ``docs/generated/`` differs (the fix: ``make docs``).
``make student`` writes the same pages into the student copy.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lab_utils.app import handin, questions, time_budget
from lab_utils.experiments.shared import estimates

GENERATED = Path(__file__).resolve().parents[2] / "docs" / "generated"
#: The first line of every page: where it comes from, and that an edit by hand is overwritten.
HEADER = "<!-- Written by `make docs` (python -m lab_utils docs) from {source}: edit that, not this page. -->"


def _time_budget() -> str:
    assumptions = "\n".join(f"- {a}" for a in estimates.ASSUMPTIONS)
    return (f"# Time budget: GPU hours to book\n\n"
            f"Expected wall time of each notebook in the `full` profile on one {estimates.NODE} node, run in "
            f"order: an **{estimates.LABEL}**, from each experiment's own full-profile plan for that node "
            f"and the cost model's assumptions below.\n\n"
            f"{time_budget.budget_markdown()}\n\n"
            f"The assumptions (`lab_utils.experiments.shared.estimates.ASSUMPTIONS`):\n\n{assumptions}\n")


def _question_map() -> str:
    return ("# Questions: where each is answered\n\n"
            "Each question of the assignment, the notebook and section that answer it, the tables and "
            "figures `make report` puts in its section of the hand-in, and the cell graded by hand "
            "(`lab_utils.app.questions.SECTIONS`).\n\n"
            f"{questions.question_map_markdown()}\n")


def _handin() -> str:
    return f"# Handing in\n\n{handin.HOWTO.strip()}\n"


#: page name -> (what writes it, the source its header names)
PAGES = {
    "time-budget.md": (_time_budget, "lab_utils.app.time_budget and lab_utils.experiments.shared.estimates"),
    "question-map.md": (_question_map, "lab_utils.app.questions.SECTIONS"),
    "handin.md": (_handin, "lab_utils.app.handin.HOWTO"),
}


def pages() -> dict[str, str]:
    """Every page of ``docs/generated/``: file name -> its text."""
    return {name: HEADER.format(source=source) + "\n" + make() for name, (make, source) in PAGES.items()}


def write(out: Path = GENERATED) -> list[Path]:
    """Write :func:`pages` into ``out`` (created if missing), remove pages there that no longer exist;
    returns the files written."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    texts = pages()
    for stale in sorted(out.glob("*.md")):
        if stale.name not in texts:
            stale.unlink()
    written = []
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
        written.append(out / name)
    return written


def differences(out: Path = GENERATED) -> list[str]:
    """The pages of ``out`` that are missing, stale or no longer written (empty: ``out`` is current)."""
    out = Path(out)
    texts = pages()
    found = {p.name: p.read_text(encoding="utf-8") for p in sorted(out.glob("*.md"))} if out.is_dir() else {}
    wrong = [f"{name}: missing" for name in texts if name not in found]
    wrong += [f"{name}: stale" for name, text in texts.items() if name in found and found[name] != text]
    wrong += [f"{name}: not written by make docs" for name in found if name not in texts]
    return wrong


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab_utils docs", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(GENERATED), help="the folder to write (default: docs/generated)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the folder is not current")
    args = p.parse_args(argv)
    if args.check:
        wrong = differences(Path(args.out))
        for line in wrong:
            print(line, file=sys.stderr)
        if wrong:
            print("run `make docs` to rewrite them", file=sys.stderr)
        return 1 if wrong else 0
    for path in write(Path(args.out)):
        print(f"wrote {path}")
    return 0
