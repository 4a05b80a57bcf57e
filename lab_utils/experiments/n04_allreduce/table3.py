"""Notebook 04's Table 3: the bandwidth utilization of notebook 03's runs, from its records, by each
of the three communication times (:func:`report_utilization`), and exercise 04-d's
predict-then-measure cases (:func:`bandwidth_prediction_cases`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pandas as pd

from lab_utils.engine import profiles
from lab_utils.engine.config import CIFAR10_TRAIN_SIZE
from lab_utils.engine.records import aggregates
from lab_utils.experiments.n02_scaling import experiment as scaling
from lab_utils.experiments.n03_compute_vs_comm import tables as compute_vs_comm
from lab_utils.experiments.n04_allreduce.experiment import (
    LinkPeak,
    Settings,
)
from lab_utils.experiments.n04_allreduce.tables import BenchReport, ddp_bucket_sizes
from lab_utils.experiments.shared.anchors import (
    CIFAR10_TRAIN_IMAGES,
    FIRST_COHORT_LABEL,
    FIRST_COHORT_TABLE1_SECONDS,
    SPEC_GRADIENT_BYTES,
)
from lab_utils.experiments.shared.rows import blank_missing
from lab_utils.learn.comm_probe import derived_comm, noise_flag
from lab_utils.learn.errors import LabError
from lab_utils.learn.models import ResNet18
from lab_utils.learn.ring import (
    MIB,
    achieved_gb_per_s,
    gradient_bytes,
    iterations_per_epoch,
    ring_bytes_per_rank,
)

__all__ = ["CommMeasurement", "bandwidth_prediction_cases", "report_utilization", "utilization_rows"]


_Q32_NOTE = (
    "Which GB/s answers Q3.2: (a). The assignment defines communication time as Q3.1's T(N) - T(1)/N and "
    "utilization as ring bytes / that time, so (a) is the number the question asks for. It is not the "
    "all-reduce's speed: (a) bills every inefficiency as communication and misses the all-reduce time hidden "
    "behind backward. (c), the time an all-reduce was really in flight, is the honest rate of the network; "
    "report it beside (a) and explain the difference. (b) counts only the exposed part, so its GB/s is no "
    "rate of anything (it can exceed the link).")


_DP_ASSUMED_RING = "DataParallel (ASSUMED ring, as the assignment says; it is not one)"


_DP_ASSUMED_NOTE = (
    "DataParallel rows: the assignment says to assume DataParallel uses a ring all-reduce. It does not "
    "(one process scatters the batch, replicates the model from GPU 0 every step and reduces the gradients "
    "onto GPU 0), so these GB/s are the assignment's exercise under a false premise: bytes = steps x "
    "2(N-1)/N x S as if it were a ring, seconds = (a) T(N) - T(1)/N of the DataParallel runs. Only (a) "
    "exists for DataParallel (no DDP hook, no no_sync).")


# --------------------------------------------------------------------------- Table 3


@dataclass
class CommMeasurement:
    """Communication seconds per epoch for one (devices, per-GPU batch) from notebook 03, by ``source``
    (one of :data:`_COMM_SOURCES`); None with a ``reason`` when missing. ``steps_per_epoch`` (the run's
    measured steps) overrides the formula's iterations."""

    devices: int
    per_device_batch: int
    source: str
    seconds: float | None
    grad_bytes: int
    dataset_size: int
    reason: str | None = None
    steps_per_epoch: int | None = None
    method: str = "DDP"
    noise_seconds: float | None = None  # standard error of ``seconds`` where it was repeated (probe (b))
    spread_pct: float | None = None     # T(N)'s spread, % (notebook 03's Table 2, lab_utils.learn.spread)
    spread_of: str | None = None        # which spread: "p10-p90 of S steps" | "min-max of R repeats"


_COMM_SOURCES = ("(a) derived T(N)-T(1)/N", "(b) exposed (sync - no_sync)", "(c) hook all-reduce")
# Which Table 3 GB/s answers Q3.2, and why (one entry per source; the table's ``q3_2`` column).
_Q32_ROLE = dict(zip(_COMM_SOURCES, (
    "Q3.2 answer (the assignment's comm time, Q3.1's T(N) - T(1)/N)",
    "not Q3.2's answer: notebook 03's exposed communication (b)",
    "check: notebook 03's all-reduce time in flight (c)")))


def utilization_rows(measurements: Iterable[CommMeasurement], peak_busbw: Mapping[int, float] | float | None,
                     link: LinkPeak | None = None) -> list[dict[str, Any]]:
    """Table 3 rows: bytes per rank per epoch, seconds, achieved GB/s and utilization percentages.

    Achieved GB/s = ring bytes sent per rank per epoch / communication seconds
    (:func:`lab_utils.learn.ring.achieved_gb_per_s`), the quantity nccl-tests calls busbw, so it is
    compared with the benchmark's peak busbw (one number, or ranks -> peak) and the link's nominal
    one-direction bandwidth. A missing or non-positive time gives no rate; one device is refused.
    """
    measurements = list(measurements)
    for m in measurements:
        if m.devices < 2:
            raise LabError(f"Table 3 has no row for {m.devices} device ({m.method}, batch "
                           f"{m.per_device_batch}): one device communicates nothing, so it has no bandwidth; "
                           "measure 2 or more.")
    rows = []
    for m in measurements:
        steps = m.steps_per_epoch or iterations_per_epoch(m.dataset_size, m.per_device_batch, m.devices)
        peak = peak_busbw.get(m.devices) if isinstance(peak_busbw, Mapping) else peak_busbw
        row: dict[str, Any] = {
            "method": m.method, "devices": m.devices, "per_gpu_batch": m.per_device_batch,
            "comm_source": m.source, "grad_bytes": m.grad_bytes, "steps_per_epoch": steps,
            "bytes_per_rank_per_epoch": steps * ring_bytes_per_rank(m.grad_bytes, m.devices),
            "comm_seconds": m.seconds, "spread_pct": m.spread_pct, "spread_of": m.spread_of,
            "achieved_gb_per_s": None, "pct_of_bench_peak_busbw": None, "pct_of_link_nominal": None,
            "note": m.reason or "",
            "q3_2": _Q32_ROLE.get(m.source, ""), "noise_flag": noise_flag(m.seconds, m.noise_seconds),
        }
        if m.seconds is not None and m.seconds > 0:
            achieved = achieved_gb_per_s(m.grad_bytes, m.devices, steps, m.seconds)
            row["achieved_gb_per_s"] = achieved
            if peak:
                row["pct_of_bench_peak_busbw"] = 100 * achieved / peak
            if link is not None and link.gb_per_s:
                row["pct_of_link_nominal"] = 100 * achieved / link.gb_per_s
        elif m.seconds is not None and not m.reason:
            row["note"] = "communication time <= 0 (within noise): no rate"
        rows.append(row)
    return rows


_NB03_MISSING = "run notebook 03 first"


def _measurements(store, devices: Sequence[int] | None = None) -> list[CommMeasurement]:
    """Table 3's communication seconds from notebooks 02/03's records of this machine's devices
    (:func:`lab_utils.experiments.n03_compute_vs_comm.tables.comm_measurements`), for every (devices, per-GPU
    batch) of notebook 03's grid in this profile: DDP three rows, (a) (b) (c); DataParallel one, (a),
    labelled :data:`_DP_ASSUMED_RING`. A configuration not stored is one row with its bytes (the formula,
    for the model notebook 03 trains in this profile), no seconds, and why."""
    st = profiles.settings(scaling.Settings, store.profile)
    size, default = st.train_images or CIFAR10_TRAIN_SIZE, gradient_bytes(ResNet18(width=st.width))
    no_probe = "no no_sync/hook probe for this configuration in notebook 03 (see its Table 2)"
    out: list[CommMeasurement] = []
    for method in (scaling.DDP, scaling.DP):
        dp = method == scaling.DP
        found = {(r.devices, r.per_device_batch): r
                 for r in compute_vs_comm.comm_measurements(store, devices, methods=(method,))}
        for p in devices or st.comm_devices:
            for b in st.batch_sizes:
                r = found.get((p, b))
                if r is None or r.tn_seconds is None:
                    why = (r.status if r is not None else
                           f"no DataParallel run stored (it needs {p} GPUs; notebook 02 runs it where they "
                           "exist)" if dp else _NB03_MISSING if not found else
                           f"not measured by notebook 03 (its Table 2 says why, e.g. needs {p} devices or "
                           "skipped in this profile)")
                    out.append(CommMeasurement(p, b, _COMM_SOURCES[0] if dp else "none", None,
                                               int(r.gradient_bytes or default) if r else default, size,
                                               reason=why, method=_DP_ASSUMED_RING if dp else method))
                    continue
                sources = [(_COMM_SOURCES[0], r.comm_a_seconds, r.status, None)]
                if not dp:
                    sources += [(_COMM_SOURCES[1], r.exposed_b_seconds, no_probe, r.exposed_noise_b_seconds),
                                (_COMM_SOURCES[2], r.allreduce_c_seconds, no_probe, None)]
                out += [CommMeasurement(p, b, source, seconds, int(r.gradient_bytes or default), size,
                                        reason=None if seconds is not None else missing,
                                        steps_per_epoch=r.steps_per_epoch,
                                        method=_DP_ASSUMED_RING if dp else r.method, noise_seconds=noise,
                                        spread_pct=r.spread_pct, spread_of=r.spread_of)
                        for source, seconds, missing, noise in sources]
    return out


#: Table 3's label of the earlier cohort's rows: its report does not say which parallel module ran.
_ANCHOR_ASSUMED_RING = f"{FIRST_COHORT_LABEL}: ring ASSUMED, as the assignment says"


def _anchor_measurements(seconds: Mapping[tuple[int, int], float] = FIRST_COHORT_TABLE1_SECONDS,
                         grad_bytes: int = SPEC_GRADIENT_BYTES,
                         dataset_size: int = CIFAR10_TRAIN_IMAGES) -> list[CommMeasurement]:
    """The earlier cohort's Table 1 timings through Q3.1 and Q3.2 as the assignment asks (ring
    assumed, S = the spec's fp32 gradient bytes, 50,000 images): comm (a) = T(N) - T(1)/N
    (:func:`lab_utils.learn.comm_probe.derived_comm`), steps per epoch = ceil(50,000 / (N x b)) (N x b
    images per step, whichever parallel module ran it: the report does not say). A worked example,
    not a measurement here."""
    return [CommMeasurement(p, b, _COMM_SOURCES[0], derived_comm(seconds[(1, b)], tn, p)[1], grad_bytes,
                            dataset_size, steps_per_epoch=math.ceil(dataset_size / (p * b)),
                            method=_ANCHOR_ASSUMED_RING)
            for (p, b), tn in sorted(seconds.items()) if p >= 2 and (1, b) in seconds]


def report_utilization(store, settings: Settings, bench: BenchReport, link: LinkPeak):
    """Table 3 ``allreduce_utilization`` from notebooks 02/03's records and the benchmark's peaks
    (saved, returned)."""
    rows = utilization_rows(_measurements(store, settings.table_devices), bench.peaks, link)
    rows += utilization_rows(_anchor_measurements(), None, None)  # their hardware: no peak here
    df = pd.DataFrame(rows)
    df = blank_missing(df)
    nb03 = store.latest_here(scaling.COMPUTE_VS_COMM).records
    store.save_table(df, "allreduce_utilization", aggregates(nb03) + list(bench.records),
                     title="Table 3: all-reduce bandwidth utilization (Q3.2)",
                     notes=["bytes_per_rank_per_epoch = steps x 2(P-1)/P x grad_bytes (ring, per rank).",
                            "achieved_gb_per_s = bytes / comm_seconds (decimal GB/s), comparable with busbw; "
                            "pct_of_bench_peak_busbw uses the benchmark on the same number of ranks.",
                            _Q32_NOTE, _DP_ASSUMED_NOTE,
                            "The earlier cohort's rows use its published Table 1 timings (hardware unknown, "
                            "parallel module not stated; ring assumed as the assignment says): no benchmark "
                            "peak of theirs exists, so no percentage.",
                            "noise_flag: 2 x the standard error of (b) over the probe's pairs >= (b).",
                            "spread_pct / spread_of: the spread of T(N), the time (a) comes from "
                            "(notebook 03's Table 2: its steps' p10-p90, or min-max of REPEATS); blank for "
                            "the earlier cohort's rows, which published one number each.",
                            f"link: {link.description}",
                            store.here_note(scaling.SCALING, scaling.COMPUTE_VS_COMM)])
    return df


def _trained_buckets(st: scaling.Settings) -> list[int]:
    """DDP's buckets of the model notebooks 02/03 train in this profile: an explicit ``bucket_cap_mb`` is
    every bucket's cap (torch then has no small first bucket), else DDP's defaults (1 MiB, then 25 MiB)."""
    model = ResNet18(width=st.width)
    if st.bucket_cap_mb is None:
        return ddp_bucket_sizes(model)
    cap = int(st.bucket_cap_mb * MIB)
    return ddp_bucket_sizes(model, cap, cap)


def bandwidth_prediction_cases(store, settings: Settings, bench: BenchReport):
    """Exercise 04-d's predict-then-measure: per DDP configuration of Table 3, the case
    ``{bucket_bytes, world_size, alpha_seconds, bandwidth_gb_per_s}`` (the buckets of the model notebook 03
    trained, the fit on that rank count or else the one on the most ranks: the label then names it), the
    measured (c) GB/s (None where notebook 03 has none: the label says so, Table 3 why) and a label.
    Returns (cases, measured, labels); empty without a fit."""
    st = profiles.settings(scaling.Settings, store.profile)
    buckets = _trained_buckets(st)
    cases, measured, labels = [], [], []
    if not bench.fits:
        return cases, measured, labels
    for m in _measurements(store, settings.table_devices):
        if m.method == _DP_ASSUMED_RING or m.source not in (_COMM_SOURCES[2], "none"):
            continue
        fit = bench.fits.get(m.devices) or bench.reference_fit
        row = utilization_rows([m], None)[0]
        cases.append({"bucket_bytes": buckets, "world_size": m.devices, "alpha_seconds": fit.alpha_seconds,
                      "bandwidth_gb_per_s": fit.bandwidth_gb_per_s})
        measured.append(row["achieved_gb_per_s"])
        labels.append(f"{m.devices} x {m.per_device_batch}"
                      + (f" (fit on {fit.world_size})" if fit.world_size != m.devices else "")
                      + (": not measured" if m.reason else ""))
    return cases, measured, labels
