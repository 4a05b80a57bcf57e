"""A find-the-bug exercise: the student copy hands out an earlier report's buggy function (otter's
PROMPT block), whose check names the bug; the build refuses a bug that no public case names."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab_utils.app.grading import build, exercises
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.learn.errors import LabError

SOLUTION = '''def run_epoch_seconds(rank_seconds):
    """T(N) in seconds from each rank's epoch time."""
    """ # BEGIN PROMPT
    return sum(rank_seconds) / len(rank_seconds)
    """ # END PROMPT
    # BEGIN SOLUTION NO PROMPT
    return max(rank_seconds)
    # END SOLUTION
'''
MEAN = Mistake("averaging ranks", "T(N) is the slowest rank's time", wrong=lambda r: sum(r) / len(r))


def _question(public_cases: str, solution: str = SOLUTION) -> nbs.MasterQuestion:
    q = nbs.MasterQuestion("q99_bug", 2.0, False, solution=solution)
    hidden = '# HIDDEN\ncheck("q99_bug", run_epoch_seconds, [([3.0, 5.0, 4.0],)])'
    q.tests = [nbs.TestCell(False, 0.0, f'check("q99_bug", run_epoch_seconds, {public_cases})', 1),
               nbs.TestCell(True, 2.0, hidden, 2)]
    return q


@pytest.fixture
def bug_exercise(monkeypatch):
    ex = Exercise("q99_bug", "run_epoch_seconds", mistakes=(MEAN,), find_the_bug=True)
    monkeypatch.setitem(exercises.EXERCISES, "q99_bug", ex)
    return ex


def test_the_handed_out_function_is_the_buggy_one():
    ns: dict = {}
    exec(build.handed_out(SOLUTION), ns)
    assert ns["run_epoch_seconds"]([1.0, 3.0]) == 2.0      # the mean: the bug, live in the student copy
    ns = {}
    exec(SOLUTION, ns)
    assert ns["run_epoch_seconds"]([1.0, 3.0]) == 3.0      # the master runs the fix


def test_the_check_names_the_bug_while_it_is_there(bug_exercise):
    ns: dict = {}
    exec(build.handed_out(SOLUTION), ns)
    said = exercises.verdict("q99_bug", ns["run_epoch_seconds"], [([1.0, 3.0],)], [3.0])
    assert "averaging ranks" in said


def test_the_build_accepts_a_bug_a_public_case_names(bug_exercise):
    master = nbs.Master(Path("99_test.ipynb"))
    spec = build.exercise_spec(master, _question("[([1.0, 3.0],)]"))
    assert spec["tests"][0]["cases"][0]["expected"] == 3.0


def test_the_build_refuses_a_bug_no_public_case_names(bug_exercise):
    """The handed-out body takes the fastest rank, a bug the exercise does not list: its check could not
    name it."""
    master = nbs.Master(Path("99_test.ipynb"))
    fastest = SOLUTION.replace("return sum(rank_seconds) / len(rank_seconds)", "return min(rank_seconds)")
    with pytest.raises(LabError, match="answers no public case as one of the known mistakes"):
        build.exercise_spec(master, _question("[([1.0, 3.0],)]", fastest))


def test_the_exercise_and_its_cell_must_agree_on_being_find_the_bug(monkeypatch):
    monkeypatch.setitem(exercises.EXERCISES, "q99_bug", Exercise("q99_bug", "run_epoch_seconds",
                                                                 mistakes=(MEAN,)))
    with pytest.raises(LabError, match="find_the_bug=False"):
        build.exercise_spec(nbs.Master(Path("99_test.ipynb")), _question("[([1.0, 3.0],)]"))
