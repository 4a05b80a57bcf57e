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
import re
import shutil
import socket
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lab_utils
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.handout import LAYOUTS, handout_tables, q32_formulas
from lab_utils.app.questions import SECTIONS, Section
from lab_utils.engine import config
from lab_utils.engine.hardware import nccl_version
from lab_utils.engine.store import ResultStore
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
