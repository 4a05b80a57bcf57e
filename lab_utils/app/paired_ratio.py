"""Timing two functions against each other, pair by pair: what ``python -m lab_utils bench timers``
reports as the timers' overhead (:mod:`lab_utils.app.bench_timers`). Seconds on the caller's clock."""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from lab_utils.learn.spread import percentile


@dataclass(frozen=True)
class PairedRatio:
    """What :func:`paired_ratio` measured: the median of the per-pair ratios a / b, their spread (the 10th and
    90th percentiles: how single pairs vary), a 95 % bootstrap interval of the median (how well the median
    itself is known), and each arm's median seconds."""

    pairs: int
    ratio: float
    ratio_p10: float
    ratio_p90: float
    ratio_low: float
    ratio_high: float
    a_seconds: float
    b_seconds: float


def paired_ratio(fn_a, fn_b, pairs: int = 100, warmup: int = 3, clock=time.perf_counter,
                 seconds: float | None = None, max_pairs: int = 5000, resamples: int = 1000) -> PairedRatio:
    """Time ``fn_a`` against ``fn_b`` interleaved unit by unit (a b, b a, a b, ...: the arm that goes first
    alternates), each call on ``clock`` (seconds), and take the ratio a / b within each pair. Adjacent calls
    see the same machine, so load from other processes that changes over seconds cancels in a pair's ratio;
    the median of the ratios ignores the pairs a burst of load hit. Each function must finish its device
    work itself (synchronize at its end). ``warmup`` untimed calls of each first; then ``pairs`` pairs, or
    with ``seconds`` as many more (an even number, up to ``max_pairs``) as fill that much of ``clock``."""
    if pairs < 2:
        raise ValueError("paired_ratio needs at least 2 pairs.")
    for _ in range(warmup):
        fn_a()
        fn_b()
    ratios, ta, tb = [], [], []
    i = 0
    while i < pairs or (seconds is not None and (sum(ta) + sum(tb) < seconds or i % 2) and i < max_pairs):
        t: dict[str, float] = {}
        for name, fn in (("a", fn_a), ("b", fn_b)) if i % 2 == 0 else (("b", fn_b), ("a", fn_a)):
            t0 = clock()
            fn()
            t[name] = clock() - t0
        ta.append(t["a"])
        tb.append(t["b"])
        ratios.append(t["a"] / t["b"] if t["b"] > 0 else math.inf)
        i += 1
    pairs = len(ratios)
    rng = random.Random(0)  # the same resamples every run: the interval moves only with the data
    medians = sorted(statistics.median(rng.choices(ratios, k=pairs)) for _ in range(resamples))
    return PairedRatio(pairs=pairs, ratio=statistics.median(ratios), ratio_p10=percentile(ratios, 10),
                       ratio_p90=percentile(ratios, 90), ratio_low=percentile(medians, 2.5),
                       ratio_high=percentile(medians, 97.5), a_seconds=statistics.median(ta),
                       b_seconds=statistics.median(tb))
