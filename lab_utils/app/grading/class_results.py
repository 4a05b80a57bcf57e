"""The class's numbers side by side: ``grades/class_results.csv`` and ``grades/class_results.png``.

One row per student and measured number of their ``handin.json``: each Table 1 speedup (T(1)/T(N))
and each Table 3 bandwidth (decimal GB/s). Numbers are compared only within a group: the same GPU
model (the device name), quantity, method, GPUs and per-GPU batch. In a group of at least
:data:`MIN_GROUP` students, a value is an outlier when it lies more than :data:`K` median absolute
deviations from the group's median (``|x - median| > K * MAD``, MAD = median of ``|x - median|``,
unscaled); in a smaller group the row says "too few to judge".
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from pathlib import Path

from lab_utils.app.grading import gradebook

K = 3.0
MIN_GROUP = 3
TOO_FEW = "too few to judge"
COLUMNS = ("student", "device", "device_count", "profile", "quantity", "method", "gpus", "per_gpu_batch",
           "value", "group_median", "group_mad", "outlier")
LABELS = {"speedup": "Table 1: speedup T(1)/T(N)", "gb_per_s": "Table 3: achieved GB/s (decimal)"}


@dataclass
class Verdict:
    median: float
    mad: float
    outlier: str        # "yes", "no" or TOO_FEW


def mad_verdicts(values: list[float]) -> list[Verdict]:
    """Each value's verdict within its group: beyond :data:`K` MADs of the median, or too few to judge."""
    med = statistics.median(values)
    mad = statistics.median(abs(v - med) for v in values)
    if len(values) < MIN_GROUP:
        return [Verdict(med, mad, TOO_FEW) for _ in values]
    return [Verdict(med, mad, "yes" if abs(v - med) > K * mad else "no") for v in values]


def rows_of(state: dict) -> list[dict]:
    """class_results.csv's rows from the gradebook's state (each entry's ``provenance``)."""
    rows = []
    for s in state["students"].values():
        p = s.get("provenance") or {}
        for r in p.get("results", []):
            rows.append({"student": s["name"], "device": p["device"], "device_count": p["device_count"],
                         "profile": p["profile"], "flags": p.get("flags", []), **r})
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(_group(r), []).append(r)
    for group in groups.values():
        for r, v in zip(group, mad_verdicts([r["value"] for r in group])):
            r.update(group_median=round(v.median, 6), group_mad=round(v.mad, 6), outlier=v.outlier)
    return sorted(rows, key=lambda r: (r["device"], r["quantity"], r["method"], r["gpus"], r["per_gpu_batch"],
                                       r["student"].lower()))


def _group(r: dict) -> tuple:
    """What a number is compared within: the GPU model, quantity, method, GPUs and per-GPU batch."""
    return r["device"], r["quantity"], r["method"], r["gpus"], r["per_gpu_batch"]


def _label(r: dict) -> str:
    return f"{r['device']}\n{r['method']}, {r['gpus']} x {r['per_gpu_batch']}"


def _figure(rows: list[dict], path: Path) -> None:
    """One panel per quantity: each student's value per group (GPU model, method, GPUs x batch), the
    group's median as a bar, outliers in red with the student's name; hollow markers for numbers from a
    quick-profile, synthetic-data or CPU hand-in."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    quantities = [q for q in LABELS if any(r["quantity"] == q for r in rows)]
    fig, axes = plt.subplots(len(quantities), 1, figsize=(11, 4.2 * len(quantities)), squeeze=False)
    for ax, q in zip(axes[:, 0], quantities):
        mine = [r for r in rows if r["quantity"] == q]
        groups = list(dict.fromkeys(_label(r) for r in mine))
        for x, g in enumerate(groups):
            members = [r for r in mine if _label(r) == g]
            ax.hlines(members[0]["group_median"], x - 0.3, x + 0.3, color="0.4", lw=1)
            for j, r in enumerate(members):
                dx = (j - (len(members) - 1) / 2) * min(0.5 / max(len(members), 1), 0.08)
                out = r["outlier"] == "yes"
                hollow = any(f.split(" (")[0] in ("quick profile", "synthetic data", "CPU (no GPU)")
                             for f in r["flags"])
                color = "tab:red" if out else "tab:blue"
                ax.plot(x + dx, r["value"], "o", mfc="none" if hollow else color, mec=color, ms=6)
                if out:
                    ax.annotate(r["student"], (x + dx, r["value"]), xytext=(5, 3), textcoords="offset points",
                                fontsize=8, color="tab:red")
            if members[0]["outlier"] == TOO_FEW:
                ax.annotate(TOO_FEW, (x, members[0]["group_median"]), xytext=(0, -12),
                            textcoords="offset points", ha="center", fontsize=7, color="0.4")
        ax.set_xticks(range(len(groups)), groups, fontsize=7, rotation=30, ha="right")
        ax.set_xlim(-0.6, len(groups) - 0.4)
        ax.set_ylabel(LABELS[q])
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].set_title(f"Each student's numbers by GPU model; red: beyond {K:g} MADs of the group median "
                         f"(groups of {MIN_GROUP} or more); hollow: quick profile, synthetic data or CPU",
                         fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write(state: dict, out: Path, shown: str = "") -> list[str]:
    """Write class_results.csv (and the figure, when any student handed in numbers); return the console
    lines: where they are (``shown``: the folder as the user named it), each outlier named, how many
    groups were too small to judge."""
    out = Path(out)
    rows = rows_of(state)
    gradebook.write_csv(out / "class_results.csv", COLUMNS, rows)
    figure = out / "class_results.png"
    if not rows:
        figure.unlink(missing_ok=True)
        return ["class results: no student handed in a handin.json with measured numbers "
                "(class_results.csv has its header only)"]
    _figure(rows, figure)
    students = len({r["student"] for r in rows})
    where = f"{shown}/" if shown else ""
    lines = [f"class results: {len(rows)} number(s) of {students} student(s) in {where}class_results.csv and "
             f"{where}class_results.png, grouped by GPU model"]
    outliers = [r for r in rows if r["outlier"] == "yes"]
    for r in outliers:
        lines.append(f"  outlier: {r['student']}: {r['quantity']} {r['value']:g} for {r['method']}, "
                     f"{r['gpus']} GPU(s) x {r['per_gpu_batch']} on {r['device']} (group median "
                     f"{r['group_median']:g}, MAD {r['group_mad']:g}: beyond {K:g} MADs)")
    few = {_group(r) for r in rows if r["outlier"] == TOO_FEW}
    if few:
        lines.append(f"  {TOO_FEW}: {len(few)} group(s) with fewer than {MIN_GROUP} students (no outlier "
                     "flagged there)")
    if not outliers:
        lines.append(f"  no outlier (beyond {K:g} MADs of its group's median)")
    return lines
