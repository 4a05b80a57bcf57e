"""Notebook 02's tables and figure: Table 1 (time and speedup over devices), the speedup definitions,
the serial fraction, the communication volume. T(N) is the reported epoch's ``train_seconds`` of the
slowest rank (:mod:`lab_utils.learn.metrics`). Strong vs weak scaling (Q2):
:mod:`~lab_utils.experiments.n02_scaling.strong_weak`.
"""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from lab_utils.engine.config import CIFAR10_TRAIN_SIZE
from lab_utils.engine.records import aggregates, is_rank_record
from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n02_scaling.experiment import DP, Settings
from lab_utils.experiments.shared.anchors import (
    FIRST_COHORT_LABEL,
    FIRST_COHORT_MEASURED,
    FIRST_COHORT_PRINTED_SPEEDUPS,
    FIRST_COHORT_TABLE1_SECONDS,
    OTHER_COHORT_LABEL,
    OTHER_COHORT_LOGGED_STEPS,
    OTHER_COHORT_MEASURED,
    OTHER_COHORT_SECONDS,
    global_batch_steps,
    other_cohort_per_gpu_batch,
)
from lab_utils.experiments.shared.repeats import merge_repeats, spread_of_record
from lab_utils.experiments.shared.rows import (
    T_N,
    blank_missing,
    is_missing,
    one_device_runs,
    pair_key,
    per_step,
    value,
)
from lab_utils.learn.metrics import note
from lab_utils.learn.ring import ring_bytes_per_rank
from lab_utils.learn.speedup import (
    amdahl_speedup,
    efficiency,
    gustafson_serial_fraction,
    gustafson_speedup,
    karp_flatt,
    per_step_growth,
    scaled_speedup,
    speedup,
)
from lab_utils.learn.spread import Spread, within_noise

__all__ = ["anchor_frame", "comm_volume_frame", "method_label", "ok_records", "oversubscribed",
           "per_step_growth_frame", "scaling_frame", "scaling_table", "serial_fraction_frame",
           "speedup_definitions_frame", "speedup_figure"]


#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
TABLE1_VIEW = ("method", "devices", "per_device_batch", "status", "epoch2_train_seconds", "stderr_pct",
               "TN_seconds_per_step", "speedup", "scaled_speedup", "efficiency", "skew_wait_seconds",
               "speedup_noise_flag")


def ok_records(records: Sequence[Record]) -> list[Record]:
    """The records whose run succeeded (status "ok")."""
    return [r for r in records if r.status == "ok"]


def oversubscribed(rec: Record | None) -> str | None:
    """"4 processes x 1 thread on 2 cores" for a measured gloo run whose ranks had more torch
    threads than the machine had cores (they time-share the cores, so its times do not show
    scaling); None otherwise, or where the record does not say (cores or threads unknown)."""
    if rec is None or rec.status != "ok" or rec.config.get("device_type") != "cpu":
        return None
    n, threads, cores = int(rec.config.get("devices", 1)), rec.threads, rec.hardware.get("cpu_cores")
    if not threads or not cores or n * threads <= cores:
        return None
    return f"{n} processes x {threads} thread{'s' if threads > 1 else ''} on {cores} cores"


def method_label(method: str, backend: str | None, device_type: str | None) -> str:
    """A table's method label: "DataParallel (1 process, GPUs)", "DDP (gloo, CPU processes)" or
    "DDP (NCCL, GPUs)"."""
    if method == DP:
        return "DataParallel (1 process, GPUs)"
    if backend == "gloo" or device_type == "cpu":
        return "DDP (gloo, CPU processes)"
    return "DDP (NCCL, GPUs)"


_SPEEDUP_DEFINITION_COLUMNS = ["method", "devices", "per_device_batch",
                              "lab: T(1)/T(N), epoch (strong)", "forum: N x t(1)/t(N), step (scaled, weak)",
                              "forum's formula on epoch times: N x T(1)/T(N)"]


def speedup_definitions_frame(table=None, dataset_size: int | None = None):
    """Q2's two speedup definitions side by side, per (method, N > 1, per-device batch): the lab's
    T(1)/T(N) on epoch times, the forum's N x t(1)/t(N) on step times (the scaled speedup), and the
    forum's formula on epoch times. From Table 1 (:func:`scaling_frame`) when given, then the earlier
    cohort's published Table 1, whose steps per epoch are ceil(N_images / (N x b)) (N x b images per
    optimizer step, whichever parallel module ran it: its report does not say)."""
    rows = []
    if table is not None and len(table):
        ok = table[table["speedup"].notna() & (table["devices"] > 1)]
        rows += ok[["method", "devices", "per_device_batch", "speedup", "scaled_speedup",
                    "n_t1_over_tn_epoch"]].itertuples(index=False)
    images, seconds = dataset_size or CIFAR10_TRAIN_SIZE, FIRST_COHORT_TABLE1_SECONDS
    rows += [(FIRST_COHORT_LABEL, n, b, speedup(seconds[(1, b)], tn),
              scaled_speedup(seconds[(1, b)] / global_batch_steps(b, images),
                             tn / global_batch_steps(n * b, images), n), n * speedup(seconds[(1, b)], tn))
             for (n, b), tn in seconds.items() if n != 1]
    return pd.DataFrame([tuple(r) for r in rows], columns=_SPEEDUP_DEFINITION_COLUMNS)


def _karp_flatt_note(speedup: float | None, devices: int) -> str:
    """What a Karp-Flatt fraction outside [0, 1] means, in words ("" inside it): e < 0 exactly when the
    speedup exceeds N (super-linear), e > 1 exactly when it is below 1. Neither is a serial fraction."""
    if speedup is None or devices <= 1 or is_missing(speedup):
        return ""
    if speedup > devices:
        return "speedup > N (super-linear): question the measurement before projecting"
    if speedup < 1:
        return (f"speedup {speedup:.3g} < 1: {devices} devices were SLOWER than one (e > 1 is no serial "
                "fraction); nothing to project")
    return ""


def serial_fraction_frame(table, project_to: int = 8):
    """From Table 1: each N > 1 row's Karp-Flatt serial fraction e (the serial share of the one-device
    time), Gustafson's s for the same run (the serial share of the N-device run's time,
    :func:`~lab_utils.learn.speedup.gustafson_serial_fraction`), and what each law predicts at
    ``project_to`` devices: Amdahl with e (the same problem), Gustafson with s (a problem that grows with
    N). At the measured N both give the measured speedup. A speedup above N (e < 0) or below 1 (e > 1:
    slower than one device) is flagged instead of projected: no serial fraction explains it."""
    rows = []
    ok = table[table["speedup"].notna() & (table["devices"] > 1)]
    for _, r in ok.iterrows():
        e, n = r["serial_fraction"], int(r["devices"])
        fits = e is not None and 0 <= e <= 1
        s = gustafson_serial_fraction(e, n) if fits else None
        rows.append({**{k: r[k] for k in ("method", "devices", "per_device_batch", "speedup")},
                     "serial_fraction": e, "gustafson_serial_fraction": s,
                     f"amdahl_speedup_at_{project_to}": amdahl_speedup(e, project_to) if fits else None,
                     f"gustafson_speedup_at_{project_to}": gustafson_speedup(s, project_to) if fits else None,
                     "note": "" if fits else _karp_flatt_note(float(r["speedup"]), n)})
    return pd.DataFrame(rows)


def anchor_frame():
    """Both earlier cohorts' epoch times, steps per epoch (ceil(50,000 / global batch); ``steps_logged``:
    what the other cohort's logs count) and speedups, sanity anchors, each as what it measured: the
    earlier cohort's per-GPU batch b fixed, epoch-2 training seconds, T(1, b)/T(N, b) recomputed from its
    times beside the ``printed_speedup`` of its report (its 2 x 32 is a slip: 1.86 for 1.784); the other
    cohort's global batch G fixed, epoch wall-clock with the loader, T(1, G)/T(N, G)."""
    rows = []
    for label, measured, table, fixed in (
            (FIRST_COHORT_LABEL, FIRST_COHORT_MEASURED, FIRST_COHORT_TABLE1_SECONDS, "per-GPU batch"),
            (OTHER_COHORT_LABEL, OTHER_COHORT_MEASURED, OTHER_COHORT_SECONDS, "global batch")):
        for (n, b), t in sorted(table.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            per_gpu_fixed, s = fixed == "per-GPU batch", speedup(table.get((1, b)), t)
            g = n * b if per_gpu_fixed else b
            rows.append({"method": label, "fixed": fixed, "gpus": n,
                         "per_gpu_batch": b if per_gpu_fixed else other_cohort_per_gpu_batch(n, b),
                         "global_batch": g, "steps_per_epoch": global_batch_steps(g),
                         "steps_logged": None if per_gpu_fixed else OTHER_COHORT_LOGGED_STEPS.get(g),
                         "epoch2_seconds": t, "speedup": s,
                         "printed_speedup": (FIRST_COHORT_PRINTED_SPEEDUPS.get((n, b)) if per_gpu_fixed
                                             else None),
                         "efficiency": efficiency(s, n), "measured": measured})
    return blank_missing(pd.DataFrame(rows))


_GROWTH_COLUMNS = ["method", "devices", "per_device_batch", "t1_step_ms", "tn_step_ms", "step_growth_ms",
                   "efficiency", "steps_n", "steps_n_x_growth_seconds", "partial_batch_seconds",
                   "comm_a_seconds"]


def _growth_row(method: str, n: int, b: int, t1: float, steps1: int, tn: float, stepsn: int) -> dict:
    g = per_step_growth(t1, steps1, tn, stepsn, n)
    return dict(zip(_GROWTH_COLUMNS, (
        method, n, b, 1e3 * g.t1_step_seconds, 1e3 * g.tn_step_seconds, 1e3 * g.growth_seconds,
        g.t1_step_seconds / g.tn_step_seconds, stepsn, g.growth_per_epoch_seconds, g.partial_batch_seconds,
        tn - t1 / n)))


def per_step_growth_frame(records: Sequence[Record] | None = None):
    """Why small per-device batches scale badly, per step (:func:`lab_utils.learn.speedup.per_step_growth`):
    for each N-device row of this run's Table 1 (from ``records``) and of the earlier cohort's, the step
    time on one device t(1) and on N, t(N), what a step costs more on N (``step_growth_ms``), the
    per-step efficiency t(1)/t(N) (= the epoch's efficiency up to the last partial batch), and (a) =
    T(N) - T(1)/N = steps(N) x growth + the last partial batch's share. Milliseconds per step, seconds
    per epoch."""
    rows = []
    aggs = [r for r in aggregates(merge_repeats(records or [])) if value(r, T_N)]
    ones = one_device_runs(aggs)
    for r in aggs:
        one = ones.get(pair_key(r))
        c = r.config
        if c["devices"] > 1 and one is not None and r.metrics.get("steps") and one.metrics.get("steps"):
            rows.append(_growth_row(method_label(c["method"], c.get("backend"), c.get("device_type")),
                                    int(c["devices"]), int(c["batch_size"]), value(one, T_N),
                                    int(one.metrics["steps"]), value(r, T_N), int(r.metrics["steps"])))
    seconds = FIRST_COHORT_TABLE1_SECONDS
    rows += [_growth_row(FIRST_COHORT_LABEL, n, b, seconds[(1, b)], global_batch_steps(b), tn,
                         global_batch_steps(n * b)) for (n, b), tn in sorted(seconds.items()) if n > 1]
    return pd.DataFrame(rows, columns=_GROWTH_COLUMNS)


def comm_volume_frame(records: Sequence[Record]):
    """Why small per-device batches scale badly: per stored N-device DDP run, the ring all-reduce
    bytes each rank sends per step and per epoch (2(N-1)/N x S, S = fp32 gradient bytes), next to
    the images each device computes per step. Bytes are decimal (MB = 1e6)."""
    rows = []
    for r in merge_repeats(records):
        c, m = r.config, r.metrics
        if r.status != "ok" or is_rank_record(r) or c["devices"] < 2:
            continue
        per_step = ring_bytes_per_rank(m["gradient_bytes"], c["devices"])
        rows.append({"method": method_label(c["method"], c.get("backend"), c.get("device_type")),
                     "devices": c["devices"], "per_device_batch": c["batch_size"],
                     "steps_per_epoch": m["steps"], "images_per_device_per_step": c["batch_size"],
                     "allreduce_mb_per_step_per_rank": per_step / 1e6,
                     "allreduce_mb_per_epoch_per_rank": per_step * m["steps"] / 1e6,
                     "bytes_per_image": per_step / c["batch_size"]})
    return pd.DataFrame(rows)


def scaling_frame(records: Sequence[Record]):
    """Table 1 as a DataFrame: time, both speedups and efficiency per (method, devices, batch), each
    column as :data:`_TABLE1_NOTES` defines it; with repeats, a configuration's records are merged first
    (T(N): their median). T(1) is the same method's one-device run with the same per-device batch."""
    aggs = aggregates(merge_repeats(records))
    ones = one_device_runs(aggs)
    rows = []
    for r in aggs:
        c = r.config
        n = int(c["devices"])
        tn = value(r, T_N)
        b1 = ones.get(pair_key(r))
        t1 = value(b1, T_N)
        row = {"method": method_label(c["method"], c.get("backend"), c.get("device_type")), "devices": n,
               "per_device_batch": c["batch_size"], "global_batch": c["batch_size"] * n,
               "status": "ok" if r.status == "ok" else (r.reason or r.status),
               "epoch2_train_seconds": tn, "spread_pct": value(r, "spread_pct"),
               "spread_of": r.metrics.get("spread_of") if r.status == "ok" else None,
               "TN_seconds_per_step": per_step(r),
               "speedup": None, "scaled_speedup": None, "n_t1_over_tn_epoch": None, "efficiency": None,
               "serial_fraction": None, "skew_wait_seconds": value(r, "skew_wait_seconds_max"),
               "train_plus_skew_wait_seconds": value(r, "train_plus_skew_wait_seconds"),
               "stderr_pct": value(r, "stderr_pct"), "oversubscribed": oversubscribed(r),
               "speedup_noise_flag": speedup_noise_flag(spread_of_record(r), spread_of_record(b1)) if n > 1
               else None}
        if tn and t1:
            row["speedup"] = speedup(t1, tn)
            row["n_t1_over_tn_epoch"] = n * row["speedup"]  # earlier reports' formula, kept to be questioned
            row["efficiency"] = efficiency(row["speedup"], n)
            row["serial_fraction"] = karp_flatt(row["speedup"], n)
            row["scaled_speedup"] = scaled_speedup(per_step(b1), per_step(r), n)
        rows.append(row)
    df = pd.DataFrame(rows, columns=["method", "devices", "per_device_batch", "global_batch", "status",
                                     "epoch2_train_seconds", "spread_pct", "spread_of", "TN_seconds_per_step",
                                     "speedup", "scaled_speedup", "n_t1_over_tn_epoch", "efficiency",
                                     "serial_fraction", "skew_wait_seconds", "train_plus_skew_wait_seconds",
                                     "stderr_pct", "oversubscribed", "speedup_noise_flag"])
    df.attrs["view"] = TABLE1_VIEW
    return df


# : Table 1 in a notebook (``df.attrs["view"]``, lab_utils.engine.table_view's narrow view): what a reader
# needs
#: first; the CSV has every column.
TABLE1_VIEW = ("method", "devices", "per_device_batch", "status", "epoch2_train_seconds", "stderr_pct",
               "speedup", "efficiency", "serial_fraction", "skew_wait_seconds", "speedup_noise_flag")


SPEEDUP_NOT_DISTINGUISHABLE = ("|T(N) - T(1)| within 2 standard errors: speedup not distinguishable from 1 "
                               "(within this run's step noise; run-to-run variation needs REPEATS >= 3)")


def speedup_noise_flag(tn: Spread | None, t1: Spread | None) -> str | None:
    """Table 1's ``speedup_noise_flag``: :data:`SPEEDUP_NOT_DISTINGUISHABLE` when T(N) - T(1) is within
    2 standard errors of the two times combined (:func:`lab_utils.learn.spread.within_noise`); None when
    it stands out, or when either time has no standard error (too few steps, an older record)."""
    if tn is None or t1 is None:
        return None
    return SPEEDUP_NOT_DISTINGUISHABLE if within_noise(tn.seconds - t1.seconds, tn.stderr_seconds,
                                                       t1.stderr_seconds) else None

_TABLE1_NOTES = [
    "spread_pct: how much the steps vary, in % of T(N) (spread_of says which: 'p10-p90 of S steps', the "
    "reported epoch's per-step training times of the slowest rank, or 'min-max of R repeats' with "
    "REPEATS > 1, when T(N) is the median of the repeats). It describes the steps; it is not the "
    "uncertainty of T(N).",
    "stderr_pct: the standard error of T(N), in % of it: one run, sd(step) x sqrt(S) (S steps taken as "
    "independent; it knows nothing of run-to-run variation); with REPEATS > 1, stdev / sqrt(R) of the "
    "repeats. speedup_noise_flag: |T(N) - T(1)| <= 2 x the two standard errors combined, so that row's "
    "speedup is not distinguishable from 1. Blank: distinguishable, or no standard error (fewer than 5 "
    "steps, or a record from before it was kept).",
    "oversubscribed: the gloo ranks had more threads than the machine has cores (quick: 4 single-thread "
    "processes on 2 cores), so they took turns on the cores: the row exercises the 4-device path, its "
    "times do not measure scaling.",
    "epoch2_train_seconds T(N): training time of epoch 2 of 2 (host-to-device copies, forward, backward, "
    "all-reduce, optimizer step; loader waits excluded), the SLOWEST rank's; seconds.",
    "speedup = T(1)/T(N) on epoch time (strong scaling: the epoch's data set is fixed); "
    "efficiency = speedup / N.",
    "scaled_speedup = N x t(1)/t(N), t = time per step (weak scaling, Gustafson: per-device batch fixed). "
    "It equals the speedup up to the last partial batch.",
    "n_t1_over_tn_epoch = N x T(1)/T(N) on EPOCH times: the course forum's scaled-speedup formula (an "
    "earlier report's second definition) applied to epoch times. With the per-device batch fixed each epoch "
    "already has N times fewer steps, so this counts N twice (about N x the speedup); the same formula on "
    "STEP times is scaled_speedup. Both definitions side by side: tables/scaling_definitions.",
    "T(1): the same method with one device and the same per-device batch.",
    "serial_fraction: Karp-Flatt e = (1/speedup - 1/N) / (1 - 1/N), the non-parallel share Amdahl's law "
    "would need to explain the speedup (empty for N = 1).",
    "A row whose status is not ok did not run: it has no numbers.",
    "skew_wait_seconds: the slowest rank's wait, in a barrier right after each step's data movement, for "
    "the other ranks' loaders (DDP only; 0 with one device). It is NOT in T(N): without the barrier it "
    "would sit inside compute (backward's all-reduce waits for the slowest loader). "
    "train_plus_skew_wait_seconds: max over ranks of training + skew wait, about what T(N) was before "
    "the barrier existed. Both are blank for DataParallel and for records written before the barrier "
    "existed, whose T(N) still includes that wait.",
]


def scaling_table(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save Table 1 (``tables/scaling.md`` + ``.csv``) and return it."""
    df = scaling_frame(records)
    notes = [*_TABLE1_NOTES,
             "Definitions (lab_utils.learn.metrics): " + note("train_seconds") + "; " + note(T_N) + "."]
    if any(r.config.get("backend") == "gloo" for r in records):
        notes.append("DDP (gloo, CPU processes): no GPU here; each 'device' is one single-thread CPU "
                     "process, so these numbers show the mechanics, not GPU performance.")
    notes.append(f"settings: {settings.label}")
    store.save_table(blank_missing(df.copy()), "scaling", ok_records(records),
                     title="Table 1: epoch-2 training time and speedup over devices", notes=notes)
    return with_view(df, TABLE1_VIEW)


def speedup_figure(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Speedup T(1)/T(N) against devices, one line per (method, per-device batch), with the ideal line."""
    import matplotlib.pyplot as plt

    df = scaling_frame(records)
    df = df[df["speedup"].notna()]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    top = max([1, *settings.devices])
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal (speedup = N)")
    for (method, b), g in df.groupby(["method", "per_device_batch"], sort=False):
        g = g.sort_values("devices")
        ax.plot(g["devices"], g["speedup"].astype(float), "o-", label=f"{method}, {b}/device")
    ax.set_xlabel("devices N")
    ax.set_ylabel("speedup T(1)/T(N), epoch 2")
    ax.set_xticks(sorted(set(settings.devices)))
    ax.set_title("Speedup over devices (per-device batch fixed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the provenance label below the axis
    path = store.save_figure(fig, "scaling_speedup", ok_records(records))
    return fig, path
