"""Exercises that grade themselves: the student edition, the grading bundle, a sandboxed grader.

The notebooks in ``labs/`` are the *master* notebooks (otter assign v7 format):
:mod:`~lab_utils.app.grading.build` makes the student edition and the bundle from them (``make
student``), :mod:`~lab_utils.app.grading.grade` grades the handed-in copies (``make grade``).

How an exercise is written (so that it is graded)
-------------------------------------------------
1. **The notebook** (``labs/NN_*.ipynb``): an otter question block, in this order of cells (notebook
   06's Exercise 06-c, shortened)::

       [raw]  # BEGIN QUESTION
              name: q06_rank_time          (qNN_..., stable: the gradebook's column)
              points: [0, 2]               (one entry per test cell below: public 0, hidden > 0)
       [md]   the prompt: what the function returns, in which units
       [raw]  # BEGIN SOLUTION
       [code] def run_epoch_seconds(rank_seconds):          (one function; imports above it)
                  \"\"\"One line on what it returns.\"\"\"
                  # BEGIN SOLUTION
                  return max(rank_seconds)
                  # END SOLUTION
       [raw]  # END SOLUTION
       [raw]  # BEGIN TESTS
       [code] from lab_utils.app.grading import check

              check("q06_rank_time", run_epoch_seconds, [
                  ([2233.5],),                  # public cases: the student sees them
                  ([1384.64, 806.75],),
              ])
       [code] # HIDDEN
              from lab_utils.app.grading import check

              check("q06_rank_time", run_epoch_seconds, [
                  ([3.5, 3.25, 3.75, 3.0],),    # hidden cases: other values
              ])
       [raw]  # END TESTS
       [raw]  # END QUESTION

   A case is plain data (numbers, strings, lists, tuples, dicts: no names, no calls); by
   default it is the tuple of positional arguments (``([1384.64, 806.75],)``: one list). Write only
   inputs: the build computes each case's answer by running the solution above and writes it into
   the student's check cell.
   Nothing after the exercise may use the student's function. Hand-graded questions are otter's
   ``manual: true`` blocks, as before.
2. **The exercise** (:data:`lab_utils.app.grading.exercises.EXERCISES`): one entry in its notebook's
   module (``EXERCISES`` of e.g. :mod:`lab_utils.app.grading.exercises.gpt`), e.g.::

       Exercise("q06_rank_time", "run_epoch_seconds", mistakes=(
           Mistake("averaging ranks", "a step ends when the slowest rank is done: T(N) is the "
                   "slowest rank's time, not the mean", wrong=lambda ranks: sum(ranks) / len(ranks)),
       ))

   ``call`` (how to run a case when the function takes or returns objects: build a model from a
   dict case, turn returned transforms into their class names; the answer must be plain data),
   ``show`` (how a public case reads in a message), ``outputs`` (names of a tuple's values),
   ``needs`` (modules the cases import, e.g. ``("torch",)``: loaded before the timed cases) and
   ``rel_tol`` are optional. Each :class:`Mistake` is a known wrong version of the function
   (``wrong=``) or a wrong unit factor (``factor=8`` for bits instead of bytes); a wrong answer
   equal to a mistake's is named in one sentence, without showing a hidden case's inputs.
3. **Tests**: add the question to ``tests/test_exercises.py`` (``QUESTIONS``; a check of the
   solution against the lab's own function in ``CHECKS``) and, when it adds a notebook, to the
   all-solved folder of ``tests/test_grading.py``; they then check it end to end.

Importing this package is cheap: it loads the exercises (torch only when a case builds a model).
"""

from lab_utils.app.grading.exercises import EXERCISES, check
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.app.grading.fakes import FakeAsyncDevice

__all__ = ["EXERCISES", "Exercise", "FakeAsyncDevice", "Mistake", "check"]
