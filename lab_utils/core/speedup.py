"""The numbers that span two runs: speedup, efficiency, scaled speedup, the serial fraction.

Each is defined once here and every table calls it (a table selects and renames what records hold;
what spans records is computed by one named function). Times in seconds; T(1) and T(N) are the
reported epoch's ``train_seconds`` (the slowest rank's, :mod:`lab_utils.core.ranks`) unless a table
says otherwise.
"""

from __future__ import annotations


def speedup(t1_seconds: float | None, tn_seconds: float | None) -> float | None:
    """Strong-scaling speedup T(1)/T(N) of the same work (None when either time is missing)."""
    if not t1_seconds or not tn_seconds:
        return None
    return t1_seconds / tn_seconds


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
    """The experimentally determined serial fraction e = (1/S - 1/N) / (1 - 1/N); None for N = 1.

    Amdahl's law S = 1 / (e + (1 - e)/N) solved for e. A fraction that grows with N points at
    overhead that grows with N (communication), not at a fixed serial part.
    """
    if devices <= 1 or not speedup_value or speedup_value <= 0:
        return None
    return (1 / speedup_value - 1 / devices) / (1 - 1 / devices)
