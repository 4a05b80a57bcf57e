"""The lab's model of an N-device epoch at a fixed per-device batch, from one device's step and the
all-reduce's measured line: what notebooks 02 and 03 ask students to predict before they measure.

The benchmark (notebook 04's experiment, run from notebook 02) times one all-reduce per message size on
P ranks; its fit (:func:`lab_utils.learn.alpha_beta.fit_alpha_beta`) is a straight line in the message
size (:class:`AllReduceLine`). With the per-device batch fixed, a step on N devices computes what a step
on one device computes, t(1); DDP then all-reduces the gradient, and what of that all-reduce cannot hide
behind backward makes each step longer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lab_utils.learn.alpha_beta import AlphaBetaFit
from lab_utils.learn.ring import GB


@dataclass(frozen=True)
class AllReduceLine:
    """A fitted all-reduce time on ``ranks`` ranks: ``latency_seconds`` (an empty message) + ``size_bytes``
    / (``bandwidth_gb_per_s`` x 1e9), without the ring's factors (notebook 04 takes them apart);
    ``rms_relative_error`` says how well the line fits its timings (0.1 = 10 %)."""

    ranks: int
    latency_seconds: float
    bandwidth_gb_per_s: float
    rms_relative_error: float = 0.0

    @classmethod
    def from_fit(cls, fit: AlphaBetaFit) -> AllReduceLine:
        """The line of an alpha-beta fit at its rank count: its empty message's time, 1 / slope in GB/s."""
        latency = fit.predict_seconds(0.0)
        per_byte = (fit.predict_seconds(GB) - latency) / GB
        return cls(fit.world_size, latency, 1 / per_byte / GB, fit.rms_relative_error)

    def seconds(self, size_bytes: float) -> float:
        """The line's time for an all-reduce of ``size_bytes`` bytes."""
        return allreduce_seconds(size_bytes, self.latency_seconds, self.bandwidth_gb_per_s)


def allreduce_seconds(size_bytes: float, latency_seconds: float, bandwidth_gb_per_s: float) -> float:
    """One all-reduce of ``size_bytes`` bytes on the line (latency, decimal GB/s): seconds."""
    return latency_seconds + size_bytes / (bandwidth_gb_per_s * GB)


def predicted_epoch_seconds(t1_step_seconds: float, steps: int, exposed_bytes: float, latency_seconds: float,
                            bandwidth_gb_per_s: float) -> float:
    """T(N) predicted at a fixed per-device batch (seconds): ``steps`` steps of the N-device epoch, each one
    device's step time ``t1_step_seconds`` and then an all-reduce of ``exposed_bytes`` that nothing hides,
    ``T(N) = steps(N) x (t(1) + t(exposed_bytes))``. No overlap: the whole gradient is exposed; with DDP's
    overlap at its best, only the last bucket (ready when backward ends). Exercise 02-b's reference."""
    return steps * (t1_step_seconds + allreduce_seconds(exposed_bytes, latency_seconds, bandwidth_gb_per_s))


def predicted_comm_seconds(bucket_bytes: Sequence[float], latency_seconds: float, bandwidth_gb_per_s: float,
                           steps: int) -> tuple[float, float]:
    """``(exposed (b), all-reduce in flight (c))`` per epoch of ``steps`` steps, seconds, predicted from
    DDP's buckets in the order it all-reduces them: (c) every bucket an all-reduce of its own on the line
    (paying the latency each time), added; (b) the last bucket's alone (the others hide behind backward).
    The optimistic end: a bucket still queued when backward ends adds to (b). Exercise 03-b's reference."""
    if not bucket_bytes:
        raise ValueError("predicted_comm_seconds needs at least one bucket")
    each = [allreduce_seconds(b, latency_seconds, bandwidth_gb_per_s) for b in bucket_bytes]
    return steps * each[-1], steps * sum(each)
