"""What a report section is: one question of the assignment (or project part, or extra), and where the lab
answers it. Each notebook's experiment module defines its own ``SECTIONS`` (a tuple of :class:`Section`);
:data:`lab_utils.app.questions.SECTIONS` gathers them in the report's order."""

from __future__ import annotations

from dataclasses import dataclass

#: the key of the Part 2 project's sections (an earlier cohort's GPT, notebooks 06 and 07)
PART2 = "Part 2 project (earlier cohort's GPT)"


@dataclass(frozen=True)
class Section:
    """One question (or project part) of the report, and where the lab answers it."""

    key: str                      # "Q1", "Q3.1", PART2, "Extra"
    title: str                    # what the assignment asks, in a few words
    notebook: str                 # "01_batch_size_sweep"
    cell: str                     # the notebook section (markdown heading) that answers it
    asks: str                     # one line: what the answer must say (report.md's prompt)
    tables: tuple[str, ...] = ()  # results/<profile>/tables/<name>.md, in report order
    figures: tuple[str, ...] = ()  # results/<profile>/figures/<name>.png
    report: tuple[str, ...] = ()  # the questions answered in the report (template, "For your report")
    by_hand: str = ""             # otter name of the question graded by hand in the notebook
    by_hand_asks: str = ""        # what that notebook cell asks (its prompt after the label)
    first: str = ""               # asked before the tables (Q3.2: the all-reduce time formula)
    exercises: tuple[str, ...] = ()  # otter names of its autograded exercises, in notebook order
    #: its place among the sections of the same key (the extras), smaller first; None: after those that
    #: have one. Equal places keep notebook order.
    order: int | None = None

    @property
    def heading(self) -> str:
        return f"{self.key} · {self.title} (notebook {self.notebook[:2]})"

    @property
    def by_hand_label(self) -> str:
        """The bold label that opens the hand-graded cell, without its points: ``Q1 (graded by hand``."""
        return f"{self.label} (graded by hand"

    @property
    def label(self) -> str:
        """How the notebooks name this section: the key (``Q4.2``), or ``Part 2 project`` / ``Extra``."""
        return "Part 2 project" if self.key == PART2 else self.key
