"""What an exercise is: :class:`Exercise` (how its function is called and shown, its tolerances, its
known :class:`Mistake` s) and :func:`explain`, the one sentence on a wrong answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lab_utils.app.grading.exercises.answers import (
    ABS_TOL,
    REL_TOL,
    difference,
    fmt,
    is_number,
    plain,
    same,
)

NOT_DONE = "not done yet"


@dataclass(frozen=True)
class Mistake:
    """A known wrong answer, named in the sentence "<name>: <why>": a wrong version of the function
    (``wrong``, same signature), the right answer times a wrong unit (``factor``), or computed from the
    right answer and the arguments (``given_right(right, *args)``: one piece off the right answer)."""
    name: str
    why: str
    wrong: Callable | None = None
    factor: float | None = None
    given_right: Callable | None = None


def call_positional(fn: Callable, case: Sequence) -> Any:
    """The default way to run a case: ``fn(*case)``; the answer as plain data."""
    return plain(fn(*case))


@dataclass(frozen=True)
class Exercise:
    """One autograded question (its fields: the package docstring). ``hint(got, want)`` may add an
    exercise-specific reason when no known mistake matches ("" for none)."""
    name: str
    function: str
    mistakes: tuple[Mistake, ...] = ()
    call: Callable[[Callable, Any], Any] = call_positional
    show: Callable[[Any], str] | None = None
    outputs: tuple[str, ...] = ()
    rel_tol: float = REL_TOL
    abs_tol: float = ABS_TOL   # numbers near 0 (a float32 answer's rounding: 1e-6 fits values up to ~10)
    hint: Callable[[Any, Any], str] | None = None
    needs: tuple[str, ...] = ()   # loaded by the grader before the timed cases start
    # Claims that state the answer: none may be visible in the student copy before the exercise
    # (matched case-insensitively, markdown emphasis removed; "re:..." is a regex).
    giveaways: tuple[str, ...] = ()
    # A find-the-bug exercise: the student copy starts from a buggy body (otter's PROMPT), one of the
    # mistakes, which the check names while it is still there.
    find_the_bug: bool = False
    # The lab's own implementation(s) of the function ("lab_utils.learn.speedup.speedup"): no show_source
    # cell before the exercise may show them.
    implemented_by: tuple[str, ...] = ()

    def run(self, fn: Callable, case: Any) -> Any:
        """The answer of ``fn`` on ``case`` (plain data; None = returned None)."""
        return self.call(fn, case)

    def describe(self, case: Any) -> str:
        if self.show is not None:
            return self.show(case)
        return f"{self.function}({', '.join(fmt(a) for a in case)})"

    def mistake_answer(self, mistake: Mistake, case: Any, want: Any) -> Any:
        """What ``mistake`` answers on ``case`` (None when it cannot be computed)."""
        given = mistake.given_right
        wrong = mistake.wrong or (given and (lambda *a, **k: given(want, *a, **k)))
        if wrong is not None:
            try:
                return self.run(wrong, case)
            except Exception:  # a wrong formula may divide by zero where the right one does not
                return None
        if mistake.factor is not None and is_number(want):
            return want * mistake.factor
        return None


def explain(ex: Exercise, case: Any, got: Any, want: Any, mistake_answers: Sequence[Any],
            label: str, hidden: bool) -> str:
    """One sentence on what is wrong with answer ``got`` ("" when it is right).

    ``label`` names the case ("hidden case 2 of 5", or the call for a public case).
    ``mistake_answers[i]`` is what ``ex.mistakes[i]`` answers on this case. For a hidden case the
    sentence names the mistake (or how far off the answer is) but never the inputs or the answer.
    """
    if got is None:
        return f"{NOT_DONE}: {ex.function} returns None; write its body."
    if same(got, want, ex.rel_tol, ex.abs_tol):
        return ""
    for m, answer in zip(ex.mistakes, mistake_answers):
        if (answer is not None and not same(answer, want, ex.rel_tol, ex.abs_tol)
                and same(got, answer, ex.rel_tol, ex.abs_tol)):
            numbers = "" if hidden else f" gives {fmt(got)}, expected {fmt(want)}"
            return f"{label}{numbers}: {m.name}: {m.why}."
    hint = ex.hint(got, want) if ex.hint else ""
    if hidden:
        return f"{label}: wrong answer ({hint or difference(got, want, ex.outputs, ex.rel_tol)})."
    return f"{label}: yours {fmt(got)}, expected {fmt(want)}" + (f" ({hint})." if hint else ".")
