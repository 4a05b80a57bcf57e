"""The hand-in folder: ``python -m lab_utils report [--profile P] [--out DIR] [--check]`` (``make report``).

It writes into ``DIR`` (default ``results/<profile>/handin/``) what :data:`HOWTO` tells students:
``report.md`` in the assignment's order (:data:`lab_utils.app.questions.SECTIONS`) with a provenance
block, Tables 1-3 in the handout's layout (rows = GPUs, columns = per-GPU batch x {time, speedup}...)
beside the long tables (``tables/``), Q3.2's formulas with the student's fit, the hand-graded answers
taken from the notebooks, one slot per question answered in the report (between ``<!-- answer ID -->``
and ``<!-- /answer -->``: kept when ``make report`` runs again), and the figures (``figures/``);
``report.html``, the same self-contained; ``handin.json``, the provenance and Tables 1-3 (read by
``make grade``). Nothing here measures or recomputes a number: the cells are the stored tables'
(``results/<profile>/tables/<name>.csv``), reshaped. ``--check`` lists what is not ready to hand in
and exits 1 if anything is.
"""

from __future__ import annotations

import base64
import datetime as _dt
import errno
import html
import json
import math
import re
import shutil
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

import lab_utils
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.questions import SECTIONS, Section
from lab_utils.engine import config
from lab_utils.engine.hardware import nccl_version
from lab_utils.engine.store import ResultStore, format_number
from lab_utils.learn.errors import LabError

FORMAT = 1
#: How a student hands in: the README's "Handing in" section and the student copy's README hold this text.
HOWTO = """\
When your notebooks have run in the full profile on a GPU node, write the hand-in:

```bash
make report            # results/full/handin/: report.md, report.html, handin.json, figures/, tables/
make report CHECK=1    # lists what is not ready to hand in, and fails if anything is
```

`report.md` follows the assignment: Q1 ... Q7, then the Part 2 project and the extras. It holds
Tables 1-3 in the handout's layout, each with a caption saying where its numbers came from (profile,
devices, data); Q3.2's formulas with your fitted alpha and B; your answers to the questions graded by
hand, taken from your notebooks' cells; and a slot `_Write your answer here._` for every other question.
Write your answers into those slots (between `<!-- answer ... -->` and `<!-- /answer -->`): running
`make report` again refreshes the tables and keeps what you wrote. `CHECK=1` names every empty slot,
missing table and unanswered notebook cell, and numbers from the quick profile, synthetic data or a
CPU. Hand in the folder `results/full/handin/` (`report.html` prints to PDF from a browser) with your
notebooks `labs/NN_*.ipynb`, as your instructor asks.
"""
PLACEHOLDER = "_Write your answer here._"
LABS_DIR = Path(__file__).resolve().parents[2] / "labs"  # lab_utils/app/handin.py


# --------------------------------------------------------------------------- provenance


@dataclass
class Provenance:
    """Where the hand-in's numbers came from (``handin.json``'s ``provenance``)."""

    profile: str
    device_type: str | None = None     # "cuda" or "cpu": where the measured records ran
    device: str | None = None          # the device name, e.g. "NVIDIA A100-SXM4-40GB"
    device_count: int | None = None    # the most devices one record used
    node: str = field(default_factory=socket.gethostname)  # where the report was written
    data: list[str] = field(default_factory=list)  # the records' data sets, e.g. "CIFAR-10"
    synthetic: bool = False            # any record measured on a synthetic stand-in
    torch: str | None = None
    cuda: str | None = None
    cudnn: str | None = None
    nccl: str | None = None
    measured_from: str | None = None   # the oldest and newest record's timestamp
    measured_to: str | None = None
    records: int = 0                   # measured records (status ok)
    not_measured: dict[str, int] = field(default_factory=dict)  # status -> count (oom, error, skipped)

    def problems(self) -> list[str]:
        """What makes these numbers not the assignment's: quick profile, synthetic data, no GPU."""
        out = []
        if self.profile != "full":
            out.append(f"profile {self.profile}: reduced sizes, not the assignment's numbers (run the "
                       "notebooks in the full profile on a GPU node)")
        if self.synthetic:
            out.append("data synthetic: measured on a synthetic stand-in (run `make prepare` on a login "
                       "node, then the notebooks again)")
        if self.device_type != "cuda":
            out.append(f"device {self.device or 'unknown'}: measured without a GPU")
        if not self.records:
            out.append("no measured record: run the notebooks first (`make lab` or JupyterLab)")
        return out

    def lines(self) -> list[str]:
        """The report's provenance block, one item per line."""
        count = f" x {self.device_count}" if self.device_count else ""
        missing = ", ".join(f"{n} {s}" for s, n in sorted(self.not_measured.items())) or "none"
        return [
            f"- **profile:** {self.profile}" + (" (CPU/CI, reduced sizes: NOT the assignment's numbers)"
                                               if self.profile == "quick" else ""),
            f"- **devices:** {self.device or 'unknown'}{count} ({self.device_type or 'unknown'}); "
            f"report written on node `{self.node}`",
            f"- **data:** {', '.join(self.data) or 'unknown'}" + (" (SYNTHETIC)" if self.synthetic else ""),
            f"- **software:** torch {self.torch or '?'}, CUDA {self.cuda or 'none'}, cuDNN "
            f"{self.cudnn or 'none'}, NCCL {self.nccl or 'none'}; lab {lab_utils.__version__}",
            f"- **measured:** {self.measured_from or '?'} to {self.measured_to or '?'} "
            f"({self.records} measured records)",
            f"- **rows not measured:** {missing}",
        ]


def provenance(store: ResultStore) -> Provenance:
    """The provenance of every record stored for the profile (the latest of each configuration)."""
    p = Provenance(profile=store.profile)
    recs = [r for path in sorted(store.runs_dir.glob("*.jsonl")) for r in store.latest(path.stem)]
    ok = [r for r in recs if r.status == "ok"]
    p.not_measured = dict(Counter(r.status for r in recs if r.status != "ok"))
    p.records = len(ok)
    hw = [r.hardware for r in ok if r.hardware.get("device_name")]
    gpu = [h for h in hw if h.get("device_type") == "cuda"]
    pick = gpu or hw
    if pick:
        names = sorted({h["device_name"] for h in pick})
        p.device_type, p.device = pick[0].get("device_type"), ", ".join(names)
        p.device_count = max((h.get("device_count") or 1) for h in pick)
    p.data = sorted({r.dataset for r in ok if r.dataset})
    p.synthetic = any(r.synthetic for r in ok)
    sw = next((r.software for r in reversed(ok) if r.software), {})
    p.torch, p.cuda = sw.get("torch"), sw.get("cuda") if p.device_type == "cuda" else None
    p.cudnn = str(sw["cudnn"]) if sw.get("cudnn") and p.device_type == "cuda" else None
    p.nccl = (sw.get("nccl") or nccl_version()) if p.device_type == "cuda" else None  # NCCL: GPU runs only
    stamps = sorted(r.timestamp for r in ok if r.timestamp)
    if stamps:
        p.measured_from, p.measured_to = stamps[0], stamps[-1]
    return p


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


# --------------------------------------------------------------------------- the student's answers


ANSWER = re.compile(r"<!-- answer (?P<id>[\w.-]+) -->\n(?P<text>.*?)\n<!-- /answer -->", re.S)


def slot_id(section: Section, item: str) -> str:
    """A report slot's stable id: notebook, question and item, e.g. ``04-Q3.2-1`` or ``06-part2-2``."""
    key = {"Extra": "extra"}.get(section.key, "part2" if section.label == "Part 2 project" else section.key)
    return f"{section.notebook[:2]}-{key}-{item}"


def kept_answers(report: Path) -> dict[str, str]:
    """The answers a student wrote into an earlier ``report.md``'s slots (an unreadable file: none)."""
    try:
        text = report.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    return {m["id"]: m["text"].strip() for m in ANSWER.finditer(text)}


def _slot(sid: str, kept: dict[str, str]) -> list[str]:
    return [f"<!-- answer {sid} -->", kept.get(sid) or PLACEHOLDER, "<!-- /answer -->"]


def notebook_answers(labs: Path) -> dict[str, str]:
    """The text of every hand-graded answer cell in the student's notebooks (``labs/NN_*.ipynb``)."""
    out: dict[str, str] = {}
    for s in SECTIONS:
        if not s.by_hand:
            continue
        for path in sorted(labs.glob(f"{s.notebook}*.ipynb")):
            nb, _why = nbs.read_notebook(path)
            if nb is not None:
                out.update({k: v for k, v in nbs.answers(nb, [s.by_hand]).items() if v})
    return out


def notebook_versions(labs: Path) -> dict[str, str]:
    """Each notebook's lab version: the stamp the student copy carries, else its cells' hash."""
    out = {}
    for path in sorted(labs.glob(config.NOTEBOOK_GLOB)):
        nb, _why = nbs.read_notebook(path)
        stamp = ((nb or {}).get("metadata") or {}).get(nbs.METADATA_KEY) or {}
        try:
            out[path.stem] = stamp.get("version") or nbs.notebook_version(path)
        except (OSError, ValueError, KeyError):
            continue
    return out


# --------------------------------------------------------------------------- the hand-in


@dataclass
class Written:
    """What :func:`build` wrote and what ``--check`` found."""

    out: Path
    provenance: Provenance
    tables: dict[str, list[dict]]
    problems: list[str]


def build(profile: str | None = None, out: Path | None = None, labs: Path = LABS_DIR) -> Written:
    """Write the hand-in folder (module docstring) from the profile's stored results; return what it found."""
    name, _why = config.resolve_profile_name(profile)
    store = ResultStore(name)
    root = store.root
    out = Path(out) if out else root / "handin"
    tables_dir, figures_dir = store.tables_dir, store.figures_dir
    kept = kept_answers(out / "report.md")
    answers = notebook_answers(labs)
    prov = provenance(store)
    not_assignment = prov.problems()
    problems = list(not_assignment)
    if not any(Path(labs).glob(config.NOTEBOOK_GLOB)):
        problems.append(f"no notebook in {labs}: run make report in the lab's folder, or name yours with "
                        "--labs")
    tables: dict[str, list[dict]] = {}
    copied: list[Path] = []
    lines = ["# Report: deep-learning training performance", "", "## Provenance", "", *prov.lines(), ""]
    if not_assignment:
        lines += ["> **Not the assignment's numbers:** " + "; ".join(not_assignment) + ".", ""]
    for s in SECTIONS:
        lines += [f"## {s.heading}", "", f"_{s.asks}_", ""]
        if s.first:
            lines += [f"**First, the formula.** _{s.first}_", "", *q32_formulas(tables_dir),
                      "**In your words (each term named):**", "", *_slot(slot_id(s, "formula"), kept), ""]
            if kept.get(slot_id(s, "formula"), PLACEHOLDER) == PLACEHOLDER:
                problems.append(f"placeholder left: {s.key} formula (`{slot_id(s, 'formula')}`)")
        for t in s.tables:
            if t in LAYOUTS:
                md, rows, probs = handout_tables(tables_dir, t)
                lines += md
                tables.update(rows)
                problems += probs
            elif (tables_dir / f"{t}.md").exists():
                lines += [(tables_dir / f"{t}.md").read_text(encoding="utf-8").rstrip(), ""]
            else:
                lines += [f"_`tables/{t}` is not measured yet (notebook {s.notebook[:2]})._", ""]
            if (tables_dir / f"{t}.csv").exists():
                copied.append(tables_dir / f"{t}.csv")
        for f in s.figures:
            if (figures_dir / f"{f}.png").exists():
                copied.append(figures_dir / f"{f}.png")
                lines += [f"![{f}](figures/{f}.png)", ""]
            else:
                lines += [f"_Figure `{f}` is not drawn yet (notebook {s.notebook[:2]})._", ""]
        if s.by_hand:
            text = answers.get(s.by_hand, "")
            lines += [f"**{s.label}, graded by hand in notebook {s.notebook[:2]}** (`{s.by_hand}`): "
                      f"_{s.by_hand_asks}_", ""]
            if text:
                lines += ["> " + ln if ln else ">" for ln in text.splitlines()] + [""]
            else:
                lines += [f"_Not answered yet: answer it in notebook {s.notebook[:2]}'s cell "
                          f"\"{s.by_hand_label}\", then run `make report` again._", ""]
                problems.append(f"unanswered: {s.label} `{s.by_hand}` in notebook {s.notebook[:2]}")
        for i, q in enumerate(s.report, 1):
            sid = slot_id(s, str(i))
            lines += [f"{i}. _{q}_", "", *_slot(sid, kept), ""]
            if kept.get(sid, PLACEHOLDER) == PLACEHOLDER and s.key != "Extra":  # the extras are optional
                problems.append(f"placeholder left: {s.label} {i} (`{sid}`)")
    report = "\n".join(lines).rstrip() + "\n"
    data = {"format": FORMAT, "lab_version": lab_utils.__version__,
            "notebook_versions": notebook_versions(labs),
            "written": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "provenance": asdict(prov), "tables": tables, "problems": problems}
    try:
        for sub in ("figures", "tables"):
            (out / sub).mkdir(parents=True, exist_ok=True)
        for p in copied:
            shutil.copyfile(p, out / ("figures" if p.suffix == ".png" else "tables") / p.name)
        tmp = out / "report.md.tmp"
        tmp.write_text(report, encoding="utf-8")
        tmp.replace(out / "report.md")  # the student's answers in the old report.md stay whole until then
        (out / "handin.json").write_text(json.dumps(data, indent=1, sort_keys=True, default=str) + "\n",
                                         encoding="utf-8")
        (out / "report.html").write_text(to_html(report, out, problems), encoding="utf-8")
    except OSError as e:  # one sentence naming the fix (a full disk, or the folder)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise LabError(f"No space left on the device holding {out} ({e.strerror}): the hand-in was not "
                           "written. Free space there, or write it elsewhere with --out DIR; the answers in "
                           "your report.md are kept.") from None
        raise LabError(f"could not write the hand-in folder {out} ({e.strerror or e}); check that folder, or "
                       "choose another with --out DIR.") from None
    return Written(out, prov, tables, problems)


def to_html(report: str, out: Path, problems: list[str]) -> str:
    """``report`` (report.md's text, in ``out``) as one self-contained HTML page: figures embedded as data
    URIs, for printing to PDF."""
    import mistune

    body = mistune.create_markdown(plugins=["table"], escape=False)(report)

    def embed(m: re.Match) -> str:
        path = out / html.unescape(m["src"])
        if not path.is_file():
            return m[0]
        data = base64.b64encode(path.read_bytes()).decode()
        return f'src="data:image/png;base64,{data}"'

    body = re.sub(r'src="(?P<src>figures/[^"]+\.png)"', embed, str(body))
    banner = ("" if not problems else '<div class="check"><b>Not ready to hand in</b> (make report CHECK=1):'
              "<ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in problems) + "</ul></div>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.4}"
             "table{border-collapse:collapse;font-size:90%}td,th{border:1px solid #bbb;padding:2px 6px}"
             "td{text-align:right}img{max-width:100%}.check{border:2px solid #c00;padding:0 1em}"
             "blockquote{border-left:4px solid #ccc;margin-left:0;padding-left:1em}")
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>Report</title><style>{style}"
            f"</style></head><body>{banner}{body}</body></html>\n")


def main(profile: str | None, out: str | None, check: bool, labs: str | None = None) -> int:
    """``python -m lab_utils report``: write the hand-in; with ``check``, list what is not ready and
    return 1 if anything is."""
    hand = build(profile, Path(out) if out else None, Path(labs) if labs else LABS_DIR)
    print(f"hand-in written: {hand.out}/report.md, report.html, handin.json "
          f"({len(hand.problems)} thing(s) not ready; `make report CHECK=1` lists them)")
    if check:
        for p in hand.problems:
            print(f"  not ready: {p}")
        if hand.problems:
            print(f"{len(hand.problems)} thing(s) to fix before handing in.")
            return 1
        print("ready to hand in.")
    return 0
