"""Ring all-reduce from first principles: bytes, time models, nccl-tests metrics, the fit.

The formulas behind notebooks 02-04 (Tables 1-3): what a gradient weighs, what a ring
all-reduce sends, how long it should take, and the alpha-beta model fitted to a
benchmark. Pure arithmetic on numbers, tested against values computed by hand;
:mod:`lab_utils.experiments.n04_allreduce.experiment` runs the benchmark and the projections on top of it.

**Bytes.** The gradient of a model is ``S = sum(numel x element_size)`` bytes over the
parameters that require grad (ResNet-18 in fp32: 11,173,962 x 4 = 44,695,848 bytes; the
parameter *count* is not a size). A ring all-reduce over ``P`` ranks is a reduce-scatter
followed by an all-gather, ``P-1`` steps each, every step sending one ``S/P`` chunk, so
each rank sends (and receives) ``2(P-1)/P x S`` bytes per all-reduce. Per epoch that is
multiplied by the iterations each rank runs: ``DistributedSampler`` (``drop_last=False``)
pads the data set by repeating samples until it divides evenly, giving every rank
``ceil(N/P)`` samples, and the ``DataLoader`` keeps the last partial batch, so a rank runs
``ceil(ceil(N/P)/b)`` iterations (which equals ``ceil(N/(P b))``).

**Time models** (alpha: seconds per message step, B: bytes/s of one link direction):

- ring: ``T = 2(P-1) alpha + 2(P-1)/P x S / B``: the bandwidth term hardly grows with P
  (bandwidth-optimal), the latency term grows linearly (small messages, many ranks);
- binary tree (reduce then broadcast, whole message per hop, no pipelining):
  ``2 ceil(log2 P) (alpha + S/B)``;
- recursive doubling: ``ceil(log2 P) (alpha + S/B)``: few steps, but the whole message
  on every step;
- recursive halving + doubling (Rabenseifner): ``2 log2 P alpha + 2(P-1)/P x S/B``;
- an earlier student's formula, ``(transfer + compute) x log2(P)`` (not the
  assignment's: the assignment asks for the ring), kept only to be compared: it is
  neither a ring nor a correct tree model.

**nccl-tests definitions** (``doc/PERFORMANCE.md``): ``algbw = S / t`` and, for
all-reduce, ``busbw = algbw x 2(n-1)/n``, both in decimal GB/s (1e9 bytes/s). In the
bandwidth-dominated regime busbw approaches B, so busbw is comparable across rank counts
and with a link's nominal bandwidth.

**The fit.** :func:`fit_alpha_beta` fits alpha and B of the ring model to measured
all-reduce times by least squares on relative error (:class:`AlphaBetaFit`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lab_utils.learn.errors import LabError, check_positive_int

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
GB = 1e9  # decimal, as nccl-tests reports GB/s

# DDP's default bucket_cap_mb=25, which torch turns into 25 * 1024 * 1024 bytes. Only when bucket_cap_mb
# is not given is the first bucket capped at 1 MiB (an explicit cap applies to every bucket). torch's
# reason, where nn/parallel/distributed.py builds the Reducer: "we allow for a single small bucket for
# parameters that are defined first, such that their gradients don't spill into a much larger bucket,
# adding unnecessary latency after gradient computation finishes": tail latency after backward ends.
# (DDP rebuilds its buckets after the first step in gradient-ready order, last layer first; the 1 MiB
# cap then falls on the first bucket sent: ResNet-18's 9.46 + 26.49 + 8.74 MB.)
DDP_BUCKET_BYTES = 25 * MIB
DDP_FIRST_BUCKET_BYTES = 1 * MIB


# --------------------------------------------------------------------------- bytes


def _check_world_size(world_size: object) -> int:
    return check_positive_int(world_size, "world size (number of ranks P)")


def _check_nonneg(value: float, what: str, above_zero: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0 or (above_zero and value == 0)):
        raise LabError(f"{what} must be a finite number {'above 0' if above_zero else 'of at least 0'}, "
                       f"got {value!r}.")
    return float(value)


def _check_pos(value: float, what: str) -> float:
    return _check_nonneg(value, what, above_zero=True)


def gradient_bytes(model) -> int:
    """Bytes of the gradients DDP all-reduces: sum of numel x element size over params requiring grad."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def bus_factor(world_size: int) -> float:
    """``2(P-1)/P``: the fraction of S each rank sends in a ring all-reduce (0 for one rank)."""
    p = _check_world_size(world_size)
    return 2 * (p - 1) / p


def ring_bytes_per_rank(size_bytes: float, world_size: int) -> float:
    """Bytes each rank sends in one ring all-reduce of ``size_bytes``: ``2(P-1)/P x S``."""
    s = _check_nonneg(size_bytes, "message size in bytes")
    p = _check_world_size(world_size)
    return 2 * (p - 1) * s / p


def samples_per_rank(dataset_size: int, world_size: int) -> int:
    """Samples one rank sees per epoch under ``DistributedSampler(drop_last=False)``: ``ceil(N/P)``
    (the sampler pads with repeated samples so every rank runs the same number of all-reduces)."""
    return -(-check_positive_int(dataset_size, "data set size") // _check_world_size(world_size))


def iterations_per_epoch(dataset_size: int, per_device_batch: int, world_size: int = 1) -> int:
    """Iterations (all-reduces) per epoch on each rank, the last partial batch included:
    ``ceil(ceil(N/P) / b)``, equal to ``ceil(N / (P x b))``."""
    b = check_positive_int(per_device_batch, "per-device batch size")
    return -(-samples_per_rank(dataset_size, world_size) // b)


def ring_bytes_per_epoch(size_bytes: float, world_size: int, dataset_size: int,
                         per_device_batch: int) -> float:
    """Bytes each rank sends in one epoch: iterations x ``2(P-1)/P x S``."""
    return iterations_per_epoch(dataset_size, per_device_batch, world_size) * ring_bytes_per_rank(
        size_bytes, world_size)


def achieved_gb_per_s(size_bytes: float, world_size: int, steps_per_epoch: int, seconds: float) -> float:
    """Table 3's achieved bandwidth of one rank, in decimal GB/s: the bytes it sent in one epoch
    (``steps_per_epoch`` ring all-reduces of ``2(P-1)/P x S`` each) over the epoch's communication
    ``seconds``, comparable with nccl-tests' busbw. One device sends nothing, so ``world_size`` 1 is
    refused (an earlier report gave a "bandwidth" for 1 GPU by dividing one gradient by a time).
    """
    p = _check_world_size(world_size)
    if p < 2:
        raise LabError("A bandwidth needs at least 2 ranks: one device communicates nothing (0 bytes per "
                       "epoch), so leave the 1-GPU row out of Table 3.")
    steps = check_positive_int(steps_per_epoch, "steps per epoch")
    t = _check_pos(seconds, "communication seconds")
    return steps * ring_bytes_per_rank(size_bytes, p) / t / GB


# --------------------------------------------------------------------------- time models


def _model_args(size_bytes: float, world_size: int, alpha_seconds: float,
                bandwidth_bytes_per_s: float) -> tuple[float, int, float, float, int]:
    """The time models' checked inputs (S, P, alpha, B) and ``ceil(log2 P)``."""
    p = _check_world_size(world_size)
    return (_check_nonneg(size_bytes, "message size in bytes"), p,
            _check_nonneg(alpha_seconds, "alpha (seconds per step)"),
            _check_pos(bandwidth_bytes_per_s, "bandwidth B (bytes/s)"), (p - 1).bit_length())


def ring_allreduce_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Ring all-reduce time: ``2(P-1) alpha + 2(P-1)/P x S / B`` seconds."""
    s, p, a, bw, _ = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * (p - 1) * a + ring_bytes_per_rank(s, p) / bw


def bucketed_ring_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                          bandwidth_bytes_per_s: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """All-reduce of ``size_bytes`` split into ``k = ceil(S / bucket_bytes)`` ring all-reduces, as DDP
    does: the latency term is paid once per bucket, ``k x 2(P-1) alpha + 2(P-1)/P x S / B`` (the ideal
    split: real DDP buckets follow parameter boundaries and a 1 MiB first bucket)."""
    s, p, a, bw, _ = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    k = max(1, math.ceil(s / _check_pos(bucket_bytes, "bucket size in bytes")))
    return k * 2 * (p - 1) * a + ring_bytes_per_rank(s, p) / bw


def predicted_allreduce_gb_per_s(bucket_bytes: Sequence[float], world_size: int, alpha_seconds: float,
                                 bandwidth_gb_per_s: float) -> float:
    """Notebook 04's prediction of Table 3's (c) rate, in decimal GB/s: what one rank sends for one step's
    buckets (``2(P-1)/P x b`` each) over their ring all-reduces one after another, each its own
    ``2(P-1) alpha + 2(P-1)/P x b / B``. Below ``B`` by the latency paid once per bucket; one rank refused."""
    p = _check_world_size(world_size)
    if p < 2:
        raise LabError("A bandwidth needs at least 2 ranks: one device communicates nothing.")
    sizes = [_check_pos(b, "bucket size in bytes") for b in bucket_bytes]
    if not sizes:
        raise LabError("Give the sizes of the step's buckets in bytes (at least one).")
    bw = _check_pos(bandwidth_gb_per_s, "bandwidth B (GB/s)") * GB
    seconds = sum(ring_allreduce_seconds(b, p, alpha_seconds, bw) for b in sizes)
    return sum(ring_bytes_per_rank(b, p) for b in sizes) / seconds / GB


def tree_allreduce_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Binary-tree reduce then broadcast, whole message per hop: ``2 ceil(log2 P) (alpha + S/B)``."""
    s, _, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * log2p * (a + s / bw)


def recursive_doubling_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                               bandwidth_bytes_per_s: float) -> float:
    """Recursive doubling (pairwise exchange of the whole message): ``ceil(log2 P) (alpha + S/B)``."""
    s, _, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return log2p * (a + s / bw)


def halving_doubling_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                             bandwidth_bytes_per_s: float) -> float:
    """Recursive halving + doubling (Rabenseifner): ``2 ceil(log2 P) alpha + 2(P-1)/P x S / B``."""
    s, p, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * log2p * a + ring_bytes_per_rank(s, p) / bw


def spec_log2_seconds(transfer_seconds: float, compute_seconds: float, world_size: int) -> float:
    """An earlier student's ``(transfer + compute) x log2(P)`` (not the spec's or the assignment's,
    despite the function's old name), shown for comparison only: log2(P) rounds that each move the
    *whole* gradient, a tree at best, unbounded in P where a ring's per-rank traffic stays below 2S.
    """
    p = _check_world_size(world_size)
    return (_check_nonneg(transfer_seconds, "transfer seconds")
            + _check_nonneg(compute_seconds, "compute seconds")) * math.log2(p)


ALGORITHMS = {
    "ring": ring_allreduce_seconds,
    "tree (reduce+broadcast)": tree_allreduce_seconds,
    "recursive doubling": recursive_doubling_seconds,
    "halving+doubling": halving_doubling_seconds,
}


# --------------------------------------------------------------------------- nccl-tests metrics


def algbw_gb_per_s(size_bytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth ``S / t`` in decimal GB/s."""
    return _check_nonneg(size_bytes, "message size in bytes") / _check_pos(seconds, "time in seconds") / GB


def busbw_gb_per_s(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth ``algbw x 2(n-1)/n`` (same units as ``algbw``)."""
    n = _check_world_size(world_size)
    return algbw * 2 * (n - 1) / n


# --------------------------------------------------------------------------- fit


@dataclass
class AlphaBetaFit:
    """Fitted ring model ``T(S, P) = 2(P-1) alpha + 2(P-1)/P x S / B`` for one rank count: alpha per
    ring step, B the busbw approached by large messages, their standard errors, the relative residuals."""

    world_size: int
    alpha_seconds: float
    bandwidth_bytes_per_s: float
    alpha_stderr_seconds: float
    bandwidth_stderr_bytes_per_s: float
    rms_relative_error: float
    max_relative_error: float
    n_points: int
    latency_clamped: bool = False

    @property
    def bandwidth_gb_per_s(self) -> float:
        return self.bandwidth_bytes_per_s / GB

    def predict_seconds(self, size_bytes: float, world_size: int | None = None) -> float:
        """Modelled ring all-reduce time of ``size_bytes`` on ``world_size`` ranks (default: fitted P)."""
        return ring_allreduce_seconds(size_bytes, world_size or self.world_size, self.alpha_seconds,
                                      self.bandwidth_bytes_per_s)

    def predict_busbw_gb_per_s(self, size_bytes: float, world_size: int | None = None) -> float:
        p = world_size or self.world_size
        return busbw_gb_per_s(algbw_gb_per_s(size_bytes, self.predict_seconds(size_bytes, p)), p)

    def summary(self) -> str:
        clamp = " (clamped at 0: the timings show no latency floor)" if self.latency_clamped else ""
        return (f"P={self.world_size}: alpha = {self.alpha_seconds * 1e6:.2f} +/- "
                f"{self.alpha_stderr_seconds * 1e6:.2f} us per step{clamp}, "
                f"B = {self.bandwidth_gb_per_s:.3f} "
                f"+/- {self.bandwidth_stderr_bytes_per_s / GB:.3f} GB/s; timings fit to "
                f"{100 * self.rms_relative_error:.1f}% rms (max {100 * self.max_relative_error:.1f}%) "
                f"over {self.n_points} sizes")

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bandwidth_gb_per_s"] = self.bandwidth_gb_per_s
        return d


def fit_alpha_beta(sizes_bytes: Sequence[float], seconds: Sequence[float], world_size: int) -> AlphaBetaFit:
    """Least-squares fit of alpha and B to all-reduce timings on ``world_size`` ranks.

    The model is linear in ``(a0, a1) = (2(P-1) alpha, 2(P-1)/P / B)``: ``t = a0 + a1 S``.
    Sizes span eight orders of magnitude, so the residuals are *relative*
    (``(model - t) / t``): each size counts equally, not only the largest. If the
    intercept comes out negative (noise, no visible latency floor) it is clamped at 0 and
    the slope refitted. Standard errors come from ``sigma^2 (A^T A)^-1`` with
    ``sigma^2 = RSS / (n - 2)``, propagated to alpha and B.
    """
    p = _check_world_size(world_size)
    if p < 2:
        raise LabError("An all-reduce on one rank moves no data; fit timings measured on at least 2 ranks.")
    s = np.asarray(sizes_bytes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    if s.shape != t.shape or s.ndim != 1:
        raise LabError("sizes_bytes and seconds must be two lists of the same length.")
    if len(s) < 3:
        raise LabError(f"Fitting alpha and B needs timings at 3 or more message sizes, got {len(s)}.")
    if np.any(~np.isfinite(t)) or np.any(t <= 0) or np.any(s < 0):
        raise LabError("Every timing must be a positive number of seconds and every size >= 0 bytes.")
    if len(np.unique(s)) < 2:
        raise LabError("Fitting alpha and B needs at least two different message sizes.")
    w = 1.0 / t
    design = np.stack([np.ones_like(s), s], axis=1) * w[:, None]
    target = t * w  # = 1
    coef, *_ = np.linalg.lstsq(design, target, rcond=None)
    clamped = bool(coef[0] < 0)
    if clamped:
        a1 = float(np.dot(design[:, 1], target) / np.dot(design[:, 1], design[:, 1]))
        coef = np.array([0.0, a1])
    a0, a1 = float(coef[0]), float(coef[1])
    if a1 <= 0:
        raise LabError("The timings do not grow with message size, so B cannot be fitted; "
                       "benchmark up to larger messages (raise --max-bytes).")
    resid = (a0 + a1 * s - t) / t
    n = len(s)
    dof = max(n - (1 if clamped else 2), 1)
    sigma2 = float(np.sum(resid**2)) / dof
    if clamped:
        var_a0, var_a1 = 0.0, sigma2 / float(np.dot(design[:, 1], design[:, 1]))
    else:
        cov = sigma2 * np.linalg.pinv(design.T @ design)
        var_a0, var_a1 = float(cov[0, 0]), float(cov[1, 1])
    steps = 2 * (p - 1)
    bandwidth = bus_factor(p) / a1
    return AlphaBetaFit(
        world_size=p,
        alpha_seconds=a0 / steps,
        bandwidth_bytes_per_s=bandwidth,
        alpha_stderr_seconds=math.sqrt(max(var_a0, 0.0)) / steps,
        bandwidth_stderr_bytes_per_s=bandwidth * math.sqrt(max(var_a1, 0.0)) / a1,
        rms_relative_error=float(np.sqrt(np.mean(resid**2))),
        max_relative_error=float(np.max(np.abs(resid))),
        n_points=n,
        latency_clamped=clamped,
    )


# --------------------------------------------------------------------------- benchmark message sizes


ELEMENT_BYTES = 4  # the benchmark all-reduces float32 tensors, like DDP's fp32 gradients


def message_sizes(min_bytes: int = 8, max_bytes: int = 8 * MIB) -> list[int]:
    """Message sizes in bytes doubling from ``min_bytes`` up to at most ``max_bytes``."""
    lo = check_positive_int(min_bytes, "smallest message size (bytes)")
    hi = check_positive_int(max_bytes, "largest message size (bytes)")
    if lo % ELEMENT_BYTES:
        raise LabError(f"The smallest message must be a multiple of {ELEMENT_BYTES} bytes (one fp32), "
                       f"got {lo}; use e.g. 8.")
    if hi < lo:
        raise LabError(f"The largest message ({hi} B) is below the smallest ({lo} B); raise --max-bytes.")
    return [lo << k for k in range((hi // lo).bit_length())]
