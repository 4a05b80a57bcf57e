"""The numbers that span two runs, each defined once here and called by every table: speedup, efficiency,
scaled speedup, the serial fraction. Times in seconds; T(1) and T(N) are the reported epoch's
``train_seconds`` (the slowest rank's, :mod:`lab_utils.learn.ranks`) unless a table says otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def speedup(t1_seconds: float | None, tn_seconds: float | None) -> float | None:
    """THE speedup of the lab's tables: T(1)/T(N), two times in seconds (None when either is missing,
    NaN or 0). Which time each is (T_N, a mean over ranks, seconds per token) the caller's column says."""
    if t1_seconds is None or tn_seconds is None:
        return None
    t1, tn = float(t1_seconds), float(tn_seconds)
    return None if math.isnan(t1) or math.isnan(tn) or not t1 or not tn else t1 / tn


def efficiency(speedup_value: float | None, devices: int) -> float | None:
    """Parallel efficiency: speedup / N (1.0 is perfect scaling)."""
    return None if speedup_value is None else speedup_value / devices


def scaled_speedup(t1_step_seconds: float | None, tn_step_seconds: float | None,
                   devices: int) -> float | None:
    """Gustafson's scaled speedup N x t(1)/t(N) on STEP times at a fixed per-device batch (weak scaling):
    a step on N devices does N times the work of a step on one."""
    s = speedup(t1_step_seconds, tn_step_seconds)
    return None if s is None else devices * s


def karp_flatt(speedup_value: float | None, devices: int) -> float | None:
    """The experimentally determined serial fraction e = (1/S - 1/N) / (1 - 1/N), Amdahl's law solved for
    e; None for N = 1. An e that grows with N points at overhead that grows with N (communication), not
    at a fixed serial part."""
    if devices <= 1 or not speedup_value or speedup_value <= 0:
        return None
    return (1 / speedup_value - 1 / devices) / (1 - 1 / devices)


def amdahl_speedup(serial_fraction: float, devices: int) -> float:
    """Amdahl's law (a fixed problem): S(N) = 1 / (e + (1 - e)/N), e the serial share of the ONE-device
    time (Karp-Flatt's e)."""
    return 1 / (serial_fraction + (1 - serial_fraction) / devices)


def gustafson_serial_fraction(karp_flatt_e: float, devices: int) -> float:
    """Gustafson's s from Karp-Flatt's e: s is the serial share of the N-DEVICE run's time, e that of the
    one-device time, so s = e / (e + (1 - e)/N) (the serial part e, over the N-device time e + (1-e)/N,
    both in units of T(1)). With that s, Gustafson's N - s(N - 1) at the measured N is the measured
    speedup again: the two laws differ in what they hold fixed, not at the point measured."""
    return karp_flatt_e / (karp_flatt_e + (1 - karp_flatt_e) / devices)


def gustafson_speedup(serial_fraction: float, devices: int) -> float:
    """Gustafson's scaled speedup (the problem grows with N, the run's time and its serial part fixed): S(N)
    = N - s (N - 1), s the serial share of the parallel run's time (:func:`gustafson_serial_fraction`)."""
    return devices - serial_fraction * (devices - 1)


@dataclass(frozen=True)
class StepGrowth:
    """What one step costs more on N devices than on one, at the same per-device batch (seconds). With
    T(1) = steps(1) t(1), T(N) = steps(N) t(N) and steps(N) = steps(1)/N (up to the last partial batch),
    the assignment's communication (a) = T(N) - T(1)/N is ``growth_per_epoch_seconds`` plus
    ``partial_batch_seconds``: a cost every step pays alike on one device and on N cancels in it, and
    only what GROWS per step with N remains."""

    t1_step_seconds: float
    tn_step_seconds: float
    growth_seconds: float         # t(N) - t(1)
    steps_n: int
    growth_per_epoch_seconds: float  # steps(N) x (t(N) - t(1))
    partial_batch_seconds: float  # (steps(N) - steps(1)/N) x t(1)


def per_step_growth(t1_seconds: float, steps_1: int, tn_seconds: float, steps_n: int,
                    devices: int) -> StepGrowth:
    """:class:`StepGrowth` from the epoch times T(1), T(N) (seconds) and their optimizer steps."""
    t1, tn = t1_seconds / steps_1, tn_seconds / steps_n
    return StepGrowth(t1, tn, tn - t1, steps_n, steps_n * (tn - t1), (steps_n - steps_1 / devices) * t1)
