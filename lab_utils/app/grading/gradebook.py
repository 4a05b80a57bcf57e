"""The gradebook: what grading found, kept in ``<out>/grading.json``, and the files rewritten from it
and ``<out>/hand_points.csv`` (points given by hand, ``python -m lab_utils fold``): ``gradebook.csv``,
``details.csv``, ``feedback/<student>.md`` and ``hand_points_template.csv`` (their columns:
``docs/grading.md``, step 3). A new run replaces the students it graded and keeps
the others. A student's entry may carry extra ``columns``, ``flags`` and ``notes`` of its own
(:func:`lab_utils.app.grading.grade.new_entry`; ``make grade`` fills them from ``handin.json``).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from pathlib import Path

from lab_utils.learn.errors import LabError

STATE = "grading.json"
HAND = "hand_points.csv"
HAND_COLUMNS = ("student", "id", "question", "points", "comment")
DETAIL_COLUMNS = ("student", "id", "notebook", "question", "column", "points", "max_points", "file", "status",
                  "flag", "message", "sandbox")
NO_ANSWER = "no answer"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_csv(path: Path, columns, rows) -> None:
    """``rows`` (dicts; other keys ignored) as a CSV with a header, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    _atomic_write(path, buf.getvalue())


def load_state(out: Path) -> dict:
    path = Path(out) / STATE
    if path.exists():
        return json.loads(path.read_text())
    return {"students": {}, "questions": []}


def safe_name(name: str) -> str:
    return re.sub(r"[^0-9A-Za-z._-]+", "_", name).strip("_") or "student"


def read_hand_points(path: Path, state: dict) -> list[dict]:
    """Rows ``student, question, points[, comment]`` checked against the graded students and questions."""
    path = Path(path)
    if not path.is_file():
        raise LabError(f"No file {path}: give a CSV with columns student, question, points (comment "
                       "optional); grading writes a template, hand_points_template.csv.")
    with open(path, newline="", encoding="utf-8-sig") as f:
        rows = list(csv.DictReader(f))
    need = {"student", "question", "points"}
    if not rows or not need <= {c.strip().lower() for c in rows[0] if c}:
        raise LabError(f"{path} needs the columns student, question, points (comment optional).")
    maxima = {q["name"]: q["points"] for q in state["questions"]}
    by_name = {k.lower(): key for key, s in state["students"].items()
               for k in (s["name"], s.get("id"), key) if k}
    out, problems = [], []
    for i, raw in enumerate(rows, start=2):
        r = {k.strip().lower(): (v or "").strip() for k, v in raw.items() if k}
        if r["points"] == "":
            continue
        key = by_name.get(r["student"].lower()) or by_name.get(r.get("id", "").lower())
        if key is None:
            problems.append(f"line {i}: no graded student {r['student']!r}")
            continue
        if r["question"] not in maxima:
            problems.append(f"line {i}: no question {r['question']!r} in the bundle")
            continue
        try:
            points = float(r["points"])
        except ValueError:
            problems.append(f"line {i}: points {r['points']!r} is not a number")
            continue
        if not 0 <= points <= maxima[r["question"]]:
            problems.append(f"line {i}: {points:g} points for {r['question']}, which is worth "
                            f"{maxima[r['question']]:g}")
            continue
        out.append({"student": key, "question": r["question"], "points": points,
                    "comment": r.get("comment", "")})
    if problems:
        raise LabError(f"{path}: " + "; ".join(problems[:10]) + ". Nothing was folded in.")
    return out


def load_hand(out: Path) -> dict[tuple[str, str], dict]:
    path = Path(out) / HAND
    if not path.exists():
        return {}
    with open(path, newline="", encoding="utf-8") as f:
        return {(r["student"], r["question"]): {**r, "points": float(r["points"])} for r in csv.DictReader(f)}


def fold(hand_csv: Path, out: Path) -> int:
    """Fold points given by hand into the gradebook and feedback; returns how many were folded."""
    out = Path(out)
    state = load_state(out)
    if not state["students"]:
        raise LabError(f"No graded students in {out} ({STATE} missing): grade first (make grade).")
    rows = read_hand_points(hand_csv, state)
    hand = load_hand(out)
    for r in rows:
        hand[(r["student"], r["question"])] = r
    write_csv(out / HAND, ("student", "question", "points", "comment"), hand.values())
    write_outputs(state, out)
    return len(rows)


def _question_rows(key: str, s: dict, hand: dict) -> list[dict]:
    rows = []
    for book, b in s["notebooks"].items():
        for qname, q in b["questions"].items():
            points, message, flag = q["points"], q["message"], q["flag"]
            h = hand.get((key, qname))
            if h is not None:
                was = "" if points in ("", None) else f" (graded {points:g} automatically)"
                points, message = h["points"], f"points given by hand{was}" + \
                    (f": {h['comment']}" if h.get("comment") else "")
                flag = ""
            rows.append({"student": s["name"], "id": s.get("id", ""), "notebook": book, "question": qname,
                         "points": "" if points in ("", None) else round(float(points), 3),
                         "max_points": q["max_points"], "file": b.get("file", ""), "status": b["status"],
                         "flag": flag, "message": message, "sandbox": b.get("sandbox", ""),
                         "manual": q["manual"], "answer": q.get("answer", "")})
    return rows


def _feedback(s: dict, rows: list[dict], total: float, possible: float) -> str:
    lines = [f"# Feedback for {s['name']}" + (f" ({s['id']})" if s.get("id") else ""), "",
             f"Total so far: **{total:g} / {possible:g}** points.", ""]
    shown = {k: v for k, v in s.get("columns", {}).items() if v not in ("", None)}
    if shown or s.get("flags"):
        lines += ["## Where your numbers came from", ""]
        lines += [f"- {k}: {v}" for k, v in shown.items()]
        lines += [f"- flagged: {f}" for f in s.get("flags", [])]
        lines += [f"- {n}" for n in s.get("notes", [])]
        lines.append("")
    for book, b in s["notebooks"].items():
        mine = [r for r in rows if r["notebook"] == book]
        auto = [r for r in mine if not r["manual"]]
        got = sum(float(r["points"] or 0) for r in auto)
        lines += [f"## {book}", ""]
        if b.get("file"):
            lines.append(f"{'Graded file' if b['status'] == 'graded' else 'File'}: `{b['file']}`.")
        if b["status"] not in ("graded", "no submission"):
            lines.append(f"- {b['status']}")
        lines += [f"- {note}" for note in b.get("notes", [])]
        if not b["questions"]:   # not graded (a file that could not be read, 00, 08): no table
            lines.append("")
            continue
        lines += ["", f"Autograded: **{got:g} / {sum(r['max_points'] for r in auto):g}** points.", "",
                  "| question | points | max | notes |", "|---|---|---|---|"]
        for r in mine:
            pts = "(by hand)" if r["points"] == "" else f"{r['points']:g}"
            note = "; ".join(x for x in (r["flag"], r["message"]) if x).replace("|", "/").replace("\n", " ")
            lines.append(f"| {r['question']} | {pts} | {r['max_points']:g} | {note} |")
        manual = [r for r in mine if r["manual"]]
        if manual:
            lines += ["", "### Answers graded by hand", ""]
            for r in manual:
                pts = "not graded yet" if r["points"] == "" else f"{r['points']:g} / {r['max_points']:g}"
                lines += [f"**{r['question']}** ({pts}):", ""]
                lines += ["> " + (r["answer"] or NO_ANSWER).replace("\n", "\n> "), ""]
                if r["message"].startswith("points given by hand:"):
                    lines += [f"Comment: {r['message'].split(':', 1)[1].strip()}", ""]
        lines.append("")
    return "\n".join(lines)


def _row_notes(s: dict, rows: list[dict]) -> list[str]:
    """The gradebook row's notes: what is missing, what was not graded and why, every notebook's
    notes, hand-graded questions still open, the sandbox; then the entry's own."""
    books = s["notebooks"]
    missing = [b[:2] for b, r in books.items() if r["status"] == "no submission"]
    unfiled = any(b.startswith("(not graded)") for b in books)   # files recognised as no lab notebook
    notes = [(f"nothing graded for {', '.join(missing)} (see below)" if unfiled else
              f"no submission of {', '.join(missing)}")] if missing else []
    nothing = [b[:2] for b, r in books.items() if r["status"].startswith("nothing to grade")]
    if nothing:
        notes.append(f"{', '.join(nothing)}: nothing to grade (no exercise)")
    for book, r in books.items():
        if r["status"] == "no submission":
            continue
        where = book.removeprefix("(not graded) ") if book.startswith("(") else book[:2]
        if r["status"] not in ("graded",) and not r["status"].startswith("nothing to grade"):
            shown = f" ({r['file']})" if r.get("file") and not book.startswith("(") else ""
            notes.append(r["status"] if book == "(no notebook)" else f"{where}{shown}: {r['status']}")
        notes += [f"{where}: {n}" for n in r.get("notes", []) if n and n != r["status"]]
    if s.get("files") and "(no notebook)" not in books:
        notes.append("handed in, not notebooks (not graded): " + ", ".join(s["files"]))
    pending = [r["question"] for r in rows if r["manual"] and r["points"] == "" and r["status"] == "graded"]
    if pending:
        notes.append(f"by hand, not yet graded: {', '.join(pending)}")
    if any(b.get("sandbox") == "none" for b in books.values()):
        notes.append("graded without a sandbox")
    return notes + list(s.get("notes", []))


def write_outputs(state: dict, out: Path) -> None:
    """Rewrite gradebook.csv, details.csv, the feedback files and the hand-points template."""
    out = Path(out)
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    hand = load_hand(out)
    order = [q["name"] for q in state["questions"]]
    column = {q["name"]: q.get("column") or q["name"] for q in state["questions"]}
    maxima = {q["name"]: q["points"] for q in state["questions"]}
    extra = list(dict.fromkeys(c for s in state["students"].values() for c in s.get("columns", {})))
    wide, details, template = [], [], []
    for key in sorted(state["students"], key=lambda k: state["students"][k]["name"].lower()):
        s = state["students"][key]
        rows = _question_rows(key, s, hand)
        for r in rows:
            r["column"] = column.get(r["question"], r["question"])
        details += rows
        mine = {r["question"]: r for r in rows}
        possible = sum(maxima[q] for q in mine if q in maxima)
        total = sum(float(r["points"] or 0) for r in rows)
        flags = [f"{r['notebook'][:2]} {r['question']}: {r['flag']}" for r in rows if r["flag"]]
        wide.append({"student": s["name"], "id": s.get("id", ""),
                     **{column[q]: mine[q]["points"] if q in mine else "" for q in order},
                     "total": round(total, 3), "possible": possible,
                     **{c: s.get("columns", {}).get(c, "") for c in extra},
                     "flags": "; ".join(flags + list(s.get("flags", []))),
                     "notes": "; ".join(_row_notes(s, rows))})
        template += [{"student": s["name"], "id": s.get("id", ""), "question": r["question"],
                      "points": hand[(key, r["question"])]["points"] if (key, r["question"]) in hand else "",
                      "comment": hand.get((key, r["question"]), {}).get("comment", "")}
                     for r in rows if r["manual"] and r["status"] == "graded"]
        _atomic_write(out / "feedback" / f"{safe_name(s['name'])}.md", _feedback(s, rows, total, possible))
    write_csv(out / "gradebook.csv", ["student", "id", *(column[q] for q in order), "total", "possible",
                                      *extra, "flags", "notes"], wide)
    write_csv(out / "details.csv", DETAIL_COLUMNS, details)
    write_csv(out / "hand_points_template.csv", HAND_COLUMNS, template)
    _atomic_write(out / STATE, json.dumps(state, indent=1) + "\n")
