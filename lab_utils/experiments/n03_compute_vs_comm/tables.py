"""Notebook 03's tables and figure: Table 2 (compute vs communication per epoch, three ways), its
bars, each rank's phases; and :func:`comm_measurements`, the interface Table 3 (notebook 04) reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pandas as pd

from lab_utils.engine.records import aggregates, is_rank_record
from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n02_scaling.experiment import COMPUTE_VS_COMM, DDP, DP, SCALING, Settings
from lab_utils.experiments.n02_scaling.tables import method_label, oversubscribed
from lab_utils.experiments.shared.repeats import merge_repeats, spread_of_record
from lab_utils.experiments.shared.rows import T_N, blank_missing, is_missing, one_device_runs, pair_key, value
from lab_utils.learn.comm_probe import compute_to_comm, derived_comm, hidden_percent, noise_flag
from lab_utils.learn.metrics import note
from lab_utils.learn.spread import NOISE_SIGMAS, within_noise

#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
TABLE2_VIEW = ("method", "devices", "per_device_batch", "status", "T1_seconds", "TN_seconds",
               "compute_a_seconds", "comm_a_seconds", "comm_a_noise_flag", "exposed_comm_b_seconds",
               "allreduce_c_seconds", "hidden_percent")

__all__ = ["CommRow", "comm_measurements", "comm_row", "compute_vs_comm_figure", "compute_vs_comm_frame",
           "compute_vs_comm_rows", "compute_vs_comm_table", "rank_breakdown_frame"]


@dataclass
class CommRow:
    """Communication of one (method, devices, per-device batch) configuration, seconds per epoch."""

    method: str
    devices: int
    per_device_batch: int
    status: str
    t1_seconds: float | None = None
    tn_seconds: float | None = None
    compute_a_seconds: float | None = None
    comm_a_seconds: float | None = None
    exposed_b_seconds: float | None = None
    allreduce_c_seconds: float | None = None
    overlap_seconds: float | None = None
    overlap_fraction: float | None = None
    steps_per_epoch: int | None = None
    gradient_bytes: int | None = None
    backend: str | None = None
    skew_wait_seconds: float | None = None
    exposed_noise_b_seconds: float | None = None  # standard error of (b), per epoch (probe pairs)
    compute_to_comm_a: float | None = None  # compute (a) / comm (a)
    compute_to_comm_b: float | None = None  # (T(N) - (b)) / (b)
    hidden_percent: float | None = None     # 100 x overlap_fraction
    oversubscribed: str | None = None  # see :func:`oversubscribed`
    spread_pct: float | None = None    # T(N)'s spread, % (lab_utils.learn.spread): how the steps vary
    spread_of: str | None = None       # which spread: "p10-p90 of S steps" | "min-max of R repeats"
    tn_stderr_seconds: float | None = None  # the standard error of T(N) (lab_utils.learn.spread)
    t1_stderr_seconds: float | None = None  # the standard error of T(1)


def comm_measurements(store: ResultStore, devices: Sequence[int] | None = None,
                      methods: Sequence[str] = (DDP,)) -> list[CommRow]:
    """One :class:`CommRow` per stored N-device configuration of notebook 03 (the Table 3 interface):
    T(1) from ``scaling`` (same method and per-device batch), T(N) from ``compute_vs_comm`` (DDP) or
    ``scaling`` (DataParallel). Only this machine's devices' records (``latest_here``), repeats merged."""
    scaling = aggregates(merge_repeats(store.latest_here(SCALING).records))
    ones = one_device_runs(scaling)
    recs = aggregates(merge_repeats(store.latest_here(COMPUTE_VS_COMM).records))
    if DP in methods:
        recs += [r for r in scaling if r.config["method"] == DP and r.config["devices"] > 1]
    return [comm_row(r, ones.get(pair_key(r))) for r in recs if r.config["method"] in methods
            and (devices is None or r.config["devices"] in devices)]


def comm_row(rec: Record, one: Record | None) -> CommRow:
    """Table 2's figures for one N-device row and its one-device counterpart, records as
    :func:`~lab_utils.experiments.shared.repeats.merge_repeats` gives them (T(N): their
    ``train_seconds_median``)."""
    c, m = rec.config, rec.metrics
    row = CommRow(method=method_label(c["method"], c.get("backend"), c.get("device_type")),
                  devices=int(c["devices"]), per_device_batch=int(c["batch_size"]), backend=c.get("backend"),
                  status="ok" if rec.status == "ok" else (rec.reason or rec.status))
    if rec.status != "ok":
        return row
    row.tn_seconds, row.t1_seconds = value(rec, T_N), value(one, T_N)
    spread, spread1 = spread_of_record(rec), spread_of_record(one)
    if spread is not None:
        row.spread_pct, row.spread_of, row.tn_stderr_seconds = spread.pct, spread.of, spread.stderr_seconds
    if spread1 is not None:
        row.t1_stderr_seconds = spread1.stderr_seconds
    row.skew_wait_seconds, row.oversubscribed = value(rec, "skew_wait_seconds_max"), oversubscribed(rec)
    row.steps_per_epoch, row.gradient_bytes = m.get("steps"), m.get("gradient_bytes")
    if row.t1_seconds is None:
        row.status = "T(1) missing: run the one-device configuration (notebook 02)"
    else:
        row.compute_a_seconds, row.comm_a_seconds = derived_comm(row.t1_seconds, row.tn_seconds, row.devices)
        row.compute_to_comm_a = compute_to_comm(row.compute_a_seconds, row.comm_a_seconds)
    if "exposed_comm_seconds" in m:  # the worker's numbers, as measured (core.ranks.probe_seconds)
        row.exposed_b_seconds = m["exposed_comm_seconds"]
        row.allreduce_c_seconds = m["allreduce_seconds"]
        row.overlap_seconds, row.overlap_fraction = m.get("overlap_seconds"), m.get("overlap_fraction")
        row.exposed_noise_b_seconds = m.get("exposed_comm_noise_seconds")
        row.hidden_percent = hidden_percent(row.overlap_fraction)
        if row.tn_seconds is not None and (b := row.exposed_b_seconds) is not None:
            row.compute_to_comm_b = compute_to_comm(row.tn_seconds - b, b)
    return row


def compute_vs_comm_frame(rows: Sequence[CommRow]):
    """Table 2 as a DataFrame (seconds per epoch; ratios unitless)."""
    out = []
    for r in rows:
        d = {"method": r.method, "devices": r.devices, "per_device_batch": r.per_device_batch,
             "status": r.status, "T1_seconds": r.t1_seconds, "TN_seconds": r.tn_seconds,
             "spread_pct": r.spread_pct, "spread_of": r.spread_of,
             "compute_a_seconds": r.compute_a_seconds, "comm_a_seconds": r.comm_a_seconds,
             "compute_to_comm_a": r.compute_to_comm_a,
             "exposed_comm_b_seconds": r.exposed_b_seconds, "allreduce_c_seconds": r.allreduce_c_seconds,
             "overlap_c_minus_b_seconds": r.overlap_seconds,
             "hidden_percent": r.hidden_percent,
             "compute_to_comm_b": r.compute_to_comm_b, "skew_wait_seconds": r.skew_wait_seconds,
             "exposed_noise_b_seconds": r.exposed_noise_b_seconds,
             "noise_flag": noise_flag(r.exposed_b_seconds, r.exposed_noise_b_seconds),
             "comm_a_stderr_seconds": comm_a_stderr(r), "comm_a_noise_flag": comm_a_noise_flag(r),
             "oversubscribed": r.oversubscribed}
        out.append(d)
    cols = ["method", "devices", "per_device_batch", "status", "T1_seconds", "TN_seconds", "spread_pct",
            "spread_of", "compute_a_seconds", "comm_a_seconds", "compute_to_comm_a", "exposed_comm_b_seconds",
            "allreduce_c_seconds", "overlap_c_minus_b_seconds", "hidden_percent", "compute_to_comm_b",
            "skew_wait_seconds", "exposed_noise_b_seconds", "noise_flag", "comm_a_stderr_seconds",
            "comm_a_noise_flag", "oversubscribed"]
    df = pd.DataFrame(out, columns=cols)
    df.attrs["view"] = TABLE2_VIEW
    return df


# : Table 2 in a notebook (``df.attrs["view"]``, lab_utils.engine.table_view's narrow view): what a reader
# needs
#: first; the CSV has every column.
TABLE2_VIEW = ("method", "devices", "per_device_batch", "status", "TN_seconds", "compute_a_seconds",
               "comm_a_seconds", "comm_a_noise_flag", "exposed_comm_b_seconds", "noise_flag",
               "allreduce_c_seconds", "hidden_percent")


COMM_A_NOT_DISTINGUISHABLE = ("|comm (a)| within 2 standard errors: (a) not distinguishable from 0 (within "
                              "the runs' step noise; run-to-run variation needs REPEATS >= 3)")


def comm_a_stderr(row: CommRow) -> float | None:
    """The standard error of (a) = T(N) - T(1)/N in seconds: sqrt(se(T(N))^2 + (se(T(1))/N)^2), the two
    runs independent; None when either is unknown."""
    if row.tn_stderr_seconds is None or row.t1_stderr_seconds is None:
        return None
    return math.hypot(row.tn_stderr_seconds, row.t1_stderr_seconds / row.devices)


def comm_a_noise_flag(row: CommRow) -> str | None:
    """Table 2's ``comm_a_noise_flag``: :data:`COMM_A_NOT_DISTINGUISHABLE` when |(a)| is within 2 standard
    errors (:func:`lab_utils.learn.spread.within_noise`); None when it stands out, or is not judged."""
    return COMM_A_NOT_DISTINGUISHABLE if within_noise(row.comm_a_seconds, comm_a_stderr(row)) else None


TABLE2_NOTES = [
    "All seconds are per epoch (epoch 2 of 2, slowest rank). (a) the assignment's derivation: "
    "compute = T(1)/N, comm = T(N) - T(1)/N (negative: faster than a perfect split, the assumption fails).",
    "overlap = (c) - (b): all-reduce hidden behind backward; hidden_percent = overlap / (c).",
    f"exposed_noise_b_seconds: standard error of (b) over the probe's sync/no_sync pairs, per epoch. "
    f"noise_flag 'noise >= effect: not a result' when {NOISE_SIGMAS:g} x that error >= (b): then (b), the "
    "overlap and hidden_percent are not results (e.g. 100 % hidden at one batch and 0 % at another can both "
    "be noise); repeat with more comm_steps. Blank: records written before the noise was kept.",
    "compute_to_comm_a = compute (a) / comm (a); compute_to_comm_b = (T(N) - (b)) / (b).",
    "spread_pct: how much T(N)'s steps vary, in % of it (spread_of: 'p10-p90 of S steps' of the slowest "
    "rank, or 'min-max of R repeats' with REPEATS > 1, T(N) then the median); a description of the steps, "
    "not the uncertainty of T(N).",
    "comm_a_stderr_seconds: the standard error of (a), sqrt(se(T(N))^2 + (se(T(1))/N)^2), each time's from "
    "its step times (sd x sqrt(steps), steps taken as independent) or, with REPEATS > 1, from its repeats. "
    "comm_a_noise_flag: |(a)| <= 2 x that error, so (a) is not distinguishable from 0. Within one run it "
    "knows nothing of run-to-run variation: repeat (REPEATS >= 3) before you read a small (a).",
    "oversubscribed: more gloo threads than cores (quick: 4 single-thread ranks on 2 cores); the ranks took "
    "turns on the cores, so the row exercises the path and its split is not a measurement of the network.",
    "T(N) excludes every rank's loader wait and skew wait (the wait for the slowest rank's loader, timed "
    "by a barrier after the data movement; shown as skew_wait_seconds, slowest rank), so a slow loader "
    "is not counted as communication by (a). Blank skew_wait_seconds: a record from before the barrier "
    "existed, whose T(N) includes that wait.",
]


def compute_vs_comm_rows(records: Sequence[Record], settings: Settings) -> list[CommRow]:
    """Table 2's rows in table order, including rows that did not run (with their reason): every
    N-device aggregate of ``settings.comm_devices`` with its one-device counterpart (same method,
    same per-device batch) from the same records."""
    aggs = aggregates(merge_repeats(records))
    ones = one_device_runs(aggs)
    return [comm_row(r, ones.get(pair_key(r))) for r in aggs
            if r.config["devices"] != 1 and r.config["devices"] in settings.comm_devices]


def compute_vs_comm_table(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save Table 2 (``tables/compute_vs_comm.md`` + ``.csv``) and return it."""
    rows = compute_vs_comm_rows(records, settings)
    df = compute_vs_comm_frame(rows)
    notes = [TABLE2_NOTES[0], "Definitions (lab_utils.learn.metrics): " + note("train_seconds") + "; "
             + note(T_N) + "; " + note("exposed_comm_seconds") + "; " + note("allreduce_seconds") + ".",
             *TABLE2_NOTES[1:]]
    if any(r.backend == "gloo" for r in rows):
        notes.append("DDP (gloo, CPU processes): on a CPU the all-reduce thread competes with backward for "
                     "the same core, so (b) can exceed (c); on GPUs NCCL runs beside the compute kernels.")
    notes += [f"settings: {settings.label}", store.here_note(SCALING, COMPUTE_VS_COMM)]
    store.save_table(blank_missing(df.copy()), "compute_vs_comm", [r for r in records if r.status == "ok"],
                     title="Table 2: compute vs communication per epoch", notes=notes)
    return with_view(df, TABLE2_VIEW)


def compute_vs_comm_figure(store: ResultStore, df, records: Sequence[Record]):
    """Stacked bars per configuration: compute + communication by (a), and by (b) for DDP (labelled
    with the all-reduce time (c)). A negative (a) (T(N) < T(1)/N) is drawn as 0 and labelled."""
    import matplotlib.pyplot as plt
    import numpy as np

    ok = df[df["TN_seconds"].notna()]
    bars = []  # (label, compute, communication, kind, all-reduce (c))
    for _, r in ok.iterrows():
        base = f"{_short_method(r['method'])} N={r['devices']}\n{r['per_device_batch']}/device"
        if not is_missing(r["compute_a_seconds"]):
            a = (float(r["compute_a_seconds"]), float(r["comm_a_seconds"]))
            bars.append((base + "\nmethod (a)", *a, "a", None))
        if not is_missing(b := r["exposed_comm_b_seconds"]):
            c = r["allreduce_c_seconds"]
            bars.append((base + "\nmethod (b)", float(r["TN_seconds"]) - float(b), float(b), "b",
                         None if is_missing(c) else float(c)))
    labels, comp, comm, kinds, allreduce = (list(v) for v in zip(*bars)) if bars else ([],) * 5
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.4))
    x = np.arange(len(labels))
    shown = [max(0.0, v) for v in comm]
    ax.bar(x, comp, color="#4c72b0", label="compute")
    ax.bar(x, shown, bottom=comp, color="#dd8452", label="communication")
    for i, (k, c) in enumerate(zip(kinds, allreduce)):
        top = comp[i] + shown[i]
        if k == "b" and c is not None:
            ax.annotate(f"(c) {c:.3g} s", (x[i], top), ha="center", va="bottom", fontsize=6)
        if comm[i] < 0:
            ax.annotate(f"comm (a) = {comm[i]:.3g} s < 0", (x[i], top), ha="center", va="bottom",
                        fontsize=6, color="#a03000")
    ax.axhline(0, color="k", lw=0.8)
    if comp:
        ax.set_ylim(0, 1.15 * max(c + v for c, v in zip(comp, shown)))  # head-room for the labels
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("seconds per epoch (epoch 2)")
    ax.set_title("Compute vs communication per epoch\n"
                 "(a) T(1)/N split   (b) measured exposed   (c) all-reduce in flight", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the provenance label below the tick labels
    path = store.save_figure(fig, "compute_vs_comm", records)
    return fig, path


def _short_method(label: str) -> str:
    """A tick label's method from a table's method label: "DP", "DDP" (NCCL) or "DDP gloo/CPU"."""
    return "DP" if label.startswith("DataParallel") else "DDP gloo/CPU" if "gloo" in label else "DDP"


def rank_breakdown_frame(records: Sequence[Record], devices: int, batch_size: int):
    """Per-rank phases of the reported epoch for one DDP configuration (seconds), then the aggregate's
    mean over ranks and slowest rank (the reported T(N)), as the worker computed them.
    ``skew_wait_seconds`` is blank for records written before the skew barrier existed."""
    phases = ("epoch_seconds", "train_seconds", "data_loading_seconds", "data_movement_seconds",
              "compute_seconds", "communication_seconds", "skew_wait_seconds")
    rows, agg = [], None
    for r in records:
        c = r.config
        if c.get("method") != DDP or c["devices"] != devices or c["batch_size"] != batch_size:
            continue
        if is_rank_record(r):
            rows.append({"rank": c["rank"], **{k: r.metrics.get(k) for k in phases}})
        elif r.status == "ok":
            agg = r.metrics
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows).sort_values("rank")
    if agg is not None:
        df = pd.concat([df, pd.DataFrame([{"rank": "mean", **{k: agg.get(f"{k}_mean") for k in phases}},
                                          {"rank": f"slowest (rank {agg.get('slowest_rank')}, reported)",
                                           **{k: agg.get(k) for k in phases}}])], ignore_index=True)
    for k in phases:
        df[k] = pd.to_numeric(df[k])  # None (not measured) -> NaN, a blank cell
    return df
