"""The spread of a reported time and its standard error, computed once for every time of Tables 1-3 and
notebook 01's sweep. The **spread** says how much one step's (or repeat's) time varies, not how uncertain the
total is; the **standard error** says how well the row's total is known: whether a difference between two rows
(a speedup against 1, communication (a) against 0) is a result (:func:`within_noise`).

**One run** (the reported epoch's per-step training times, :func:`step_statistics`; over ranks, the T(N)
rank's): the spread is 100 x (p90 - p10) / p50 % of the row's time, "p10-p90 of S steps"; the total's standard
error is sd x sqrt(S) (S independent steps: relative to the total, the per-step variation / sqrt(S); 391 steps
that vary by 10 % give a p10-p90 band of about 26 % and a standard error of about 0.5 %). It knows nothing of
the run-to-run variation (another process on the node, clocks, the data order): that needs repeats.

**Repeats** (``REPEATS > 1`` in notebooks 01-03, each a stored configuration of its own, :data:`REPEAT` = 1,
2, ... for the second and later): the row's time is the MEDIAN of their ``train_seconds``
(:data:`TIME_MEDIAN`), the spread 100 x (max - min) / median %, "min-max of R repeats", the standard error
that of their mean, stdev / sqrt(R). :func:`time_spread` computes both;
:func:`lab_utils.experiments.shared.repeats.merge_repeats` gives every table one record per configuration with
its spread: tables select and rename, they do not recompute.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STEP_PERCENTILE_KEYS = ("step_train_seconds_p10", "step_train_seconds_p50", "step_train_seconds_p90")
STEP_SD_KEY = "step_train_seconds_sd"
STEP_STAT_KEYS = (*STEP_PERCENTILE_KEYS, STEP_SD_KEY)
#: The config field of a repeat (absent for the first measurement, so older keys stay valid).
REPEAT = "repeat"
#: Fewer optimizer steps give no one-run spread nor standard error (the p10 and p90 of 2 steps are just
#: those 2 steps); the row's ``spread_of`` says so.
MIN_STEPS = 5
#: A table row's time, which :func:`~lab_utils.experiments.shared.repeats.merge_repeats` writes: the median
#: over its ok repeats' ``train_seconds`` (one measurement: its own). The record's ``train_seconds`` stays
#: that of the repeat whose metrics it holds.
TIME_MEDIAN = "train_seconds_median"
#: What :func:`~lab_utils.experiments.shared.repeats.merge_repeats` adds to each merged record's metrics.
SPREAD_KEYS = (TIME_MEDIAN, "spread_pct", "spread_of", "spread_low_seconds", "spread_high_seconds", "repeats",
               "stderr_seconds", "stderr_pct")
#: A difference counts when it exceeds this many standard errors (about a 95 % interval).
NOISE_SIGMAS = 2.0


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by linear interpolation between the two nearest
    ranks (numpy's default): position (n - 1) x q / 100 in the sorted values."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(float(v) for v in values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def step_percentiles(step_seconds: Sequence[float]) -> dict[str, float | None]:
    """The 10th, 50th and 90th percentile of an epoch's per-step training times (seconds), keyed by
    :data:`STEP_PERCENTILE_KEYS`; all None for an epoch without timed steps."""
    if not step_seconds:
        return dict.fromkeys(STEP_PERCENTILE_KEYS)
    return {k: percentile(step_seconds, q) for k, q in zip(STEP_PERCENTILE_KEYS, (10, 50, 90), strict=True)}


def step_statistics(step_seconds: Sequence[float]) -> dict[str, float | None]:
    """What :func:`lab_utils.learn.loop.run_epoch` stores for an epoch: :func:`step_percentiles` and the
    sample standard deviation of the step times (seconds, :data:`STEP_SD_KEY`; None under 2 steps)."""
    sd = statistics.stdev(step_seconds) if len(step_seconds) > 1 else None
    return {**step_percentiles(step_seconds), STEP_SD_KEY: sd}


@dataclass(frozen=True)
class Spread:
    """A row's time (seconds) and its spread: the range ``low_seconds``..``high_seconds`` around it (one
    run: the time scaled by p10/p50 and p90/p50), ``pct`` = 100 x (high - low) / the row's time, ``of``:
    which spread it is; ``stderr_seconds``: the standard error of the row's time (None: not known)."""

    seconds: float
    low_seconds: float
    high_seconds: float
    pct: float | None
    of: str
    repeats: int = 1
    stderr_seconds: float | None = None

    @property
    def stderr_pct(self) -> float | None:
        """The standard error in % of the row's time (None: not known)."""
        if self.stderr_seconds is None or not self.seconds:
            return None
        return 100 * self.stderr_seconds / self.seconds

    @property
    def width_seconds(self) -> float:
        """high - low, in seconds."""
        return self.high_seconds - self.low_seconds


def time_spread(repeats: Sequence[Mapping[str, Any]], time_key: str = "train_seconds") -> Spread | None:
    """THE spread of a row's time from the metrics of its measurements (one per repeat; see the module
    docstring). None when no measurement holds the time, or one run holds no step percentiles."""
    times = [float(m[time_key]) for m in repeats if m.get(time_key) is not None]
    if not times:
        return None
    if len(times) > 1:
        med = statistics.median(times)
        return Spread(med, min(times), max(times), 100 * (max(times) - min(times)) / med if med else None,
                      f"min-max of {len(times)} repeats", repeats=len(times),
                      stderr_seconds=statistics.stdev(times) / math.sqrt(len(times)))
    m, t = next(m for m in repeats if m.get(time_key) is not None), times[0]
    p10, p50, p90 = (m.get(k) for k in STEP_PERCENTILE_KEYS)
    if p10 is None or p50 is None or p90 is None or not p50:
        return None
    steps = m.get("steps")
    if steps is not None and steps < MIN_STEPS:  # the row says why it has no spread
        return Spread(t, t, t, None, f"none: {steps} step(s), fewer than {MIN_STEPS}")
    sd = m.get(STEP_SD_KEY)  # None in records written before it was kept: no standard error
    return Spread(t, t * p10 / p50, t * p90 / p50, 100 * (p90 - p10) / p50,
                  f"p10-p90 of {steps} steps" if steps else "p10-p90 of the steps",
                  stderr_seconds=float(sd) * math.sqrt(steps) if sd is not None and steps else None)


def within_noise(effect: float | None, *stderrs: float | None, sigmas: float = NOISE_SIGMAS) -> bool | None:
    """Whether ``effect`` (a difference, seconds) is within ``sigmas`` standard errors of 0, not a result:
    the combined standard error is the root of the sum of squares of ``stderrs``, those of the independent
    times the difference is made of (each scaled as it enters it). None when any of them is unknown."""
    if effect is None or not stderrs or any(e is None for e in stderrs):
        return None
    if math.isnan(effect) or any(math.isnan(e) for e in stderrs):
        return None
    return sigmas * math.sqrt(sum(e * e for e in stderrs)) >= abs(effect)


