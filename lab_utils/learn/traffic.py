"""What one step of a hand-made DDP sends, and how long the alpha-beta model says it takes (notebook 09).

An implementation's ``messages()`` (:mod:`lab_utils.learn.handmade`) lists the collectives of one step
as ``(kind, bytes)``; :func:`overlap_exposed_seconds` and :func:`optimal_bucket_bytes` are the model
for equal buckets (Exercise 09-d). Bytes, seconds, bytes per second.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from lab_utils.learn.ring import ring_allreduce_seconds, ring_bytes_per_rank

ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"


def bytes_sent_per_rank(messages: Sequence[Sequence[Any]], world_size: int) -> float:
    """Bytes one rank sends per step in ring collectives: ``2(P-1)/P x S`` per all-reduce of S bytes,
    half that per reduce-scatter or all-gather (an all-reduce is one of each)."""
    return sum(ring_bytes_per_rank(size, world_size) * (1.0 if kind == ALL_REDUCE else 0.5)
               for kind, size in messages)


def predicted_seconds(messages: Sequence[Sequence[Any]], world_size: int, alpha_seconds: float,
                      bandwidth_bytes_per_s: float, overlaps: bool,
                      backward_seconds: float | None = None) -> tuple[float, float]:
    """(communication, exposed) seconds of one step by the ring's alpha-beta model, the collectives one after
    the other (a reduce-scatter or all-gather half an all-reduce). Exposed: all of it, unless the collectives
    ``overlaps`` backward (per tensor, bucketed, DDP); then, with ``backward_seconds`` T, a message starts
    once backward has produced its bytes (S bytes at a steady rate over T) and the one before it is done, and
    exposed = the last one's end - T; without T, the last message alone (a lower bound)."""
    times = [ring_allreduce_seconds(size, world_size, alpha_seconds, bandwidth_bytes_per_s)
             * (1.0 if kind == ALL_REDUCE else 0.5) for kind, size in messages]
    total = sum(times)
    if not overlaps or not times:
        return total, total
    if backward_seconds is None:
        return total, times[-1]
    produced, done = 0.0, 0.0
    whole = sum(size for _, size in messages) or 1
    for (_, size), t in zip(messages, times):
        produced += size
        done = max(done, backward_seconds * produced / whole) + t
    return total, max(0.0, done - backward_seconds)


def _exposed_by_buckets(k: int, gradient_bytes: float, world_size: int, alpha_seconds: float,
                        bandwidth_bytes_per_s: float, backward_seconds: float) -> float:
    c = ring_allreduce_seconds(gradient_bytes / k, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return max(c, backward_seconds / k + k * c - backward_seconds)


def overlap_exposed_seconds(bucket_bytes: float, gradient_bytes: float, world_size: int,
                            alpha_seconds: float, bandwidth_bytes_per_s: float,
                            backward_seconds: float) -> float:
    """Exercise 09-d's model: the communication left after backward ends, in seconds, when the
    ``gradient_bytes`` S are cut into ``k = ceil(S / bucket_bytes)`` equal buckets, backward produces
    them at a steady rate over ``backward_seconds`` T, and their ring all-reduces (c each) run one at a
    time. Bucket j is ready at ``jT/k``: if ``c <= T/k`` each all-reduce ends before the next bucket is
    ready and only the last is exposed (c); otherwise they queue from the first bucket on and end at
    ``T/k + k c``. Exposed = ``max(c, T/k + k c - T)``."""
    k = max(1, math.ceil(gradient_bytes / bucket_bytes))
    return _exposed_by_buckets(k, gradient_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s,
                               backward_seconds)


def optimal_bucket_bytes(gradient_bytes: float, world_size: int, alpha_seconds: float,
                         bandwidth_bytes_per_s: float, backward_seconds: float) -> float:
    """The bucket size ``S / k`` (bytes) whose whole number of buckets k minimizes
    :func:`overlap_exposed_seconds`. With ``A = 2(P-1) alpha`` and ``W = 2(P-1)/P x S / B``: while a bucket's
    all-reduce is no longer than the backward time that makes the next one (``A + W/k <= T/k``, up to
    ``k_c = (T - W) / A``), more buckets expose less (the last one, ``A + W/k``); past ``k_c`` they queue and
    expose ``kA + W + T/k - T``, smallest at ``k = sqrt(T/A)``. So the best k is ``max(k_c, sqrt(T/A), 1)``,
    rounded to the better neighbouring whole number: at ``k_c`` a bucket's communication takes exactly as
    long as its computation (CS336's assumption is this optimum). Without latency (alpha = 0) smaller
    buckets are always better: 0.0."""
    a = 2 * (world_size - 1) * alpha_seconds
    if a <= 0:
        return 0.0
    t = backward_seconds
    w = ring_allreduce_seconds(gradient_bytes, world_size, 0.0, bandwidth_bytes_per_s)
    best = max(1.0, (t - w) / a, math.sqrt(t / a))
    k = min({max(1, math.floor(best)), math.ceil(best)},
            key=lambda n: (_exposed_by_buckets(n, gradient_bytes, world_size, alpha_seconds,
                                               bandwidth_bytes_per_s, t), n))
    return gradient_bytes / k


def slowest_per_step(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each synchronized step's time: the slowest rank's (:mod:`lab_utils.learn.ranks` says why).
    ``per_rank[r][s]``: rank r, step s."""
    return [max(step) for step in zip(*per_rank)]
