"""The alpha-beta fit (notebooks 02-04): alpha (seconds per ring step) and B (bytes/s of one link
direction) of :func:`lab_utils.learn.ring.ring_allreduce_seconds`, fitted to a benchmark's all-reduce
times, and the message sizes the benchmark (:mod:`lab_utils.experiments.n04_allreduce.experiment`) runs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.ring import GB, MIB, algbw_gb_per_s, bus_factor, busbw_gb_per_s, ring_allreduce_seconds


@dataclass
class AlphaBetaFit:
    """The fitted ring model for one rank count: alpha per ring step, B the busbw approached by large
    messages, their standard errors, the relative residuals."""

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
    """Least-squares fit of alpha and B to all-reduce timings on ``world_size`` ranks. The model is linear in
    ``(a0, a1) = (2(P-1) alpha, 2(P-1)/P / B)``: ``t = a0 + a1 S``. Sizes span eight orders of magnitude, so
    the residuals are *relative* (``(model - t) / t``): each size counts equally, not only the largest. A
    negative intercept (noise, no visible latency floor) is clamped at 0 and the slope refitted. Standard
    errors come from ``sigma^2 (A^T A)^-1`` with ``sigma^2 = RSS / (n - k)``, k the parameters fitted (2, or 1
    once the intercept is clamped), propagated to alpha and B."""
    p = check_positive_int(world_size, "world size (number of ranks P)")
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
