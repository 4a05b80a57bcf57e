"""Exercises, the student edition and headless grading (otter-grader).

The notebooks in ``labs/`` are the *master* notebooks in otter-assign (v7) format: they keep
the solutions and run as they always did (``make lab``). This module

- :func:`build` runs ``otter assign`` on every master notebook that has an
  ``# ASSIGNMENT CONFIG`` cell and writes the **student edition** (solutions and hidden tests
  stripped, outputs cleared) to ``dist/student/`` and the **grading bundle** (one otter
  autograder zip per notebook and ``manifest.json``) to ``dist/grading/``;
- :func:`grade` grades a folder of submitted notebooks headless with ``otter run`` (no Docker),
  one subprocess per submission with a time limit, and writes ``gradebook.csv`` and
  ``feedback/<student>.md``. A broken submission becomes rows that say why; the batch goes on.

It also holds the small fakes the exercises' tests use (:class:`FakeAsyncDevice`) and the
messages that explain the classic mistakes (:func:`diagnose_speedup`). Importing this module
is cheap: otter is imported only by :func:`build` and :func:`grade`.
"""

from __future__ import annotations

import math

# --------------------------------------------------------------------------------------------
# Exercise helpers (imported by the tests in the notebooks)
# --------------------------------------------------------------------------------------------


class FakeAsyncDevice:
    """A pretend GPU with a controllable clock, to test a step timer on the CPU.

    Like CUDA, a step *launches* its work and returns at once (``launch_seconds`` of host time);
    the work runs later, one kernel after another. ``sync()`` waits until all queued work is done
    (``torch.cuda.synchronize()``); ``clock()`` reads the host clock (``time.perf_counter()``).
    ``queued_seconds`` is work still running from before the step (the previous step, a copy).

    The right answer, :attr:`true_seconds`, is the time from "everything before the step has
    finished" to "the step's own work has finished": ``launch_seconds + work_seconds``.
    """

    def __init__(self, queued_seconds: float = 0.0, launch_seconds: float = 1e-4):
        self.now = 0.0
        self.busy_until = float(queued_seconds)
        self.queued_seconds = float(queued_seconds)
        self.launch_seconds = float(launch_seconds)
        self.work_seconds = 0.0
        self.steps = 0
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1
        self.now = max(self.now, self.busy_until)

    def step_fn(self, work_seconds: float):
        """A step that queues ``work_seconds`` of device work and returns after the launch."""
        self.work_seconds = float(work_seconds)

        def step():
            self.steps += 1
            self.now += self.launch_seconds
            self.busy_until = max(self.busy_until, self.now) + self.work_seconds

        return step

    @property
    def true_seconds(self) -> float:
        return self.launch_seconds + self.work_seconds

    def agrees(self, seconds) -> bool:
        return (isinstance(seconds, (int, float)) and self.steps == 1
                and math.isclose(seconds, self.true_seconds, rel_tol=1e-9, abs_tol=1e-12))

    def diagnose(self, seconds) -> str:
        """One readable sentence on what a wrong ``seconds`` means ("" when it is right)."""
        if seconds is None:
            return "not done yet: time_step returns None; write its body."
        if not isinstance(seconds, (int, float)):
            return f"time_step must return seconds as a float, got {type(seconds).__name__}."
        if self.steps != 1:
            return f"time_step must call step() exactly once; it was called {self.steps} times."
        if self.agrees(seconds):
            return ""
        if math.isclose(seconds, self.launch_seconds, rel_tol=1e-6):
            return (f"got {seconds:.6g} s, the launch time only: you read the clock before the device "
                    "finished. Call sync() after step() and before reading the clock.")
        if math.isclose(seconds, self.true_seconds + self.queued_seconds, rel_tol=1e-6):
            return (f"got {seconds:.6g} s, which includes {self.queued_seconds:g} s of work queued "
                    "BEFORE the step: call sync() before you start the clock too.")
        return f"got {seconds!r} s, expected {self.true_seconds:.6g} s (launch + the step's work)."


def diagnose_speedup(result, t1_seconds: float, tn_seconds: float, n_devices: int) -> str:
    """A readable sentence on what is wrong with ``result = (speedup, efficiency)`` ("" if right).

    The reference is the lab's (``lab_utils.scaling``): speedup = T(1)/T(N) and
    efficiency = speedup / N, on unrounded epoch times.
    """
    if result is None:
        return "not done yet: speedup_and_efficiency returns None; write its body."
    try:
        s, e = result
        s, e = float(s), float(e)
    except (TypeError, ValueError):
        return f"return a pair (speedup, efficiency) of numbers, got {result!r}."
    want_s = t1_seconds / tn_seconds
    want_e = want_s / n_devices
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6)  # noqa: E731
    where = f"T(1)={t1_seconds} s, T({n_devices})={tn_seconds} s"
    if close(s, want_s) and close(e, want_e):
        return ""
    if close(s, n_devices * want_s):
        return (f"{where}: speedup {s:.4g} is N x T(1)/T(N). On EPOCH times that counts N twice "
                f"(each of the N devices already does 1/N of the epoch); the speedup is {want_s:.4g}.")
    if close(s, 1 / want_s):
        return f"{where}: speedup {s:.4g} is T(N)/T(1), upside down; the speedup is T(1)/T(N)."
    if not close(s, want_s):
        if abs(s - want_s) < 0.1:
            return (f"{where}: speedup {s:.4g}, the times give {want_s:.4g}. Do not round the times "
                    "(or copy a speedup from a report): compute it from the timings.")
        return f"{where}: speedup {s:.4g}, expected T(1)/T(N) = {want_s:.4g}."
    if close(e, want_s):
        return f"{where}: efficiency {e:.4g} equals the speedup; efficiency = speedup / N = {want_e:.4g}."
    return f"{where}: efficiency {e:.4g}, expected speedup / N = {want_e:.4g}."
