"""A graded notebook's record: each question's answers compared with the bundle's (:func:`judge`: a
test cell earns its points when all its cases are right, a wrong one is said in one sentence),
what the sandbox stopped, and the record of a notebook that was not graded."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

from lab_utils.app.grading import (
    exercise_code,
    gradebook,
    sandbox,
)
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.exercises import EXERCISES
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.exercises.exercise import NOT_DONE, explain
from lab_utils.app.grading.work import Work


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


def few(items: list[str], n: int = 3) -> str:
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


def judge(q: str, code: exercise_code.ExerciseCode, qspec: dict, outcome: sandbox.Outcome | None,
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


def fatal_error(outcome: sandbox.Outcome | None, limits: sandbox.Limits) -> tuple[str, bool]:
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
    fatal, _ = fatal_error(work.outcome, limits)
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
            flag = _and(flag, "check by hand: the notebook " + few(work.patches))
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


def ungraded_record(file: str, status: str, notes: list[str] = (), info: dict | None = None,
                    message: str = "", by_hand: float | str = "") -> dict:
    """The record of a notebook that was not graded: each question of ``info`` scores 0 (a hand-graded
    one ``by_hand``) with ``message``."""
    questions = {q["name"]: {"points": by_hand if q["manual"] else 0.0, "max_points": q["points"],
                             "manual": q["manual"], "flag": "", "answer": "", "message": message}
                 for q in (info or {}).get("questions", [])}
    return {"file": file, "status": status, "sandbox": "", "seconds": 0.0, "notes": list(notes),
            "questions": questions, "flagged": [], "stopped": []}


def also_handed_in(work: Work) -> list[str]:
    """The note naming the other files of this notebook a student handed in (none: [])."""
    return [f"also handed in: {', '.join(work.others)}"] if work.others else []


def failed_record(work: Work, info: dict | None) -> dict:
    """A file that was not graded: its status says why (``could not be read: ...``, ``not this lab's
    notebook: ...``); filed under a notebook (``info``), its questions score 0 and say so."""
    return ungraded_record(work.sub.file, work.problem, also_handed_in(work), info,
                           f"not graded: {work.problem}")


def missing_record(info: dict) -> dict:
    return ungraded_record("", "no submission", ["no submission"], info, "no submission", by_hand=0.0)
