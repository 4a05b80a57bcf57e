"""The student notebook's ``grader``: otter's, with a failing check's sentence shown first.

``make student`` puts ``grader = Notebook("NN_....ipynb")`` from this module in every student
notebook. It runs otter's tests as otter does; only the display changes: otter reports a failed
check as "Expected: ok / Got: <sentence>" under about ten lines of doctest transcript, and
:class:`CheckResult` shows the sentence on top and the transcript only when asked.
"""

from __future__ import annotations

import html
import sys
from typing import Any

import otter

from lab_utils.app.grading.exercises import OK

__all__ = ["CheckResult", "Notebook", "sentence_of"]


def sentence_of(message: str) -> str:
    """The sentence a failed test case's check printed, from otter's doctest transcript (its "Got:"
    block); else the transcript's last line (an error the check did not catch)."""
    lines = (message or "").rstrip().split("\n")
    if "Got:" in [ln.strip() for ln in lines]:
        start = max(i for i, ln in enumerate(lines) if ln.strip() == "Got:") + 1
        got = [ln.strip() for ln in lines[start:] if ln.strip()]
        if got and got[-1] == OK:
            printed = " / ".join(got[:-1])
            return ("the answers are right, but your function printed something (" + printed[:200] + "): "
                    "the check compares what is printed, so remove its print() calls.")
        return " ".join(got) if got else lines[-1].strip()
    return lines[-1].strip() if lines else ""


class CheckResult:
    """What ``grader.check`` returns: otter's result (every attribute is otter's), displayed with the
    sentence of each failing test case first."""

    def __init__(self, question: str, result: Any):
        self.question = question
        self.result = result

    def __getattr__(self, name: str) -> Any:
        return getattr(self.result, name)

    def sentences(self) -> list[str]:
        """One sentence per failing test case (none when all passed)."""
        return [sentence_of(r.message) for r in getattr(self.result, "test_case_results", []) if not r.passed]

    def transcript(self) -> str:
        """Otter's own report (its doctest transcript for every test case)."""
        return repr(self.result)

    def __repr__(self) -> str:
        failing = self.sentences()
        if not failing:
            return repr(self.result)
        return "\n".join(f"{self.question}: {s}" for s in failing)

    def _repr_html_(self) -> str:
        failing = self.sentences()
        if not failing:
            own = getattr(self.result, "_repr_html_", None)
            return own() if own else html.escape(repr(self))
        lines = "".join(f"<p><strong style='color: #b00;'>{html.escape(self.question)}:</strong> "
                        f"{html.escape(s)}</p>" for s in failing)
        return (lines + "<details><summary>otter's transcript</summary><pre>"
                + html.escape(self.transcript()) + "</pre></details>")


class Notebook(otter.Notebook):
    """``otter.Notebook`` whose :meth:`check` returns a :class:`CheckResult`."""

    def check(self, question: str, global_env: dict[str, Any] | None = None) -> CheckResult | None:
        """Otter's check of ``question`` against the caller's globals, shown sentence first (None
        where otter returns None)."""
        if global_env is None:
            global_env = sys._getframe(1).f_globals
        result = super().check(question, global_env)
        return None if result is None else CheckResult(question, result)
