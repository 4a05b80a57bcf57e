"""One handed-in file, read as data and never run: which lab notebook it is (:func:`identify`, by
its stamp or title), its exercise functions and what needs a human look (:func:`prepare`), and
what the sandbox runs of it (:func:`job_for`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.app.grading import (
    exercise_code,
    programs,
    reaching,
    sandbox,
)
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.submissions import (
    Student,
    Submission,
)


@dataclass
class Work:
    """One handed-in file to grade (or one that cannot be graded, with why)."""
    sub: Submission
    student: Student
    book: str | None = None      # the lab notebook it is (stamp or title), once read
    guess: str | None = None     # a file that could not be read: the lab notebook its name suggests
    nb: dict | None = None
    problem: str = ""            # why not graded: "could not be read: ...", "not this lab's notebook..."
    nothing: bool = False        # a lab notebook without exercises (00, 08): nothing to grade
    notes: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)     # other files of this notebook, not graded
    code: dict[str, exercise_code.ExerciseCode] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    outcome: sandbox.Outcome | None = None
    record: dict | None = None

    @property
    def key(self) -> str:
        """Where its record is filed in the student's gradebook entry: the notebook, else the file."""
        return self.book or self.guess or f"(not graded) {self.sub.file}"


def _by_name(original: str, books) -> str | None:
    """The one lab notebook a file name suggests (``04_allreduce_bandwidth-1.ipynb``), else None."""
    guess = [k for k in books if k in original or original.startswith(k[:3])]
    return guess[0] if len(guess) == 1 else None


def identify(nb: dict, sub: Submission, manifest: dict) -> tuple[str | None, list[str]]:
    """Which lab notebook a submission is, and notes on it: its stamp (``make student`` writes it into
    every notebook's metadata), else its title. (None, [why]) for a notebook that is not this lab's."""
    known = {**manifest.get("ungraded", {}), **manifest["notebooks"]}
    meta = nb.get("metadata", {}).get(nbs.METADATA_KEY)
    name = meta.get("notebook") if isinstance(meta, dict) else None
    if name in known:
        if meta.get("version") != known[name]["version"]:
            graded = ": graded against this bundle's cases, check by hand" if name in manifest["notebooks"] \
                else ""
            return name, [f"notebook from another lab version ({meta.get('version')}; this bundle has "
                          f"{known[name]['version']}){graded}"]
        return name, []
    if name:
        return None, [f"not this lab's notebook: its stamp names {name!r}, which this bundle does not have "
                      f"({', '.join(sorted(known))}): a notebook of another version of the lab?"]
    title = nbs.title(nb)
    by_title = [k for k, v in known.items() if title and v.get("title") == title]
    if len(by_title) == 1:
        return by_title[0], [f"no {nbs.METADATA_KEY} stamp in its metadata (not saved from the student "
                             f"copy's notebook?): recognised as {by_title[0]} by its title, check by hand"]
    original = Path(sub.original or sub.path.name).name
    looks = _by_name(original, known)
    like = f"; its file name looks like {looks}'s, but a file name is not enough" if looks else ""
    return None, [f"not this lab's notebook: no {nbs.METADATA_KEY} stamp in its metadata (every notebook of "
                  f"the student copy has one) and its title is none of the lab's{like}"]


def prepare(work: Work, manifest: dict, specs: dict) -> None:
    """Read the submission (as data): notebook, exercise code, flags, notes."""
    nb, why = (None, work.sub.problem) if work.sub.problem else nbs.read_notebook(work.sub.path)
    if nb is None:   # filed under the notebook its name suggests: its row says why, not "no submission"
        original = Path(work.sub.original or work.sub.path.name).name
        work.problem, work.guess = f"could not be read: {why}", _by_name(original, manifest["notebooks"])
        return
    book, notes = identify(nb, work.sub, manifest)
    if book is None:
        work.problem = notes[0]
        return
    work.nb, work.book, work.notes = nb, book, notes
    if book not in manifest["notebooks"]:
        work.nothing = True
        return
    info, spec = manifest["notebooks"][book], specs[book]
    prog = programs.parse_program(nb)
    auto = [q["name"] for q in info["questions"] if not q["manual"]]
    for q in auto:
        qs = spec["questions"][q]
        work.code[q] = exercise_code.extract_exercise(prog, q, qs["function"], qs.get("blank", ""))
    baseline = set(info.get("baseline_patches", []))
    work.patches = [p for p in reaching.monkeypatches(prog) if p.rsplit(" (code cell", 1)[0] not in baseline]
    deleted = nbs.check_cells_deleted(nb, auto)
    if deleted:
        work.notes.append(f"check cell of {', '.join(deleted)} deleted (graded all the same)")
    work.notes += prog.syntax_errors


def job_for(work: Work, spec: dict) -> dict:
    """What the sandboxed child runs: each exercise's code and its cases' inputs (no answers)."""
    questions = []
    for q, code in work.code.items():
        if code.problem or code.blank:
            continue
        tests = spec["questions"][q]["tests"]
        cases = [[t, c, case["case"]] for t, test in enumerate(tests) for c, case in enumerate(test["cases"])]
        first = code.source.split("\n").index(next(line for line in code.source.split("\n")
                                                   if line.startswith(f"def {code.function}("))) + 1
        questions.append({"name": q, "function": code.function, "code": code.source, "first_line": first,
                          "cases": cases})
    return {"questions": questions}
