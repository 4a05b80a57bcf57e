"""``make grade``: grade a folder of handed-in notebooks into a gradebook (``docs/grading.md``,
step 3).

Each submission is read as data, never run (:func:`prepare`: which lab notebook it is, by its stamp
or title; its exercise functions and what needs a human look); only the exercise functions run, in
the sandbox, each question in a process of its own (:mod:`~lab_utils.app.grading.sandbox`), on the
bundle's inputs; the answers are compared here (:func:`judge`): a test cell earns its points when
all its cases are right. Exit status 1 when a submission could not be graded, else 0.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.app import questions
from lab_utils.app.grading import class_results, gradebook, provenance, sandbox
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.build import DIST_DIR, load_manifest
from lab_utils.app.grading.exercises import EXERCISES
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.exercises.exercise import NOT_DONE, explain
from lab_utils.app.grading.submissions import (
    Roster,
    Student,
    Submission,
    find_submissions,
    read_roster,
    same_name,
)
from lab_utils.learn.errors import LabError

NO_SANDBOX_WARNING = ("WARNING: graded WITHOUT a sandbox (--no-sandbox): every submission's code ran with "
                      "your rights (it could read or change your files, other submissions and the bundle, "
                      "and use the network); every row is marked sandbox=none.")


@dataclass
class Work:
    """One handed-in file to grade (or one that cannot be graded, with why)."""
    sub: Submission
    student: Student
    book: str | None = None      # the lab notebook it is (stamp or title), once read
    guess: str | None = None     # a file that could not be read: the lab notebook its name suggests
    nb: dict | None = None
    problem: str = ""            # why not graded: "could not be read: ...", "not this lab's notebook..."
    nothing: bool = False        # a lab notebook without exercises (00, 08): nothing to grade
    notes: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)     # other files of this notebook, not graded
    code: dict[str, nbs.ExerciseCode] = field(default_factory=dict)
    patches: list[str] = field(default_factory=list)
    outcome: sandbox.Outcome | None = None
    record: dict | None = None

    @property
    def key(self) -> str:
        """Where its record is filed in the student's gradebook entry: the notebook, else the file."""
        return self.book or self.guess or f"(not graded) {self.sub.file}"


def _by_name(original: str, books) -> str | None:
    """The one lab notebook a file name suggests (``04_allreduce_bandwidth-1.ipynb``), else None."""
    guess = [k for k in books if k in original or original.startswith(k[:3])]
    return guess[0] if len(guess) == 1 else None


def identify(nb: dict, sub: Submission, manifest: dict) -> tuple[str | None, list[str]]:
    """Which lab notebook a submission is, and notes on it: its stamp (``make student`` writes it into
    every notebook's metadata), else its title. (None, [why]) for a notebook that is not this lab's."""
    known = {**manifest.get("ungraded", {}), **manifest["notebooks"]}
    meta = nb.get("metadata", {}).get(nbs.METADATA_KEY)
    name = meta.get("notebook") if isinstance(meta, dict) else None
    if name in known:
        if meta.get("version") != known[name]["version"]:
            graded = ": graded against this bundle's cases, check by hand" if name in manifest["notebooks"] \
                else ""
            return name, [f"notebook from another lab version ({meta.get('version')}; this bundle has "
                          f"{known[name]['version']}){graded}"]
        return name, []
    if name:
        return None, [f"not this lab's notebook: its stamp names {name!r}, which this bundle does not have "
                      f"({', '.join(sorted(known))}): a notebook of another version of the lab?"]
    title = nbs.title(nb)
    by_title = [k for k, v in known.items() if title and v.get("title") == title]
    if len(by_title) == 1:
        return by_title[0], [f"no {nbs.METADATA_KEY} stamp in its metadata (not saved from the student "
                             f"copy's notebook?): recognised as {by_title[0]} by its title, check by hand"]
    original = Path(sub.original or sub.path.name).name
    looks = _by_name(original, known)
    like = f"; its file name looks like {looks}'s, but a file name is not enough" if looks else ""
    return None, [f"not this lab's notebook: no {nbs.METADATA_KEY} stamp in its metadata (every notebook of "
                  f"the student copy has one) and its title is none of the lab's{like}"]


def prepare(work: Work, manifest: dict, specs: dict) -> None:
    """Read the submission (as data): notebook, exercise code, flags, notes."""
    nb, why = (None, work.sub.problem) if work.sub.problem else nbs.read_notebook(work.sub.path)
    if nb is None:   # filed under the notebook its name suggests: its row says why, not "no submission"
        original = Path(work.sub.original or work.sub.path.name).name
        work.problem, work.guess = f"could not be read: {why}", _by_name(original, manifest["notebooks"])
        return
    book, notes = identify(nb, work.sub, manifest)
    if book is None:
        work.problem = notes[0]
        return
    work.nb, work.book, work.notes = nb, book, notes
    if book not in manifest["notebooks"]:
        work.nothing = True
        return
    info, spec = manifest["notebooks"][book], specs[book]
    prog = nbs.parse_program(nb)
    auto = [q["name"] for q in info["questions"] if not q["manual"]]
    for q in auto:
        qs = spec["questions"][q]
        work.code[q] = nbs.extract_exercise(prog, q, qs["function"], qs.get("blank", ""))
    baseline = set(info.get("baseline_patches", []))
    work.patches = [p for p in nbs.monkeypatches(prog) if p.rsplit(" (code cell", 1)[0] not in baseline]
    deleted = nbs.check_cells_deleted(nb, auto)
    if deleted:
        work.notes.append(f"check cell of {', '.join(deleted)} deleted (graded all the same)")
    work.notes += prog.syntax_errors


def job_for(work: Work, spec: dict) -> dict:
    """What the sandboxed child runs: each exercise's code and its cases' inputs (no answers)."""
    questions = []
    for q, code in work.code.items():
        if code.problem or code.blank:
            continue
        tests = spec["questions"][q]["tests"]
        cases = [[t, c, case["case"]] for t, test in enumerate(tests) for c, case in enumerate(test["cases"])]
        first = code.source.split("\n").index(next(line for line in code.source.split("\n")
                                                   if line.startswith(f"def {code.function}("))) + 1
        questions.append({"name": q, "function": code.function, "code": code.source, "first_line": first,
                          "cases": cases})
    return {"questions": questions}


def _stopped(err: dict, limits: sandbox.Limits) -> str:
    """What the sandbox (or a limit) stopped, from an error the child reported ("" if none)."""
    kind, code = err.get("type", ""), err.get("errno", "")
    if kind == "CaseTimeLimit":
        return f"the case time limit ({limits.case_seconds:g} s)"
    if kind == "MemoryError":
        return f"the memory limit ({limits.memory_bytes / 2 ** 30:g} GiB)"
    if code == "EFBIG":
        return f"the file size limit ({limits.file_bytes / 2 ** 20:g} MiB)"
    if code == "ENOSPC":
        return f"a full private folder ({limits.folder_bytes / 2 ** 20:g} MiB)"
    if code == "EAGAIN" or kind == "BlockingIOError":
        return "the process limit"
    if code in ("ENETUNREACH", "ENETDOWN", "EHOSTUNREACH", "ECONNREFUSED") or kind == "gaierror":
        return "the network (the sandbox has none)"
    if code in ("EROFS", "EACCES", "EPERM"):
        return "a write or read outside its folder (read-only or not allowed in the sandbox)"
    if code == "ENOENT" and err.get("message", "").count("/") > 1:
        return "a file outside its folder (not in the sandbox)"
    return ""


def _line(err: dict) -> str:
    return f" (line {err['line']} of the function)" if err.get("line") and err["line"] > 0 else ""


def _few(items: list[str], n: int = 3) -> str:
    """The first ``n`` items, and how many more."""
    return ", ".join(items[:n]) + (f" and {len(items) - n} more" if len(items) > n else "")


def _and(first: str, then: str) -> str:
    """Two clauses as one sentence: ``first; then`` (no doubled punctuation, nothing for an empty part)."""
    first = first.rstrip(" .;")
    return f"{first}; {then}" if first and then else first or then


def _failed_case(label: str, err: dict, hidden: bool, limits: sandbox.Limits) -> tuple[str, str]:
    """(message, what stopped it or "") for a case that raised ``err``."""
    why = _stopped(err, limits)
    detail = err.get("message", "").strip()[:150]
    detail = f": {detail}" if detail and not hidden and err.get("type") != "CaseTimeLimit" else ""
    if why:
        return f"{label} was stopped by {why}{_line(err)}{detail}", why
    return f"{label} raised {err.get('type', 'an error')}{_line(err)}{detail}", ""


def _ended(ended: dict, limits: sandbox.Limits) -> tuple[str, str]:
    """(why a question's process gave no more answers, what stopped it or "")."""
    how, code = ended.get("how"), ended.get("code")
    if how == "timeout":
        limit = f"the case time limit ({limits.case_seconds:g} s)"
        return f"its code ran past {limit} and ignored the alarm; the grader ended its process", limit
    if how == "signal":
        try:
            name = f" ({signal.Signals(code).name})"
        except (ValueError, TypeError):
            name = ""
        why = "the CPU time limit" if code == signal.SIGXCPU else ""
        return f"its process was killed by signal {code}{name}", why
    status = f" (exit status {code})" if code is not None else ""
    return f"its process ended early{status}: sys.exit, os._exit or a crash in the function", ""


@dataclass
class Verdict:
    points: float
    message: str
    flag: str = ""
    stopped: list[str] = field(default_factory=list)


def judge(q: str, code: nbs.ExerciseCode, qspec: dict, outcome: sandbox.Outcome | None,
          limits: sandbox.Limits, fatal: str = "") -> Verdict:
    """Points and one sentence for one autograded question (``fatal``: what ended the grading of its
    notebook early, the reason its cases without an answer were not run)."""
    ex = EXERCISES[q]
    if code.problem:
        return Verdict(0.0, code.problem)
    if code.blank:
        if ex.find_the_bug:
            return Verdict(0.0, f"{NOT_DONE}: {code.function} is as handed out, bug and all; find the bug "
                                "and fix it")
        return Verdict(0.0, f"{NOT_DONE}: {code.function} is as handed out; write its body")
    lines = [r for r in (outcome.lines if outcome else []) if r.get("q") == q]
    stopped: list[str] = []
    note = code.notes[0] if code.notes else ""
    defining = next((r for r in lines if r.get("defining")), None)
    if defining:
        label = f"before any case ran, the code of {code.function}"
        msg, why = _failed_case(label, defining["error"], False, limits)
        return Verdict(0.0, _and(msg, note), stopped=[why] if why else [])
    ended = next((r["ended"] for r in lines if isinstance(r.get("ended"), dict)), None)
    got = {(r["t"], r["c"]): r for r in lines if "t" in r}
    earned, first, wrong, total = 0.0, "", 0, 0
    tests = qspec["tests"]
    n_hidden, k_hidden = sum(len(t["cases"]) for t in tests if t["hidden"]), 0
    for t, test in enumerate(tests):
        ok_all = True
        for c, case in enumerate(test["cases"]):
            total += 1
            r = got.get((t, c))
            hidden = test["hidden"]
            k_hidden += hidden
            label = f"hidden case {k_hidden} of {n_hidden}" if hidden else ex.describe(case["case"])
            if r is None and ended is not None:
                text, why = _ended(ended, limits)
                stopped += [why] if why else []
                ok_all, msg = False, f"{label} gave no answer: {text}"
            elif r is None:
                why = fatal or "the sandbox stopped the submission first"
                ok_all, msg = False, f"{label} was not run: {why}"
            elif "error" in r:
                msg, why = _failed_case(label, r["error"], hidden, limits)
                stopped += [why] if why else []
                ok_all = False
            elif same(r["answer"], case["expected"], ex.rel_tol, ex.abs_tol):
                continue
            else:
                ok_all = False
                msg = explain(ex, case["case"], r["answer"], case["expected"], case["mistakes"], label,
                              hidden)
            wrong += 1
            first = first or msg
        if ok_all:
            earned += test["points"]
    if wrong:
        first = _and(first, note)
    count = "" if wrong == 1 else f" ({wrong} of {total} cases wrong)"
    message = f"{first.rstrip(' .;')}{count}." if wrong else ""
    verdict = Verdict(earned, message, stopped=list(dict.fromkeys(stopped)))
    if code.flags:
        verdict.flag = "check by hand: " + "; ".join(code.flags) + f" (the cases gave {earned:g} / " \
                                                                   f"{qspec['points']:g}; 0 until checked)"
        verdict.points = 0.0
    return verdict


def _tried(outcome: sandbox.Outcome | None) -> dict[str, list[str]]:
    """What each question's code asked for (files, sockets, processes), all of it, by question."""
    out: dict[str, list[str]] = {}
    for r in outcome.lines if outcome else []:
        if "tried" in r:
            out.setdefault(str(r.get("q") or "the exercise code"), []).append(str(r["tried"]))
    return {q: list(dict.fromkeys(v)) for q, v in out.items()}


def _fatal(outcome: sandbox.Outcome | None, limits: sandbox.Limits) -> tuple[str, bool]:
    """(what ended the child early, whether the grader itself failed) ("", False when it finished)."""
    if outcome is None or outcome.done:
        return "", False
    if outcome.timed_out:
        return f"stopped by the time limit ({limits.wall_seconds:g} s for the notebook)", False
    if outcome.internal:
        return f"the grader failed: {outcome.internal}", True
    if not any(r.get("q") or r.get("tried") for r in outcome.lines):
        err = (outcome.stderr.strip().splitlines() or [f"exit status {outcome.returncode}"])[-1]
        return f"the grader could not run it: {err[:200]}", True
    return (f"the submission's code ended the grading process (exit status {outcome.returncode}: it killed "
            "the grader, crashed it or hit a limit)"), False


def notebook_record(work: Work, info: dict, spec: dict, limits: sandbox.Limits, use_sandbox: bool) -> dict:
    """The gradebook's record of one graded notebook."""
    questions, stopped, flagged = {}, [], []
    answers = nbs.answers(work.nb, [q["name"] for q in info["questions"] if q["manual"]])
    fatal, _ = _fatal(work.outcome, limits)
    tried = _tried(work.outcome)
    for q in info["questions"]:
        name = q["name"]
        if q["manual"]:
            questions[name] = {"points": "", "max_points": q["points"], "manual": True, "flag": "",
                               "answer": answers.get(name, ""),
                               "message": "graded by hand" if answers.get(name) else gradebook.NO_ANSWER}
            continue
        v = judge(name, work.code[name], spec["questions"][name], work.outcome, limits, fatal)
        if fatal and fatal not in v.message and not v.message.startswith((NOT_DONE, "no function")) \
                and v.points < q["points"]:
            v.message = _and(v.message, fatal)
        flag = v.flag
        if work.patches:
            flag = _and(flag, "check by hand: the notebook " + _few(work.patches))
        if flag:
            flagged.append({"q": name, "why": flag.removeprefix("check by hand: ")})
        stopped += v.stopped
        questions[name] = {"points": round(v.points, 6), "max_points": q["points"], "manual": False,
                           "flag": flag, "message": v.message, "answer": ""}
    notes = list(work.notes)
    if work.others:
        notes.append(f"also handed in, not graded (the latest readable file wins): {', '.join(work.others)}")
    if tried:
        how = ("in the sandbox only its own folder and a private /tmp are writable, both discarded; no other "
               "file of this machine is visible but the lab's code, read-only") if use_sandbox \
            else "no sandbox: whatever your account may do was allowed"
        asked = "; ".join(f"{q}: " + ", ".join(whats) for q, whats in tried.items())
        notes.append(f"the exercise code asked to {asked} ({how})")
    if fatal:
        notes.append(fatal)
    if stopped:
        notes.append("stopped by the sandbox or a limit: " + ", ".join(dict.fromkeys(stopped)))
    ran = "" if work.outcome is None else "bwrap" if use_sandbox else "none"
    return {"file": work.sub.file, "status": "graded", "sandbox": ran,
            "seconds": round(work.outcome.seconds, 2) if work.outcome else 0.0,
            "cpu_seconds": round(work.outcome.cpu_seconds, 2) if work.outcome else 0.0,
            "notes": [n for n in notes if n],
            "questions": questions, "flagged": flagged, "stopped": list(dict.fromkeys(stopped)) +
            ([fatal.removeprefix("stopped by ")] if fatal and "time limit" in fatal else [])}


NOTHING_TO_GRADE = "nothing to grade (a lab notebook without exercises)"


def _book(file: str, status: str, notes: list[str] = (), info: dict | None = None, message: str = "",
          by_hand: float | str = "") -> dict:
    """The record of a notebook that was not graded: each question of ``info`` scores 0 (a hand-graded
    one ``by_hand``) with ``message``."""
    questions = {q["name"]: {"points": by_hand if q["manual"] else 0.0, "max_points": q["points"],
                             "manual": q["manual"], "flag": "", "answer": "", "message": message}
                 for q in (info or {}).get("questions", [])}
    return {"file": file, "status": status, "sandbox": "", "seconds": 0.0, "notes": list(notes),
            "questions": questions, "flagged": [], "stopped": []}


def _also(work: Work) -> list[str]:
    return [f"also handed in: {', '.join(work.others)}"] if work.others else []


def failed_record(work: Work, info: dict | None) -> dict:
    """A file that was not graded: its status says why (``could not be read: ...``, ``not this lab's
    notebook: ...``); filed under a notebook (``info``), its questions score 0 and say so."""
    return _book(work.sub.file, work.problem, _also(work), info, f"not graded: {work.problem}")


def missing_record(info: dict) -> dict:
    return _book("", "no submission", ["no submission"], info, "no submission", by_hand=0.0)


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
            s["notebooks"][w.key] = _book(w.sub.file, NOTHING_TO_GRADE, w.notes + _also(w))
            nothing.append(f"{w.student.name} {w.book}")
            continue
        rec = w.record or notebook_record(w, manifest["notebooks"][w.book], specs[w.book], limits,
                                          use_sandbox)
        fatal, grader_failed = _fatal(w.outcome, limits)
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
            why = f"no notebook handed in, only {_few(s['files'])} (not graded: hand in the .ipynb files)"
            s["notebooks"]["(no notebook)"] = _book("", why)
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
