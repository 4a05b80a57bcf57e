"""Predict, then measure, in notebooks 02 and 03: the inputs a student predicts from and the cases of the
prediction tables (:func:`lab_utils.app.grading.predict.prediction_table`).

The inputs are measured before the prediction: one device's step time t(1), the gradient's bytes and
DDP's buckets (the one-device DDP runs of notebook 02; one process buckets as N do), and the
all-reduce's fitted line on each rank count (notebook 04's benchmark, measured from notebook 02 with
04's own settings, so notebook 04 finds it stored and measures nothing again). The model is
:mod:`lab_utils.learn.scaling_model`; the measurements are T(N) (Table 1), (b) and (c) (Table 2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from lab_utils.engine.records import aggregates
from lab_utils.engine.store import Record
from lab_utils.experiments.n02_scaling.experiment import DDP
from lab_utils.experiments.shared.repeats import merge_repeats
from lab_utils.experiments.shared.rows import T_N, one_device_runs, pair_key, per_step, value
from lab_utils.learn.alpha_beta import fit_alpha_beta
from lab_utils.learn.errors import LabError
from lab_utils.learn.ring import iterations_per_epoch
from lab_utils.learn.scaling_model import AllReduceLine

__all__ = ["Cases", "allreduce_lines", "comm_cases", "epoch_cases", "inputs_frames"]


def allreduce_lines(bench_records: Sequence[Record]) -> dict[int, AllReduceLine]:
    """The all-reduce's fitted line (:func:`lab_utils.learn.alpha_beta.fit_alpha_beta`, the fit of notebook
    04's table) per rank count of the benchmark's ok records: each size's mean time per all-reduce. A rank
    count it did not measure, or whose timings cannot be fitted, has none."""
    timings: dict[int, list[tuple[float, float]]] = {}
    for r in bench_records:
        if r.status == "ok":
            timings.setdefault(int(r.config["world_size"]), []).append(
                (float(r.config["size_bytes"]), float(r.metrics["time_us"]) * 1e-6))
    lines = {}
    for p, points in sorted(timings.items()):
        try:
            lines[p] = AllReduceLine.from_fit(fit_alpha_beta(*zip(*points), world_size=p))
        except LabError:  # too few sizes, or timings that do not grow with the size
            continue
    return lines


def _aggregates(records: Sequence[Record]) -> list[Record]:
    return [r for r in aggregates(merge_repeats(records)) if r.config.get("method") == DDP and value(r, T_N)]


def _ones(records: Sequence[Record]) -> dict[int, Record]:
    """The one-device DDP runs by per-device batch."""
    return {int(r.config["batch_size"]): r for r in one_device_runs(_aggregates(records)).values()}


def inputs_frames(one_device_records: Sequence[Record], lines: dict[int, AllReduceLine],
                  devices: Sequence[int]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """What a prediction starts from, measured: per per-device batch, one device's step time t(1), the
    steps of an epoch on each N of ``devices`` (``steps_N``), the gradient's bytes and DDP's buckets (in
    the order it all-reduces them); per rank count, the all-reduce's line (latency, bandwidth, how well
    it fits)."""
    rows = []
    for b, r in sorted(_ones(one_device_records).items()):
        images, buckets = int(r.config["train_images"]), r.metrics.get("bucket_bytes") or []
        rows.append({"per_device_batch": b, "t1_step_seconds": per_step(r),
                     **{f"steps_{n}": iterations_per_epoch(images, b, n) for n in devices if n > 1},
                     "gradient_bytes": r.metrics.get("gradient_bytes"),
                     "bucket_bytes": ", ".join(f"{x:,}" for x in buckets) or None})
    fits = [{"ranks": p, "latency_seconds": ln.latency_seconds, "bandwidth_gb_per_s": ln.bandwidth_gb_per_s,
             "fit_rms_error_pct": 100 * ln.rms_relative_error} for p, ln in sorted(lines.items())]
    return pd.DataFrame(rows), pd.DataFrame(fits, columns=["ranks", "latency_seconds", "bandwidth_gb_per_s",
                                                            "fit_rms_error_pct"])


@dataclass
class Cases:
    """The cases of a prediction table (keyword arguments of the student's function), their measurements,
    row labels, and the configurations left out with the reason."""

    cases: list[dict[str, Any]] = field(default_factory=list)
    measured: list[float | None] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def note(self) -> str:
        """One line on the rows left out ("" when none)."""
        return ("Not predicted: " + "; ".join(self.skipped) + ".") if self.skipped else ""


def epoch_cases(records: Sequence[Record], lines: dict[int, AllReduceLine]) -> Cases:
    """Exercise 02-b's prediction table: per N-device DDP run of Table 1 with a one-device run at its batch
    and an all-reduce line at its N, two rows, both measured T(N): the whole gradient exposed (no
    overlap), and only DDP's last bucket exposed (overlap at its best)."""
    out, ones = Cases(), one_device_runs(_aggregates(records))
    for r in _aggregates(records):
        n, b = int(r.config["devices"]), int(r.config["batch_size"])
        if n == 1:
            continue
        one, line = ones.get(pair_key(r)), lines.get(n)
        buckets = (one.metrics.get("bucket_bytes") if one else None) or r.metrics.get("bucket_bytes")
        why = ("no one-device run" if one is None else f"no all-reduce fit at {n} ranks" if line is None
               else "no bucket sizes in the record (measured by an older lab)" if not buckets else "")
        if why:
            out.skipped.append(f"{n} x {b}: {why}")
            continue
        base = {"t1_step_seconds": per_step(one), "steps": int(r.metrics["steps"]),
                "latency_seconds": line.latency_seconds, "bandwidth_gb_per_s": line.bandwidth_gb_per_s}
        for label, exposed in (("no overlap", r.metrics["gradient_bytes"]), ("last bucket only",
                                                                              buckets[-1])):
            out.cases.append({**base, "exposed_bytes": int(exposed)})
            out.measured.append(value(r, T_N))
            out.labels.append(f"{n} x {b}: {label}")
    return out


def comm_cases(records: Sequence[Record], lines: dict[int, AllReduceLine]) -> tuple[Cases, Cases]:
    """Exercise 03-b's two prediction tables, per N-device DDP run of Table 2 with an all-reduce line at
    its N: the same cases (its buckets, the line, its steps), measured (b) ``exposed_comm_seconds`` and
    (c) ``allreduce_seconds``."""
    b_cases, c_cases = Cases(), Cases()
    for r in _aggregates(records):
        n, b = int(r.config["devices"]), int(r.config["batch_size"])
        if n == 1 or "exposed_comm_seconds" not in r.metrics:
            continue
        line, buckets = lines.get(n), r.metrics.get("bucket_bytes")
        why = (f"no all-reduce fit at {n} ranks" if line is None
               else "no bucket sizes in the record (measured by an older lab)" if not buckets else "")
        for cases, key in ((b_cases, "exposed_comm_seconds"), (c_cases, "allreduce_seconds")):
            if why:
                cases.skipped.append(f"{n} x {b}: {why}")
                continue
            cases.cases.append({"bucket_bytes": [int(x) for x in buckets], "latency_seconds":
                                line.latency_seconds, "bandwidth_gb_per_s": line.bandwidth_gb_per_s,
                                "steps": int(r.metrics["steps"])})
            cases.measured.append(value(r, key))
            cases.labels.append(f"{n} x {b}")
    return b_cases, c_cases
