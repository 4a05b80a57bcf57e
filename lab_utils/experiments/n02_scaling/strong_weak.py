"""Notebook 02's Q2 table: strong scaling (a fixed global batch) vs weak scaling (a fixed per-device
batch) over devices (:func:`fixed_global_batch_table`), its verdicts, and the other cohort's
fixed-global-batch runs beside it."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n02_scaling.tables import ok_records, scaling_frame
from lab_utils.experiments.shared.anchors import (
    FIRST_COHORT_LABEL,
    FIRST_COHORT_MEASURED,
    FIRST_COHORT_TABLE1_SECONDS,
    OTHER_COHORT_8192_4GPU_SECONDS,
    OTHER_COHORT_8192_RAN_ON,
    OTHER_COHORT_DID_NOT_FIT,
    OTHER_COHORT_LABEL,
    OTHER_COHORT_LOGGED_STEPS,
    OTHER_COHORT_MEASURED,
    OTHER_COHORT_SECONDS,
    other_cohort_per_gpu_batch,
)
from lab_utils.experiments.shared.rows import blank_missing, is_missing
from lab_utils.learn.speedup import (
    efficiency,
    speedup,
)

__all__ = ["FIXED_GLOBAL_EXPLANATION", "fixed_global_batch_frame", "fixed_global_batch_table",
           "fixed_global_batch_verdict"]


#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
FIXED_GLOBAL_VIEW = ("method", "devices", "global_batch", "status", "strong_TN_seconds", "strong_speedup",
                     "strong_efficiency", "weak_TN_seconds", "weak_speedup", "weak_efficiency")


_FIXED_GLOBAL_COLUMNS = ["method", "devices", "global_batch", "status", "T1_seconds",
                        "strong_per_device_batch", "strong_TN_seconds", "strong_speedup", "strong_efficiency",
                        "weak_per_device_batch", "weak_TN_seconds", "weak_speedup", "weak_efficiency",
                        "better"]


def _fixed_global_batch_rows(seconds: dict[tuple[int, int], float | None],
                            reasons: dict[tuple[int, int], str] | None = None,
                            method: str = "") -> list[dict]:
    """Strong vs weak scaling from the same starting point, using only measured (devices, per-device
    batch) -> epoch seconds.

    Start from one device at batch G (time T(1, G)). Strong scaling keeps the GLOBAL batch G and
    splits it: N devices x G/N, speedup T(1, G) / T(N, G/N). Weak scaling (what Table 1 ran)
    keeps G PER DEVICE: N x G, speedup T(1, G) / T(N, G) (Table 1's speedup of that row). Both
    are epoch times over the same data set, so the speedups compare directly. One row per
    (N > 1, G) whose strong split G/N is a per-device batch of the grid (``seconds`` and
    ``reasons`` keys); a row with a missing time says which run is missing and why.
    """
    reasons = dict(reasons or {})
    grid = set(seconds) | set(reasons)
    ones = sorted(b for n, b in grid if n == 1)
    rows = []
    for n in sorted({n for n, _ in grid if n > 1}):
        for g in ones:
            if g % n or (n, g // n) not in grid:
                continue
            row = dict.fromkeys(_FIXED_GLOBAL_COLUMNS)
            row.update({"method": method, "devices": n, "global_batch": g, "strong_per_device_batch": g // n,
                        "weak_per_device_batch": g})
            t1, ts, tw = seconds.get((1, g)), seconds.get((n, g // n)), seconds.get((n, g))
            strong, weak = speedup(t1, ts), speedup(t1, tw)
            row.update({"T1_seconds": t1, "strong_TN_seconds": ts, "weak_TN_seconds": tw,
                        "strong_speedup": strong, "strong_efficiency": efficiency(strong, n),
                        "weak_speedup": weak, "weak_efficiency": efficiency(weak, n)})
            missing = [f"{k} x {b}: {reasons.get((k, b)) or 'not measured'}"
                       for k, b, t in ((1, g, t1), (n, g // n, ts)) if not t]
            if strong is not None and weak is not None:
                row["status"] = "ok"
                row["better"] = "strong" if strong > weak else "weak" if strong < weak else "equal"
            elif missing:
                row["status"] = "no strong-scaling comparison: " + "; ".join(missing)
            else:
                row["status"] = (f"strong only: {n} x {g}: {reasons.get((n, g)) or 'not measured'}")
            rows.append(row)
    return rows


def fixed_global_batch_frame(records: Sequence[Record] | None = None,
                             seconds: dict[tuple[int, int], float | None] | None = None, method: str = ""):
    """:func:`_fixed_global_batch_rows` from Table 1's records (one block per method) or ``seconds``."""
    rows: list[dict] = []
    if seconds is not None:
        rows += _fixed_global_batch_rows(seconds, method=method)
    if records is not None:
        t1 = scaling_frame(records)
        for m, g in t1.groupby("method", sort=False):
            times, why = {}, {}
            for _, r in g.iterrows():
                key = (int(r["devices"]), int(r["per_device_batch"]))
                if r["status"] == "ok" and not is_missing(r["epoch2_train_seconds"]):
                    times[key] = float(r["epoch2_train_seconds"])
                else:
                    why[key] = str(r["status"])
            rows += _fixed_global_batch_rows(times, why, method=m)
    df = pd.DataFrame(rows, columns=_FIXED_GLOBAL_COLUMNS)
    df.attrs["view"] = _FIXED_GLOBAL_VIEW
    return df


_FIXED_GLOBAL_VIEW = ("method", "devices", "global_batch", "status", "T1_seconds", "strong_TN_seconds",
                      "strong_speedup", "weak_TN_seconds", "weak_speedup")


def fixed_global_batch_verdict(df) -> str:
    """The one-line answer to "would the other type of scaling be better or worse?", computed from
    the comparable rows of :func:`fixed_global_batch_frame` (never assumed)."""
    ok = df[df["status"] == "ok"] if len(df) else df
    if not len(ok):
        return ("No verdict: no fixed-global-batch pair was measured here (each row says which run is "
                "missing).")
    worse = int((ok["better"] == "weak").sum())
    better = int((ok["better"] == "strong").sum())
    pairs = "; ".join(f"N={r['devices']}, global {r['global_batch']}: strong {r['strong_speedup']:.3g}x "
                      f"vs weak {r['weak_speedup']:.3g}x" for _, r in ok.iterrows())
    if worse == len(ok):
        head = "Strong scaling (fixed global batch) would be WORSE than the weak scaling measured"
    elif better == len(ok):
        head = "Strong scaling (fixed global batch) would be BETTER than the weak scaling measured"
    else:
        head = (f"Mixed: strong scaling is worse in {worse} and better in {better} of {len(ok)} pairs "
                "(differences this small are within run-to-run noise)")
    return f"{head} ({pairs})."


FIXED_GLOBAL_EXPLANATION = (
    "Why strong scaling usually loses: splitting a fixed global batch G over N devices gives each "
    "device G/N images per step, but every step still all-reduces the WHOLE gradient (S bytes, "
    "2(N-1)/N x S per rank) and pays the same fixed per-step costs (kernel launches, optimizer over all "
    "parameters). Compute per step shrinks N-fold, communication and overhead do not, so they take a "
    "larger share, and a small per-device batch also uses each GPU less efficiently. Weak scaling keeps "
    "the per-device work, so the compute that hides the all-reduce stays the same.")


def _other_cohort_frame():
    """The other cohort's DataParallel table as measured: a FIXED GLOBAL batch G split over N GPUs
    (strong scaling), one row per (N > 1, G) in :func:`fixed_global_batch_frame`'s columns; it ran no
    weak configuration, so those columns are blank and its status says so."""
    rows = []
    for (n, g), tn in sorted(OTHER_COHORT_SECONDS.items()):
        t1 = OTHER_COHORT_SECONDS.get((1, g))
        if n == 1 or t1 is None:
            continue
        row = dict.fromkeys(_FIXED_GLOBAL_COLUMNS)
        row.update({"method": OTHER_COHORT_LABEL, "devices": n, "global_batch": g,
                    "status": f"strong only (no fixed per-GPU batch run); {OTHER_COHORT_MEASURED}",
                    "T1_seconds": t1, "strong_per_device_batch": other_cohort_per_gpu_batch(n, g),
                    "strong_TN_seconds": tn, "strong_speedup": speedup(t1, tn),
                    "strong_efficiency": efficiency(speedup(t1, tn), n)})
        rows.append(row)
    return pd.DataFrame(rows, columns=_FIXED_GLOBAL_COLUMNS)


def _other_cohort_verdict(df=None) -> str:
    """What the other cohort's fixed-global-batch runs say, from :func:`_other_cohort_frame`: the
    speedup T(1, G)/T(N, G) of every global batch G, and where more GPUs were slower."""
    df = _other_cohort_frame() if df is None else df
    parts, slower = [], []
    for g, rows in df.groupby("global_batch", sort=True):
        rows = rows.sort_values("devices")
        parts.append(f"global {g}: " + ", ".join(f"{r.strong_speedup:.2f}x on {r.devices}"
                                                  for r in rows.itertuples()))
        if (rows["strong_speedup"] < 1).all():
            slower.append(str(g))
    head = (f"More GPUs were SLOWER at global batch {' and '.join(slower)}" if slower
            else "More GPUs were never slower")
    return (f"{head} ({'; '.join(parts)}); it measured only a fixed global batch, on other hardware, with "
            "the loader included, so set it beside this run's strong columns, not against its weak ones.")


def fixed_global_batch_table(store: ResultStore, records: Sequence[Record]):
    """Save the strong-vs-weak comparison (``tables/scaling_fixed_global_batch``): this run's rows, the
    earlier cohort's Table 1 through the same arithmetic, the other cohort's runs as measured. Returns
    (DataFrame, {who: one-line verdict}); the verdicts are not in the saved table (it goes into the
    student's report, and they answer Q2)."""
    here = fixed_global_batch_frame(records)
    first = fixed_global_batch_frame(seconds=FIRST_COHORT_TABLE1_SECONDS, method=FIRST_COHORT_LABEL)
    other = _other_cohort_frame()
    df = pd.concat([here, first, other], ignore_index=True)
    df.attrs["view"] = _FIXED_GLOBAL_VIEW
    verdicts = {"This run": fixed_global_batch_verdict(here),
                FIRST_COHORT_LABEL: fixed_global_batch_verdict(first),
                OTHER_COHORT_LABEL: _other_cohort_verdict(other)}
    notes = ["T1_seconds = T(1, G): one device at batch G. strong: N x G/N (global batch fixed), speedup "
             "T(1, G)/T(N, G/N); weak: N x G (per-device batch fixed, as Table 1), speedup T(1, G)/T(N, G). "
             "Epoch-2 training seconds, slowest rank; efficiency = speedup / N.",
             "Only pairs whose split G/N is one of the per-device batch sizes appear (with batch sizes "
             "growing x4, that is N = 4; N = 2 would need a 2 x 64 run).",
             f"{FIRST_COHORT_LABEL}: its Table 1 ({FIRST_COHORT_MEASURED}), per-GPU batch fixed; its "
             "strong columns pair its own rows through the same arithmetic.",
             f"{OTHER_COHORT_LABEL}: its framework's 'dp' strategy splits the batch over the GPUs, so its "
             f"batch G is the global one: its logs count {OTHER_COHORT_LOGGED_STEPS[32]:,} steps per epoch "
             f"at G = 32 and {OTHER_COHORT_LOGGED_STEPS[128]} at 128 on 1, 2 and 4 GPUs alike. Times: "
             f"{OTHER_COHORT_MEASURED}. G = {OTHER_COHORT_DID_NOT_FIT[1]:,} did not fit on one GPU; it ran "
             f"on {' and '.join(map(str, OTHER_COHORT_8192_RAN_ON))} GPUs (its notebook computes "
             f"{OTHER_COHORT_8192_4GPU_SECONDS} s for the 4-GPU epoch) and its table leaves it out."]
    # the verdicts and FIXED_GLOBAL_EXPLANATION answer Q2: the saved table (the student's report) leaves them
    # to the notebook's discussion
    store.save_table(blank_missing(df.copy()), "scaling_fixed_global_batch", ok_records(records),
                     title="Q2: strong (fixed global batch) vs weak (fixed per-device batch) scaling",
                     notes=notes)
    return with_view(df, FIXED_GLOBAL_VIEW), verdicts
