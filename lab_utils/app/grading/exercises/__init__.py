"""The autograded exercises (:data:`EXERCISES`, one per otter question, gathered from one module per notebook
or two: :mod:`.batch_sweep` (01), :mod:`.allreduce` (02 to 04), :mod:`.large_batch` (05), :mod:`.gpt` (06,
07), :mod:`.build_ddp` (09)) and :func:`check`, the call in every check cell. How each exercise is called and
which known mistakes it names (:func:`~.exercise.explain`): :mod:`.exercise`; how an answer is compared
(:func:`~.answers.same`): :mod:`.answers`. The cases live in the master notebooks' test cells (the package
docstring says how an exercise is written); the grader runs the same :meth:`Exercise.run` in its sandbox.
Importing this module is cheap: torch is imported only by the cases that build a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lab_utils.app.grading.exercises import allreduce, batch_sweep, build_ddp, gpt, large_batch
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.exercises.exercise import NOT_DONE, Exercise, explain

#: Every exercise by its otter question's name, notebook by notebook (each module's EXERCISES).
EXERCISES: dict[str, Exercise] = {ex.name: ex for ex in (
    *batch_sweep.EXERCISES, *allreduce.EXERCISES, *large_batch.EXERCISES, *gpt.EXERCISES,
    *build_ddp.EXERCISES)}


#: What a check cell prints when every case is right: the expected output of otter's doctest.
OK = "ok"


def verdict(question: str, function: Any, cases: Sequence[Any], expected: Sequence[Any] | None = None,
            hidden: bool = False) -> str:
    """"" when ``function`` answers every case right, else one sentence on the first case it gets
    wrong: "not done yet", a known mistake by name, how far off it is, or what it raised. The build
    writes ``expected`` in (without it, in the master, the answers are only computed); ``hidden=True``
    names a case by its number, never by its inputs."""
    ex = EXERCISES[question]
    if not callable(function):
        return f"{ex.function} is not a function ({type(function).__name__}): run the cell that defines it."
    for i, case in enumerate(cases):
        label = f"hidden case {i + 1} of {len(cases)}" if hidden else ex.describe(case)
        try:
            got = ex.run(function, case)
        except Exception as e:  # the student's code failing is an answer, said in one sentence
            return f"{label}: {ex.function} raised {type(e).__name__}: {e}"
        if got is None:
            return f"{NOT_DONE}: {ex.function} returns None; write its body above."
        if expected is None:
            continue
        want = expected[i]
        if not same(got, want, ex.rel_tol, ex.abs_tol):
            mistakes = [ex.mistake_answer(m, case, want) for m in ex.mistakes]
            return explain(ex, case, got, want, mistakes, label, hidden)
    return ""


def check(question: str, function: Any, cases: Sequence[Any], expected: Sequence[Any] | None = None,
          hidden: bool = False) -> None:
    """A check cell: print ``ok``, or the sentence of :func:`verdict`. Otter runs the cell as a doctest
    expecting ``ok``, so a failure reads "Expected: ok / Got: <the sentence>", never a traceback."""
    print(verdict(question, function, cases, expected, hidden) or OK)
