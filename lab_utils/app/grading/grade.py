"""``make grade``: grade a folder of handed-in notebooks into a gradebook (``docs/grading.md``,
step 3).

Each submission is read as data, never run (:func:`~lab_utils.app.grading.work.prepare`: which lab
notebook it is, by its stamp or title; its exercise functions and what needs a human look); only the
exercise functions run, in the sandbox, each question in a process of its own
(:mod:`~lab_utils.app.grading.sandbox`), on the bundle's inputs; the answers are compared
(:func:`~lab_utils.app.grading.judge.judge`): a test cell earns its points when all its cases are right.
Exit status 1 when a submission could not be graded, else 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lab_utils.app import questions
from lab_utils.app.grading import (
    class_results,
    gradebook,
    provenance,
    sandbox,
)
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.build import DIST_DIR, load_manifest
from lab_utils.app.grading.judge import (
    NOTHING_TO_GRADE,
    also_handed_in,
    failed_record,
    fatal_error,
    few,
    missing_record,
    notebook_record,
    ungraded_record,
)
from lab_utils.app.grading.submissions import (
    Roster,
    Student,
    find_submissions,
    read_roster,
    same_name,
)
from lab_utils.app.grading.work import Work, job_for, prepare
from lab_utils.learn.errors import LabError

NO_SANDBOX_WARNING = ("WARNING: graded WITHOUT a sandbox (--no-sandbox): every submission's code ran with "
                      "your rights (it could read or change your files, other submissions and the bundle, "
                      "and use the network); every row is marked sandbox=none.")


def _group(works: list[Work]) -> list[Work]:
    """One file per student and notebook: the latest readable one (modification time, then resubmission
    number, then name), else the latest unreadable one; the others are listed on it."""
    chosen: dict[tuple[str, str], list[Work]] = {}
    rest = []
    for w in works:
        if w.book is None and w.guess is None:
            rest.append(w)
        else:
            chosen.setdefault((w.student.key, w.book or w.guess), []).append(w)
    out = []
    for group in chosen.values():
        group.sort(key=lambda w: (w.sub.mtime, w.sub.resubmission, w.sub.file))    # the order handed in
        latest = max(reversed(group), key=lambda w: w.book is not None)   # the last readable one, if any
        latest.others = [w.sub.file + (f" ({w.problem})" if w.problem else "")
                         for w in group if w is not latest]
        out.append(latest)
    return out + rest


def _match_student(name: str | None, student: Student) -> bool:
    """Whether ``--student name`` means ``student`` (its id, or its name in any spelling)."""
    if not name:
        return True
    return name.strip().lower() == (student.id or "").lower() or same_name(name, student.name)


def grade(submissions_dir: str | Path, bundle_dir: str | Path = DIST_DIR / "grading",
          out_dir: str | Path = "grades", roster: str | Path | None = None, student: str | None = None,
          jobs: int = 2, limits: sandbox.Limits | None = None, use_sandbox: bool = True) -> int:
    """Grade every submission; write the gradebook; return the exit status (1: some could not be graded)."""
    subs_root, bundle, out = (Path(p).expanduser().resolve() for p in (submissions_dir, bundle_dir, out_dir))
    if not subs_root.exists():
        raise LabError(f"{submissions_dir} does not exist: give the folder (or zip file) of handed-in "
                       "notebooks (docs/grading.md, step 2).")
    manifest = load_manifest(bundle)
    limits = limits or sandbox.Limits()
    specs = {book: json.loads((bundle / info["cases"]).read_text())
             for book, info in manifest["notebooks"].items()}
    the_roster: Roster | None = read_roster(Path(roster).expanduser().resolve()) if roster else None
    if use_sandbox:
        why = sandbox.probe(limits)
        if why:
            raise LabError(f"No sandbox for the submissions' code: {why}.")
        shown = sandbox.exposed([subs_root, bundle, out])
        if shown:
            raise LabError(f"The sandbox would show private files to the submissions ({shown[0]}): "
                           "keep submissions, bundle and gradebook outside the virtual environment and "
                           "lab_utils/.")
    out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grade-staging-") as staging:
        found = find_submissions(subs_root, Path(staging))
        works, extras = [], []     # extras: files that are not notebooks (a PDF), listed in their rows
        handins: list[Work] = []   # make report's handin.json: where each student's numbers came from
        for sub in found:
            s = sub.student
            if the_roster is not None:
                s = the_roster.match(s) or s
            if not _match_student(student, s):
                continue
            {"other": extras, "handin": handins}.get(sub.kind, works).append(Work(sub, s))
        on_roster = the_roster is not None and any(_match_student(student, r) for r in the_roster.students)
        if student and not works and not extras and not handins and not on_roster:
            raise LabError(f"No submission of a student named {student!r} in {submissions_dir}.")
        for w in works:
            prepare(w, manifest, specs)
        works = _group(works)
        to_run = [w for w in works if w.book and any(not c.problem and not c.blank for c in w.code.values())]
        slots: queue.SimpleQueue[int] = queue.SimpleQueue()   # each parallel run's user id (sandbox.UID_BASE)
        for slot in range(max(1, jobs)):
            slots.put(slot)

        def run(w: Work) -> None:
            slot = slots.get()
            try:
                w.outcome = sandbox.run(job_for(w, specs[w.book]), w.sub.path, limits, slot=slot, jobs=jobs,
                                        sandbox=use_sandbox)
            finally:
                slots.put(slot)
            _print_line(w, manifest, specs, limits, use_sandbox)

        for w in works:
            if w not in to_run:
                _print_line(w, manifest, specs, limits, use_sandbox)
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            list(pool.map(run, to_run))
        for h in handins:     # read while the staging folder (zip members) exists
            h.record = dict(zip(("handin", "why"), provenance.read_handin(h.sub.path)))
    return _record(works, extras, manifest, specs, out, limits, use_sandbox, the_roster, student,
                   time.perf_counter() - t_all, len(to_run), jobs, handins)


def _print_line(w: Work, manifest: dict, specs: dict, limits: sandbox.Limits, use_sandbox: bool) -> None:
    if w.problem or w.nothing:
        what = w.problem or NOTHING_TO_GRADE
        print(f"{w.student.name:<20} {w.book or w.sub.file:<28} {what}", flush=True)
        return
    rec = w.record = notebook_record(w, manifest["notebooks"][w.book], specs[w.book], limits, use_sandbox)
    got = sum(q["points"] for q in rec["questions"].values() if not q["manual"])
    most = manifest["notebooks"][w.book]["auto_points"]
    extra = [f"; flagged: {f['q']}: {f['why']}" for f in rec["flagged"][:1]]
    extra += ["; stopped: " + ", ".join(rec["stopped"])] if rec["stopped"] else []
    secs = f" in {rec['seconds']:.1f} s" if w.outcome else ""
    print(f"{w.student.name:<20} {w.book:<28} {got:g}/{most:g} autograded{secs}{''.join(extra)}", flush=True)


def _earlier_key(previous: dict[str, dict], s: dict) -> str | None:
    """The key of the earlier run's entry for ``s`` when its own key differs: a folder named after a
    student carries no id, while a run with the roster stored the student under the roster's id."""
    for k, p in previous.items():
        if (s["id"] and p.get("id") == s["id"]) or (not s["id"] and same_name(s["name"], p["name"])):
            return k
    return None


def new_entry(student: Student) -> dict:
    """A student's entry in the gradebook's state. Besides the graded notebooks it holds ``files``
    (what was handed in but not graded, e.g. a PDF), and for other modules to fill in ``columns``
    (extra gradebook columns, e.g. where the student's numbers came from), ``flags`` and ``notes``
    (the row's, beside those of the notebooks): :func:`gradebook.write_outputs` writes them."""
    return {"name": student.name, "id": student.id, "notebooks": {}, "files": [], "columns": {}, "flags": [],
            "notes": []}


def _add_provenance(fresh: dict[str, dict], works: list[Work], handins: list[Work], manifest: dict) -> None:
    """Each student's columns, flags and notes on where the numbers came from (their latest handin.json,
    else the versions stamped in their notebooks), and the numbers class_results compares."""
    latest: dict[str, list[Work]] = {}
    for h in handins:
        fresh.setdefault(h.student.key, new_entry(h.student))
        latest.setdefault(h.student.key, []).append(h)
    for key, s in fresh.items():
        stamps = {}
        for w in works:
            meta = (w.nb or {}).get("metadata", {}).get(nbs.METADATA_KEY) if w.student.key == key else None
            if w.book and isinstance(meta, dict) and isinstance(meta.get("version"), str):
                stamps[w.book] = meta["version"]
        mine = sorted(latest.get(key, []), key=lambda h: (h.sub.mtime, h.sub.resubmission, h.sub.file))
        handin, why = (mine[-1].record["handin"], mine[-1].record["why"]) if mine else (None, "")
        p = provenance.describe(handin, why, stamps, manifest)
        if len(mine) > 1:
            p.notes.append(f"handin.json: {mine[-1].sub.file} used (the latest); also handed in: "
                           f"{', '.join(h.sub.file for h in mine[:-1])}")
        s["columns"].update(p.columns)
        s["flags"] += p.flags
        s["notes"] += p.notes
        s["provenance"] = {"device": p.device, "device_count": p.device_count, "profile": p.profile,
                           "flags": p.flags, "results": [dataclasses.asdict(r) for r in p.results]}


def _record(works: list[Work], extras: list[Work], manifest: dict, specs: dict, out: Path,
            limits: sandbox.Limits, use_sandbox: bool, roster: Roster | None, only: str | None,
            seconds: float, ran: int, jobs: int, handins: list[Work] = ()) -> int:
    """Merge this run into the gradebook, write it, print the summary; the exit status."""
    state = gradebook.load_state(out)
    previous = state["students"] if only else {}
    fresh: dict[str, dict] = {}
    failed, flagged, stopped, nothing = [], [], [], []
    for w in works:
        s = fresh.setdefault(w.student.key, new_entry(w.student))
        if w.problem:
            s["notebooks"][w.key] = failed_record(w, manifest["notebooks"].get(w.key))
            failed.append(f"{w.student.name} ({w.sub.file}: {w.problem})")
            continue
        if w.nothing:
            s["notebooks"][w.key] = ungraded_record(w.sub.file, NOTHING_TO_GRADE, w.notes + also_handed_in(w))
            nothing.append(f"{w.student.name} {w.book}")
            continue
        rec = w.record or notebook_record(w, manifest["notebooks"][w.book], specs[w.book], limits,
                                          use_sandbox)
        fatal, grader_failed = fatal_error(w.outcome, limits)
        if grader_failed:
            rec["status"] = f"could not be graded: {fatal}"
            failed.append(f"{w.student.name} ({w.sub.file}: {fatal})")
        s["notebooks"][w.book] = rec
        reasons: dict[str, list[str]] = {}
        for f in rec["flagged"]:
            for why in f["why"].split("; check by hand: "):
                reasons.setdefault(why, []).append(f["q"])
        flagged += [f"{w.student.name} {w.book} {', '.join(qs)}: {why}" for why, qs in reasons.items()]
        if rec["stopped"]:
            stopped.append(f"{w.student.name} {w.book}: {', '.join(rec['stopped'])}")
    for e in extras:
        fresh.setdefault(e.student.key, new_entry(e.student))["files"].append(e.sub.file)
    _add_provenance(fresh, works, handins, manifest)
    known = {**manifest.get("ungraded", {}), **manifest["notebooks"]}
    for key in list(fresh):   # --student: notebooks not handed in again keep their grades
        s = fresh[key]
        old = key if key in previous else _earlier_key(previous, s)
        before = previous.get(old, {}) if old else {}
        for book, rec in before.get("notebooks", {}).items():
            if book in known:
                s["notebooks"].setdefault(book, rec)
        if before and roster is None:   # the name and id an earlier run took from the roster
            s["name"], s["id"] = before["name"], before.get("id", s["id"])
            fresh[old] = fresh.pop(key)   # one row per student: the earlier run's
    for s in fresh.values():    # handed in files, but no notebook at all
        if s["files"] and not s["notebooks"]:
            why = f"no notebook handed in, only {few(s['files'])} (not graded: hand in the .ipynb files)"
            s["notebooks"]["(no notebook)"] = ungraded_record("", why)
            failed.append(f"{s['name']} ({why})")
    if roster is not None:
        for r in roster.students:
            if r.key not in fresh and _match_student(only, r):
                fresh[r.key] = new_entry(r)
    students = {**previous, **fresh}
    books = sorted({b for s in students.values() for b in s["notebooks"] if b in manifest["notebooks"]})
    missing = []
    for s in students.values():
        for b in books:
            s["notebooks"].setdefault(b, missing_record(manifest["notebooks"][b]))
        s["notebooks"] = dict(sorted(s["notebooks"].items()))
        if all(b["status"] == "no submission" for b in s["notebooks"].values()) and s in fresh.values():
            missing.append(s["name"])
    state.update(students=students, lab_version=manifest["lab_version"],
                 questions=[{"name": q["name"], "points": q["points"], "notebook": b,
                             "column": questions.gradebook_column(q["name"])}
                            for b in books for q in manifest["notebooks"][b]["questions"]])
    gradebook.write_outputs(state, out)
    n_graded = sum(1 for w in works if w.book and not w.problem and not w.nothing)
    run_seconds = [w.outcome.seconds for w in works if w.outcome]
    cpu = [w.outcome.cpu_seconds for w in works if w.outcome]
    how = "each in a bwrap sandbox" if use_sandbox else "WITHOUT a sandbox"
    per = (f", {sum(run_seconds) / len(run_seconds):.1f} s per notebook run ({sum(cpu) / len(cpu):.1f} s of "
           f"CPU), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores") if run_seconds else ""
    print(f"\nsummary: {n_graded} notebook(s) of {len(fresh)} student(s) graded in {seconds:.1f} s "
          f"({ran} run, {jobs} at a time{per}, {how}; limits: {limits.describe()})")
    for title, items in (("could not be graded", failed), ("flagged, check by hand", flagged),
                         ("stopped by the sandbox or a limit", stopped), ("no submission", missing),
                         ("nothing to grade, no exercise", nothing)):
        if items:
            print(f"  {title} ({len(items)}): " + "; ".join(items[:8]) + (" ..." if len(items) > 8 else ""))
    if not use_sandbox:
        print(NO_SANDBOX_WARNING)
    shown = os.path.relpath(out) if not os.path.relpath(out).startswith("..") else str(out)
    print(f"gradebook: {shown}/gradebook.csv (one row per student), details.csv, feedback/; points given "
          f"by hand: fill in {shown}/hand_points_template.csv, then python -m lab_utils fold FILE "
          f"--out {shown}")
    print("\n".join(class_results.write(state, out, shown)))
    if failed:
        print(f"exit status 1: {len(failed)} submission(s) could not be graded (their rows say why)")
    return 1 if failed else 0
