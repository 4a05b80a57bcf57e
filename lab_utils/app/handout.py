"""Tables 1-3 of the hand-in in the handout's layout (rows = GPUs, columns = per-GPU batch x {time,
speedup}...: :data:`LAYOUTS`, :func:`handout_tables`), reshaped from the stored long tables
without recomputing a number, and Q3.2's formulas with the student's fit (:func:`q32_formulas`).
:mod:`lab_utils.app.handin` writes them into the report."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from lab_utils.app.questions import SECTIONS
from lab_utils.engine.store import format_number

# --------------------------------------------------------------------------- the handout's layouts


@dataclass(frozen=True)
class Layout:
    """One handout table: a stored long table pivoted to rows = devices, columns = per-device batch x
    ``values`` (column of the long table, header in the handout)."""

    title: str
    source: str                           # tables/<source>.csv
    values: tuple[tuple[str, str], ...]   # (long table's column, handout's header)
    devices: tuple[int, ...] = (1, 2, 4)
    where: tuple[tuple[str, str], ...] = ()  # (column, value): the long table's rows this one takes
    spread: str = ""                      # the long column whose time carries the spread, if any
    flag: str = ""                        # the long column whose text marks a difference within the noise
    flag_on: str = ""                     # the column whose value gets the "*" (default: the last value)
    key: str = ""                         # handin.json's table name
    json_names: tuple[str, ...] = ()      # handin.json's name of each value
    caption: str = ""                     # what the columns are, under the table


BATCH = ("per_device_batch", "per_gpu_batch")  # the long tables' name of the per-device batch
UTILIZATION = ("GB/s: bytes each rank sends per epoch / the communication time; utilization %: that rate "
               "as a share of the all-reduce benchmark's peak bus bandwidth at the same N (notebook 04; '-' "
               "where the benchmark did not run at that N)")

LAYOUTS: dict[str, tuple[Layout, ...]] = {
    "scaling": (Layout("Table 1: epoch-2 training time T(N) and speedup T(1)/T(N)", "scaling",
                       (("epoch2_train_seconds", "time (s)"), ("speedup", "speedup")),
                       spread="epoch2_train_seconds", flag="speedup_noise_flag", key="table1",
                       json_names=("seconds", "speedup")),),
    "compute_vs_comm": (
        Layout("Table 2 (a), the assignment's method: compute T(1)/N and communication T(N) - T(1)/N",
               "compute_vs_comm",
               (("compute_a_seconds", "compute (s)"), ("comm_a_seconds", "communication (s)")),
               devices=(2, 4), flag="comm_a_noise_flag", key="table2",
               json_names=("compute_seconds", "comm_seconds")),
        Layout("Table 2 (b) and (c), measured: exposed communication (b) and the all-reduce in flight (c)",
               "compute_vs_comm", (("exposed_comm_b_seconds", "(b) exposed (s)"),
                                   ("allreduce_c_seconds", "(c) all-reduce (s)")), devices=(2, 4),
               flag="noise_flag", flag_on="exposed_comm_b_seconds"),
    ),
    "allreduce_utilization": (
        Layout("Table 3 (a), the assignment's utilization: ring bytes / communication T(N) - T(1)/N",
               "allreduce_utilization", (("achieved_gb_per_s", "GB/s"),
                                         ("pct_of_bench_peak_busbw", "utilization %")),
               devices=(2, 4), where=(("comm_source", "(a)"),), key="table3",
               json_names=("gb_per_s", "utilization_pct"), caption=UTILIZATION),
        Layout("Table 3 (c): ring bytes / the all-reduce's own measured time", "allreduce_utilization",
               (("achieved_gb_per_s", "GB/s"), ("pct_of_bench_peak_busbw", "utilization %")),
               devices=(2, 4), where=(("comm_source", "(c)"),), caption=UTILIZATION),
    ),
}


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _batch_col(df: pd.DataFrame) -> str:
    return next(c for c in BATCH if c in df.columns)  # handout_tables checked that there is one


def _rows(df: pd.DataFrame, layout: Layout) -> pd.DataFrame:
    for col, prefix in layout.where:
        df = df[df[col].astype(str).str.startswith(prefix)]
    return df[df["devices"].isin(layout.devices)]


@dataclass
class Pivoted:
    """One handout table, rendered: Markdown lines, its footnotes, and its rows for ``handin.json``."""

    markdown: list[str]
    rows: list[dict]
    missing: int  # cells that could not be measured


def pivot(df: pd.DataFrame, layout: Layout, method: str) -> Pivoted:
    """``df``'s rows of ``method`` in the handout's layout: one row per device count, per batch the
    ``layout.values`` columns. A configuration not measured shows its status as a numbered footnote;
    a time with a stored spread shows it in brackets (``spread_pct``, ``spread_of``: see the caption); a
    row whose ``layout.flag`` column holds a text (its difference is within 2 standard errors: not
    distinguishable) gets a ``*`` on its ``layout.flag_on`` value (default: the last) and the text as a
    footnote."""
    bcol = _batch_col(df)
    df = _rows(df[df["method"] == method], layout)
    batches = sorted(int(b) for b in df[bcol].dropna().unique())
    header = ["GPUs"] + [f"{b}: {name}" for b in batches for _, name in layout.values]
    lines = ["| " + " | ".join(header) + " |", "|" + "---:|" * len(header)]
    notes: dict[str, int] = {}
    flags: dict[str, None] = {}  # the long table's flag texts (a difference within the noise)
    rows: list[dict] = []
    missing = 0
    for n in layout.devices:
        cells = [str(n)]
        for b in batches:
            hit = df[(df["devices"] == n) & (df[bcol] == b)]
            row = hit.iloc[-1].to_dict() if len(hit) else None
            ok, status = _row_status(row, layout)
            if layout.key:
                rows.append({"method": method, "gpus": n, "per_gpu_batch": b, "status": status,
                             **{k: (row.get(c) if ok and _finite(row.get(c)) else None)
                                for (c, _), k in zip(layout.values, layout.json_names, strict=True)},
                             **({"spread_pct": row.get("spread_pct") if ok and _finite(row.get("spread_pct"))
                                 else None} if layout.spread else {}),
                             "not_distinguishable": _flagged(row, layout) if ok else False})
            if not ok:
                missing += 1
                mark = notes.setdefault(status, len(notes) + 1)
                cells += [f"n/a ({mark})"] + [""] * (len(layout.values) - 1)
                continue
            flagged = _flagged(row, layout)
            if flagged:
                flags.setdefault(row[layout.flag], None)
            for i, (c, _) in enumerate(layout.values):
                v = row.get(c)
                text = format_number(v) if _finite(v) else "-"
                if c == layout.spread and _finite(row.get("spread_pct")):
                    text += f" [{row['spread_pct']:.0f}%]"
                marked = c == layout.flag_on if layout.flag_on else i == len(layout.values) - 1
                cells.append(text + (" *" if flagged and marked else ""))
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += [""] + [f"({i}) {s}" for s, i in notes.items()]
    if flags:
        lines += [""] + [f"\\* {f}" for f in flags]
    return Pivoted(lines, rows, missing)


def _flagged(row: dict, layout: Layout) -> bool:
    """Whether the row's difference is marked not distinguishable (its ``layout.flag`` column has a text)."""
    flag = row.get(layout.flag) if layout.flag else None
    return isinstance(flag, str) and bool(flag)


def _row_status(row: dict | None, layout: Layout) -> tuple[bool, str]:
    """Whether a long table's row has the layout's numbers, and if not, why (its status or note)."""
    if row is None:
        return False, "not run yet"
    status = row.get("status")
    if isinstance(status, str) and status != "ok":
        return False, status
    if any(_finite(row.get(c)) for c, _ in layout.values):
        return True, "ok"
    note = row.get("note")
    return False, note if isinstance(note, str) and note else "not measured"


def _read_csv(path: Path) -> pd.DataFrame | None:
    try:
        return pd.read_csv(path)
    except (OSError, ValueError):  # missing, empty or unreadable: the table is reported missing
        return None


def handout_tables(tables_dir: Path, name: str) -> tuple[list[str], dict[str, list[dict]], list[str]]:
    """The handout layouts of the stored long table ``name``: Markdown lines, handin.json rows per table
    key, and problems (the table is missing, or was written by an older lab). A cell not measured is not a
    problem: it says why in the table."""
    df = _read_csv(tables_dir / f"{name}.csv")
    if df is None or df.empty or "method" not in df.columns:
        nb = _notebook_of(name)
        return ([f"_Not measured yet: `tables/{name}.csv` is missing. Run notebook {nb}._", ""], {},
                [f"table missing: {name} (run notebook {nb})"])
    if "devices" not in df.columns or not any(c in df.columns for c in BATCH):  # written by an older lab
        nb = _notebook_of(name)
        return ([f"_`tables/{name}.csv` lacks the devices or the per-device batch: run notebook {nb} again "
                 "with this version of the lab._", ""], {},
                [f"table from an older lab: {name} (run notebook {nb})"])
    lines: list[str] = []
    out: dict[str, list[dict]] = {}
    caption = str(df["provenance"].iloc[0]) if "provenance" in df.columns else "provenance unknown"
    # the kinds of spread in the table, counts left out ("p10-p90 of n steps"); each row's is in the CSV
    spread_of = sorted({re.sub(r"\b\d+ (?=step|repeat)", "n ", str(s))
                        for s in df.get("spread_of", pd.Series(dtype=object)).dropna()})
    for layout in LAYOUTS[name]:
        for method in df["method"].dropna().unique():
            if _rows(df[df["method"] == method], layout).empty:
                continue
            t = pivot(df, layout, str(method))
            lines += [f"**{layout.title}** · {method}", "", *t.markdown, ""]
            cap = f"_{layout.caption + ' · ' if layout.caption else ''}{caption}"
            if layout.spread:
                cap += (f" · [x%]: how the steps vary ({'; '.join(spread_of)}: each row's in the CSV's "
                        "spread_of), not the uncertainty of the time" if spread_of else
                        " · no spread stored (re-run the notebook with this version of the lab)")
            if layout.flag and any(line.startswith("\\* ") for line in t.markdown):
                cap += (" · *: not distinguishable, judged by 2 standard errors of the times (their step "
                        "noise, or their repeats; the CSV's stderr columns)")
            cap += f" · {t.missing} cell(s) not measured_" if t.missing else "_"
            lines += [cap, ""]
            if layout.key:
                out.setdefault(layout.key, []).extend(t.rows)
    lines += [f"The long table, every column: [`tables/{name}.csv`](tables/{name}.csv).", ""]
    return lines, out, []


def _notebook_of(table: str) -> str:
    return next((s.notebook for s in SECTIONS if table in s.tables), "?")


# --------------------------------------------------------------------------- Q3.2's formulas


def q32_formulas(tables_dir: Path) -> list[str]:
    """Q3.2's two formulas (the all-reduce time, the bytes per rank), with the fitted alpha and B and the
    benchmark's peak (``tables/allreduce_fit.csv``, notebook 04) put in."""
    lines = ["Ring all-reduce of S bytes on P ranks, latency alpha per step, bandwidth B:", "",
             "    T(S, P) = 2(P-1) alpha + 2(P-1)/P x S / B", "",
             "Bytes each rank sends per step: 2(P-1)/P x S (S in bytes: parameters x bytes per element); "
             "per epoch: steps per epoch x that.", ""]
    fit = _read_csv(tables_dir / "allreduce_fit.csv")
    if fit is None or fit.empty:
        return lines + ["_Your fit is not measured yet: run notebook 04 (`allreduce_fit`)._", ""]
    for _, r in fit.iterrows():
        p = int(r["ranks"])
        alpha_us, b = r.get("alpha_us"), r.get("B_gb_per_s")
        if not (_finite(alpha_us) and _finite(b)):
            lines.append(f"- P = {p}: no fit ({r.get('projection', 'not measured')}).")
            continue
        peak = r.get("peak_busbw_gb_per_s")
        note = str(r.get("projection") or "")
        a, bw = format_number(alpha_us), format_number(b)
        text = (f"- Your fit, P = {p}: alpha = {a} us, B = {bw} GB/s, so T(S, {p}) = {2 * (p - 1)} x {a} us "
                f"+ {2 * (p - 1)}/{p} x S / ({bw} GB/s)")
        if _finite(peak):
            text += f"; the benchmark's peak bus bandwidth: {format_number(peak)} GB/s"
        lines.append(text + (f" ({note})" if note.startswith("not a result") else "") + ".")
    lines.append(f"- The link's nominal peak: {link_peak(tables_dir)}.")
    return lines + ["", f"_{fit['provenance'].iloc[0]}_" if "provenance" in fit.columns else "", ""]


def link_peak(tables_dir: Path) -> str:
    """The link's nominal one-direction bandwidth as notebook 04 stored it (``tables/allreduce_inputs``):
    "300 GB/s (NVLink ...)", or "unknown (why)"."""
    inputs = _read_csv(tables_dir / "allreduce_inputs.csv")
    if inputs is None or "input" not in inputs.columns:
        return "not stored yet (run notebook 04)"
    hit = inputs[inputs["input"] == "link nominal bandwidth"]
    if hit.empty:
        return "not stored yet (run notebook 04)"
    value, source = hit.iloc[0].get("value"), hit.iloc[0].get("source")
    try:
        text = f"{format_number(float(value))} GB/s"
    except (TypeError, ValueError):  # "unknown": no nominal peak for this link
        text = str(value)
    return f"{text} ({source})" if isinstance(source, str) and source else text
