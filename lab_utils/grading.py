"""Exercises, the student edition and headless grading (otter-grader).

The notebooks in ``labs/`` are the *master* notebooks in otter-assign (v7) format: they keep
the solutions and run as they always did (``make lab``). This module

- :func:`build` runs ``otter assign`` on every master notebook that has an
  ``# ASSIGNMENT CONFIG`` cell and writes the **student edition** (solutions and hidden tests
  stripped, outputs cleared) to ``dist/student/`` and the **grading bundle** (one otter
  autograder zip per notebook and ``manifest.json``) to ``dist/grading/``;
- :func:`grade` grades a folder of submitted notebooks headless with ``otter run`` (no Docker),
  one subprocess per submission with a time limit, and writes ``gradebook.csv`` and
  ``feedback/<student>.md``. A broken submission becomes rows that say why; the batch goes on.

It also holds the small fakes the exercises' tests use (:class:`FakeAsyncDevice`) and the
messages that explain the classic mistakes (:func:`diagnose_speedup`). Importing this module
is cheap: otter is imported only by :func:`build` and :func:`grade`.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.core.errors import LabError

# --------------------------------------------------------------------------------------------
# Exercise helpers (imported by the tests in the notebooks)
# --------------------------------------------------------------------------------------------


class FakeAsyncDevice:
    """A pretend GPU with a controllable clock, to test a step timer on the CPU.

    Like CUDA, a step *launches* its work and returns at once (``launch_seconds`` of host time);
    the work runs later, one kernel after another. ``sync()`` waits until all queued work is done
    (``torch.cuda.synchronize()``); ``clock()`` reads the host clock (``time.perf_counter()``).
    ``queued_seconds`` is work still running from before the step (the previous step, a copy).

    The right answer, :attr:`true_seconds`, is the time from "everything before the step has
    finished" to "the step's own work has finished": ``launch_seconds + work_seconds``.
    """

    def __init__(self, queued_seconds: float = 0.0, launch_seconds: float = 1e-4):
        self.now = 0.0
        self.busy_until = float(queued_seconds)
        self.queued_seconds = float(queued_seconds)
        self.launch_seconds = float(launch_seconds)
        self.work_seconds = 0.0
        self.steps = 0
        self.syncs = 0

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1
        self.now = max(self.now, self.busy_until)

    def step_fn(self, work_seconds: float):
        """A step that queues ``work_seconds`` of device work and returns after the launch."""
        self.work_seconds = float(work_seconds)

        def step():
            self.steps += 1
            self.now += self.launch_seconds
            self.busy_until = max(self.busy_until, self.now) + self.work_seconds

        return step

    @property
    def true_seconds(self) -> float:
        return self.launch_seconds + self.work_seconds

    def agrees(self, seconds) -> bool:
        return (isinstance(seconds, (int, float)) and self.steps == 1
                and math.isclose(seconds, self.true_seconds, rel_tol=1e-9, abs_tol=1e-12))

    def diagnose(self, seconds) -> str:
        """One readable sentence on what a wrong ``seconds`` means ("" when it is right)."""
        if seconds is None:
            return "not done yet: time_step returns None; write its body."
        if not isinstance(seconds, (int, float)):
            return f"time_step must return seconds as a float, got {type(seconds).__name__}."
        if self.steps != 1:
            return f"time_step must call step() exactly once; it was called {self.steps} times."
        if self.agrees(seconds):
            return ""
        if math.isclose(seconds, self.launch_seconds, rel_tol=1e-6):
            return (f"got {seconds:.6g} s, the launch time only: you read the clock before the device "
                    "finished. Call sync() after step() and before reading the clock.")
        if math.isclose(seconds, self.true_seconds + self.queued_seconds, rel_tol=1e-6):
            return (f"got {seconds:.6g} s, which includes {self.queued_seconds:g} s of work queued "
                    "BEFORE the step: call sync() before you start the clock too.")
        return f"got {seconds!r} s, expected {self.true_seconds:.6g} s (launch + the step's work)."


def diagnose_speedup(result, t1_seconds: float, tn_seconds: float, n_devices: int) -> str:
    """A readable sentence on what is wrong with ``result = (speedup, efficiency)`` ("" if right).

    The reference is the lab's (``lab_utils.experiments.scaling``): speedup = T(1)/T(N) and
    efficiency = speedup / N, on unrounded epoch times.
    """
    if result is None:
        return "not done yet: speedup_and_efficiency returns None; write its body."
    try:
        s, e = result
        s, e = float(s), float(e)
    except (TypeError, ValueError):
        return f"return a pair (speedup, efficiency) of numbers, got {result!r}."
    want_s = t1_seconds / tn_seconds
    want_e = want_s / n_devices
    close = lambda a, b: math.isclose(a, b, rel_tol=1e-6)  # noqa: E731
    where = f"T(1)={t1_seconds} s, T({n_devices})={tn_seconds} s"
    if close(s, want_s) and close(e, want_e):
        return ""
    if close(s, n_devices * want_s):
        return (f"{where}: speedup {s:.4g} is N x T(1)/T(N). On EPOCH times that counts N twice "
                f"(each of the N devices already does 1/N of the epoch); the speedup is {want_s:.4g}.")
    if close(s, 1 / want_s):
        return f"{where}: speedup {s:.4g} is T(N)/T(1), upside down; the speedup is T(1)/T(N)."
    if not close(s, want_s):
        if abs(s - want_s) < 0.1:
            return (f"{where}: speedup {s:.4g}, the times give {want_s:.4g}. Do not round the times "
                    "(or copy a speedup from a report): compute it from the timings.")
        return f"{where}: speedup {s:.4g}, expected T(1)/T(N) = {want_s:.4g}."
    if close(e, want_s):
        return f"{where}: efficiency {e:.4g} equals the speedup; efficiency = speedup / N = {want_e:.4g}."
    return f"{where}: efficiency {e:.4g}, expected speedup / N = {want_e:.4g}."


# --------------------------------------------------------------------------------------------
# Build: the student edition and the grading bundle
# --------------------------------------------------------------------------------------------


REPO = Path(__file__).resolve().parent.parent
LABS_DIR = REPO / "labs"
DIST_DIR = REPO / "dist"
METADATA_KEY = "dl_perf_lab"          # notebook metadata the build adds to each student notebook
MANIFEST = "manifest.json"
CONFIG_MARK = "# ASSIGNMENT CONFIG"
# Text that must never reach a student notebook (otter's own markers).
LEAK_MARKERS = ("# BEGIN SOLUTION", "# END SOLUTION", "# HIDDEN", "BEGIN TESTS", "END TESTS")
DEFAULT_TIMEOUT_S = 120.0


def _source(cell) -> str:
    s = cell.get("source", "")
    return "".join(s) if isinstance(s, list) else s


def _raw_mark(cell) -> str:
    """'# BEGIN QUESTION' etc. for an otter block cell, else ''."""
    if cell.get("cell_type") != "raw":
        return ""
    first = _source(cell).strip().split("\n", 1)[0].strip()
    marks = r"# (BEGIN|END) (QUESTION|SOLUTION|TESTS|PROMPT)|" + CONFIG_MARK
    return first if re.fullmatch(marks, first) else ""


def is_master(path: Path) -> bool:
    nb = json.loads(Path(path).read_text())
    return any(_raw_mark(c) == CONFIG_MARK for c in nb["cells"])


def master_notebooks(labs_dir: Path = LABS_DIR) -> list[Path]:
    """The labs/NN_*.ipynb that carry an ``# ASSIGNMENT CONFIG`` cell, in order."""
    return [p for p in sorted(Path(labs_dir).glob("[0-9][0-9]_*.ipynb")) if is_master(p)]


def notebook_version(path: Path) -> str:
    """A hash of the master notebook's cells (type and source; outputs and ids ignored)."""
    nb = json.loads(Path(path).read_text())
    h = hashlib.sha256()
    for c in nb["cells"]:
        h.update(c["cell_type"].encode() + b"\0" + _source(c).encode() + b"\0")
    return h.hexdigest()[:12]


@dataclass
class MasterParts:
    """What a master notebook's otter blocks contain, read without otter."""
    questions: list[dict] = field(default_factory=list)   # name, points, manual
    secret_lines: set[str] = field(default_factory=set)   # solution and hidden-test lines
    public_text: str = ""                                  # everything a student may see
    public_tests: dict[str, int] = field(default_factory=dict)  # question -> public test cells


def parse_master(path: Path) -> MasterParts:
    import yaml

    nb = json.loads(Path(path).read_text())
    parts = MasterParts()
    public: list[str] = []
    block: list[str] = []
    for c in nb["cells"]:
        mark, src = _raw_mark(c), _source(c)
        if mark:
            kind, what = mark.split()[1:3] if mark != CONFIG_MARK else ("", "")
            if kind == "BEGIN":
                block.append(what)
                if what == "QUESTION":
                    cfg = yaml.safe_load(src.split("\n", 1)[1]) or {}
                    pts = cfg.get("points", 1)
                    total = sum(p or 0 for p in pts) if isinstance(pts, list) else (1 if pts is None else pts)
                    parts.questions.append({"name": cfg["name"], "points": float(total),
                                            "manual": bool(cfg.get("manual", False))})
            elif kind == "END" and block:
                block.pop()
            continue
        secret: list[str] = []
        if block and block[-1] == "SOLUTION" and c["cell_type"] == "markdown":
            secret = src.split("\n")
        elif block and block[-1] == "TESTS" and src.lstrip().startswith("#") and \
                re.search(r"\bhidden\b", src.lstrip().split("\n", 1)[0], re.I):
            secret = src.split("\n")
        elif block and block[-1] == "TESTS":
            name = parts.questions[-1]["name"]
            parts.public_tests[name] = parts.public_tests.get(name, 0) + 1
            public.extend(src.split("\n"))
        elif c["cell_type"] == "code" and "# BEGIN SOLUTION" in src:
            inside = False
            for line in src.split("\n"):
                if line.strip().startswith("# END SOLUTION"):
                    inside = False
                elif line.strip().startswith("# BEGIN SOLUTION"):
                    inside = True
                elif inside:
                    secret.append(line)
                else:
                    public.append(line)
        else:
            public.extend(src.split("\n"))
        for line in secret:
            code = line.split("#", 1)[0].strip() if c["cell_type"] == "code" else line.strip()
            if len(code) >= 10:
                parts.secret_lines.add(code)
    parts.public_text = "\n".join(public)
    parts.secret_lines = {s for s in parts.secret_lines if s not in parts.public_text}
    return parts


def find_leaks(student_nb_text: str, parts: MasterParts) -> list[str]:
    """Solution or hidden-test text found in a student notebook (its JSON text).

    Cell sources are searched for otter's markers and every solution / hidden-test line of the
    master; the public tests otter stores in the metadata (rewritten as doctests) must be
    exactly the master's public test cells, none hidden.
    """
    nb = json.loads(student_nb_text)
    sources = "\n".join(_source(c) for c in nb["cells"])
    found = [m for m in LEAK_MARKERS if m in sources]
    found += [line for line in sorted(parts.secret_lines) if line in sources]
    tests = nb.get("metadata", {}).get("otter", {}).get("tests", {})
    for name, t in tests.items():
        cases = [c for suite in t.get("suites", []) for c in suite.get("cases", [])]
        if any(c.get("hidden") for c in cases) or len(cases) != parts.public_tests.get(name, 0):
            found.append(f"{name}: {len(cases)} test cases in the student notebook, "
                         f"{parts.public_tests.get(name, 0)} public ones in the master")
    meta = json.dumps(nb.get("metadata", {}), ensure_ascii=False)
    found += [m for m in LEAK_MARKERS if m in meta]
    return found


def _otter(args: list[str], timeout: float, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "otter", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout)


def build(out_dir: str | Path = DIST_DIR, labs_dir: str | Path = LABS_DIR,
          notebooks: list[str] | None = None, timeout_s: float = 300) -> dict:
    """Run ``otter assign`` on every master notebook; write ``<out>/student/`` and ``<out>/grading/``.

    ``<out>/student/NN_*.ipynb``: the student edition (solutions and hidden tests stripped, outputs
    cleared, public tests in the notebook's metadata for ``grader.check``), each stamped with
    ``metadata.dl_perf_lab = {notebook, version}``. ``<out>/grading/``: ``NN_*-autograder.zip``
    (otter's, with every test) and ``manifest.json``. Raises :class:`LabError` when otter fails or
    anything solution-like is left in a student notebook. Returns the manifest.
    """
    out, labs = Path(out_dir).resolve(), Path(labs_dir).resolve()
    masters = master_notebooks(labs)
    if notebooks:
        masters = [m for m in masters if m.stem in notebooks or m.name in notebooks
                   or m.stem[:2] in notebooks]
    if not masters:
        raise LabError(f"No notebook in {labs} has an '{CONFIG_MARK}' cell (or none matches {notebooks}).")
    student, grading = out / "student", out / "grading"
    for d in (student, grading):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
    import otter

    manifest = {"lab_version": "", "otter_version": otter.__version__,
                "built": time.strftime("%Y-%m-%dT%H:%M:%S"), "notebooks": {}}
    with tempfile.TemporaryDirectory(prefix="otter-assign-") as tmp:
        for master in masters:
            t0 = time.perf_counter()
            parts = parse_master(master)
            version = notebook_version(master)
            res = Path(tmp) / master.stem
            try:
                r = _otter(["assign", str(master), str(res)], timeout_s, cwd=master.parent)
            except subprocess.TimeoutExpired:
                raise LabError(f"otter assign {master.name} took longer than {timeout_s:.0f} s.") from None
            if r.returncode != 0:
                raise LabError(f"otter assign failed on {master.name}:\n{(r.stdout + r.stderr)[-3000:]}")
            nb = json.loads((res / "student" / master.name).read_text())
            nb.setdefault("metadata", {})[METADATA_KEY] = {"notebook": master.stem, "version": version}
            text = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
            leaks = find_leaks(text, parts)
            if leaks:
                raise LabError(f"The student edition of {master.name} still holds solution or hidden-test "
                               f"text: {leaks[:5]}; put it between '# BEGIN SOLUTION' / '# END SOLUTION' "
                               "(or in a raw SOLUTION block) or mark the test '# HIDDEN'.")
            (student / master.name).write_text(text)
            zips = sorted((res / "autograder").glob("*-autograder_*.zip"))
            if len(zips) != 1:
                raise LabError(f"otter assign made {len(zips)} autograder zips for {master.name}, not 1.")
            zip_name = f"{master.stem}-autograder.zip"
            shutil.copy(zips[0], grading / zip_name)
            manifest["notebooks"][master.stem] = {
                "file": master.name, "version": version, "autograder": zip_name,
                "questions": parts.questions,
                "auto_points": sum(q["points"] for q in parts.questions if not q["manual"]),
                "manual_points": sum(q["points"] for q in parts.questions if q["manual"]),
            }
            print(f"built {master.name}: {len(parts.questions)} questions, version {version} "
                  f"({time.perf_counter() - t0:.1f} s)")
    versions = {k: v["version"] for k, v in manifest["notebooks"].items()}
    manifest["lab_version"] = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()[:12]
    (grading / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"student edition: {student}\ngrading bundle:  {grading} (lab version {manifest['lab_version']})")
    return manifest


# --------------------------------------------------------------------------------------------
# Grade: otter run on every submission, one subprocess each, with a time limit
# --------------------------------------------------------------------------------------------

GRADEBOOK_COLUMNS = ("student", "notebook", "question", "points", "max_points", "error")


@dataclass
class Submission:
    student: str
    path: Path
    problem: str = ""          # why it cannot be graded at all ("" = gradable)


def find_submissions(root: Path) -> list[Submission]:
    """``root/<student>.ipynb`` (student = file stem) or ``root/<student>/*.ipynb`` (student = folder).

    Anything else is a submission that says why it cannot be graded: a file that is not a
    notebook, a folder without a notebook. Hidden files and ``.ipynb_checkpoints`` are skipped.
    """
    subs: list[Submission] = []
    for entry in sorted(Path(root).iterdir()):
        if entry.name.startswith((".", "_")):
            continue
        if entry.is_dir():
            nbs = sorted(p for p in entry.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
            if not nbs:
                others = ", ".join(sorted(p.name for p in entry.iterdir())[:5]) or "empty"
                subs.append(Submission(entry.name, entry, f"no .ipynb in the folder ({others})"))
            subs += [Submission(entry.name, p) for p in nbs]
        elif entry.suffix == ".ipynb":
            subs.append(Submission(entry.stem, entry))
        else:
            subs.append(Submission(entry.stem, entry, f"not a notebook ({entry.name}): hand in the .ipynb"))
    return subs


def _read_notebook(path: Path) -> tuple[dict | None, str]:
    try:
        nb = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
            return None, "not a Jupyter notebook (no cells)"
        return nb, ""
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, f"not a readable notebook ({type(e).__name__}: {str(e)[:120]})"


def identify(nb: dict, path: Path, manifest: dict) -> tuple[str | None, list[str]]:
    """Which lab notebook a submission is, and notes on its version (metadata first, then file name)."""
    meta = nb.get("metadata", {}).get(METADATA_KEY) or {}
    books = manifest["notebooks"]
    name = meta.get("notebook")
    notes = []
    if name not in books:
        guess = [k for k in books if k in path.stem or path.stem.startswith(k[:3])]
        name = guess[0] if len(guess) == 1 else None
        if name is None:
            return None, [f"not a notebook of this lab's student edition (metadata {METADATA_KEY!r} "
                          f"missing, file name {path.name!r} matches none of {sorted(books)})"]
        notes.append(f"no {METADATA_KEY} metadata (not built by `python -m lab_utils student`?): "
                     f"taken as {name} from the file name")
    elif meta.get("version") != books[name]["version"]:
        notes.append(f"notebook from another lab version ({meta.get('version')}, this bundle has "
                     f"{books[name]['version']}): graded against this bundle's tests; check by hand")
    return name, notes


def static_checks(nb: dict, questions: list[dict]) -> list[str]:
    """Problems visible without running: syntax errors, deleted check cells."""
    import ast

    notes = []
    code = [_source(c) for c in nb["cells"] if c.get("cell_type") == "code"]
    for i, src in enumerate(code):
        py = "\n".join(line for line in src.split("\n") if not line.lstrip().startswith(("%", "!")))
        try:
            ast.parse(py)
        except SyntaxError as e:
            first = (src.strip().split("\n") or [""])[0][:60]
            notes.append(f"syntax error in code cell {i + 1} (line {e.lineno}: {e.msg}; "
                         f"cell starts {first!r})")
    alltext = "\n".join(code)
    for q in questions:
        if not q["manual"] and not re.search(rf"""\.check\(\s*["']{re.escape(q['name'])}["']""", alltext):
            notes.append(f"check cell of {q['name']} deleted (graded with the bundle's tests anyway)")
    return notes


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def run_one(submission: Path, autograder: Path, timeout_s: float) -> tuple[dict | None, str, float]:
    """Grade one notebook with ``otter run`` in a subprocess (its own process group, killed on timeout).

    Returns (results, error, seconds): results as written by :func:`_worker`, or None and why.
    """
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grade-") as tmp:
        work = Path(tmp)
        sub = work / "submission" / (autograder.name.replace("-autograder.zip", "") + ".ipynb")
        sub.parent.mkdir()
        shutil.copy(submission, sub)
        out = work / "results.json"
        env = {**os.environ, "LAB_RESULTS_DIR": str(work / "results"), "LAB_PROFILE": "quick",
               "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "lab_utils.grading", str(sub), str(autograder), str(out)]
        with open(work / "log.txt", "w") as log:
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                return None, (f"stopped after the {timeout_s:.0f} s time limit (an endless loop, or a cell "
                              "that trains: tag it otter_ignore)"), time.perf_counter() - t0
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        _kill_group(proc)  # the kernel otter started lives in the same group
        seconds = time.perf_counter() - t0
        if proc.returncode != 0 or not out.exists():
            tail = (work / "log.txt").read_text(errors="replace").strip().split("\n")
            why = next((line for line in reversed(tail) if "Error" in line), tail[-1] if tail else "")
            return None, f"otter run failed (exit {proc.returncode}): {why[:300]}", seconds
        return json.loads(out.read_text()), "", seconds


_EXC = re.compile(r"^\s*(\w*(?:Error|Exception|Exit)\w*|KeyboardInterrupt)(?::\s*(.*))?$")


def _failure_message(message: str | None) -> str:
    """The last exception line of a doctest failure ("AssertionError: not done yet: ...")."""
    if not message:
        return "failed"
    for line in reversed(message.strip().split("\n")):
        m = _EXC.match(line)
        if m:
            return f"{m.group(1)}: {m.group(2)}" if m.group(2) else m.group(1)
    return message.strip().split("\n")[-1][:200]


def _worker(submission: str, autograder: str, out: str) -> int:
    """Subprocess entry: ``otter run`` (otter.run.main, no Docker) on one notebook -> JSON."""
    from otter.run import main as otter_run

    results = otter_run(submission, autograder=autograder, output_dir=None, no_logo=True)
    doc = {"catastrophic_error": repr(results.catastrophic_error) if results.catastrophic_error else "",
           "questions": {}}
    for name, tf in results.results.items():
        doc["questions"][name] = {
            "score": float(tf.score), "possible": float(tf.possible),
            "cases": [{"hidden": bool(r.test_case.hidden), "passed": bool(r.passed),
                       "message": _failure_message(r.message) if not r.passed else ""}
                      for r in tf.test_case_results]}
    Path(out).write_text(json.dumps(doc, indent=1))
    return 0


def _question_rows(student: str, book: str, questions: list[dict], res: dict | None, fatal: str,
                   notes: list[str]) -> list[dict]:
    rows = []
    for q in questions:
        row = {"student": student, "notebook": book, "question": q["name"], "max_points": q["points"]}
        if q["manual"]:
            rows.append({**row, "points": "", "error": f"graded by hand: the answer is in "
                                                       f"feedback/{student}.md"})
            continue
        msgs = list(notes)
        r = (res or {}).get("questions", {}).get(q["name"])
        if fatal:
            points, msgs = 0.0, [fatal, *msgs]
        elif r is None:
            points, msgs = 0.0, ["no result for this question from otter", *msgs]
        else:
            points = r["score"]
            pub = [c["message"] for c in r["cases"] if not c["passed"] and not c["hidden"]]
            hid = [c["message"] for c in r["cases"] if not c["passed"] and c["hidden"]]
            if pub:
                msgs.append(f"public tests failed: {pub[0]}")
            if hid:
                msgs.append(f"{len(hid)} hidden test(s) failed: {hid[0]}")
        rows.append({**row, "points": round(points, 3), "error": "; ".join(dict.fromkeys(msgs))})
    return rows


def _manual_answers(nb: dict) -> list[str]:
    """The text of the student's answer cells of hand-graded questions, in order."""
    answers, inside, current = [], False, []
    for c in nb.get("cells", []):
        src = _source(c)
        if c.get("cell_type") == "markdown" and "<!-- BEGIN QUESTION -->" in src:
            inside, current = True, []
        if inside and "otter_answer_cell" in c.get("metadata", {}).get("tags", []):
            current.append(src.strip())
        if c.get("cell_type") == "markdown" and "<!-- END QUESTION -->" in src and inside:
            answers.append("\n\n".join(current) or "(no answer cell)")
            inside = False
    return answers


def _feedback(student: str, graded: list[tuple[str, list[dict], list[str]]]) -> str:
    lines = [f"# Feedback for {student}", ""]
    for book, rows, answers in graded:
        auto = [r for r in rows if r["points"] != ""]
        got, most = sum(float(r["points"] or 0) for r in auto), sum(float(r["max_points"]) for r in auto)
        lines += [f"## {book}", "", f"Autograded: **{got:g} / {most:g}** points.", "",
                  "| question | points | max | notes |", "|---|---|---|---|"]
        lines += [f"| {r['question']} | {r['points'] if r['points'] != '' else '(by hand)'} | "
                  f"{r['max_points']:g} | {str(r['error']).replace('|', '/')} |" for r in rows]
        manual = [r for r in rows if r["points"] == ""]
        if manual:
            lines += ["", "### Answers graded by hand", ""]
            for i, r in enumerate(manual):
                text = answers[i] if i < len(answers) else "(answer cell not found)"
                lines += [f"**{r['question']}** ({r['max_points']:g} points):", "", "> " +
                          text.replace("\n", "\n> "), ""]
        lines.append("")
    return "\n".join(lines)


def load_manifest(bundle_dir: Path) -> dict:
    path = Path(bundle_dir) / MANIFEST
    if not path.exists():
        raise LabError(f"No grading bundle in {bundle_dir} ({MANIFEST} missing): build it first with "
                       "`make student` (python -m lab_utils student).")
    return json.loads(path.read_text())


def grade(submissions_dir: str | Path, bundle_dir: str | Path = DIST_DIR / "grading",
          out_dir: str | Path = "grades", timeout_s: float = DEFAULT_TIMEOUT_S, jobs: int = 1) -> list[dict]:
    """Grade every submission in ``submissions_dir``; write ``gradebook.csv`` and ``feedback/``.

    Returns the gradebook rows. A submission that cannot be graded (not a notebook, unknown
    notebook, otter crashed, over the time limit) becomes rows whose ``error`` says why; the
    batch always goes on.
    """
    subs_root, bundle, out = Path(submissions_dir), Path(bundle_dir), Path(out_dir)
    if not subs_root.is_dir():
        raise LabError(f"{subs_root} is not a folder of submissions "
                       "(README: 'Instructor: exercises and grading').")
    manifest = load_manifest(bundle)
    (out / "feedback").mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rows: list[dict] = []
    per_student: dict[str, list] = {}
    subs = find_submissions(subs_root)
    if not subs:
        print(f"no submissions in {subs_root}")
    todo = []   # (submission, notebook, book, notes), graded by up to `jobs` otter runs at once
    for s in subs:
        nb, problem = (None, s.problem) if s.problem else _read_notebook(s.path)
        book, notes = (None, []) if nb is None else identify(nb, s.path, manifest)
        if nb is not None and book is None:
            problem, notes = notes[0], []
        if book is None:
            todo.append((s, None, None, [problem]))
        else:
            todo.append((s, nb, book, notes + static_checks(nb, manifest["notebooks"][book]["questions"])))

    def run(item):
        s, nb, book, _ = item
        if book is None:
            return None, "", 0.0
        return run_one(s.path, bundle / manifest["notebooks"][book]["autograder"], timeout_s)

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, int(jobs))) as pool:
        for (s, nb, book, notes), (res, fatal, seconds) in zip(todo, pool.map(run, todo)):
            graded = per_student.setdefault(s.student, [])
            if book is None:
                r = {"student": s.student, "notebook": s.path.name, "question": "", "points": 0,
                     "max_points": 0, "error": notes[0]}
                rows.append(r)
                graded.append((s.path.name, [r], []))
                print(f"{s.student:<20} {s.path.name:<24} not graded: {notes[0]}", flush=True)
                continue
            info = manifest["notebooks"][book]
            if res and res.get("catastrophic_error"):
                fatal = f"otter could not grade it: {res['catastrophic_error'][:300]}"
            qrows = _question_rows(s.student, book, info["questions"], res, fatal, notes)
            rows += qrows
            graded.append((book, qrows, _manual_answers(nb)))
            got = sum(float(r["points"] or 0) for r in qrows)
            status = "; ".join([fatal] + notes if fatal else notes) or "ok"
            print(f"{s.student:<20} {book:<24} {got:g}/{info['auto_points']:g} auto points "
                  f"(+{info['manual_points']:g} by hand) in {seconds:.1f} s: {status[:160]}", flush=True)
    with open(out / "gradebook.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=GRADEBOOK_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    for student, graded in per_student.items():
        (out / "feedback" / f"{student}.md").write_text(_feedback(student, graded))
    n = len(subs)
    total = time.perf_counter() - t_all
    print(f"graded {n} submission(s) of {len(per_student)} student(s) in {total:.1f} s "
          f"({total / max(n, 1):.1f} s per submission, {jobs} at a time): {out / 'gradebook.csv'}, "
          f"{out / 'feedback'}/")
    return rows


if __name__ == "__main__":  # the subprocess that grades one notebook (run_one)
    sys.exit(_worker(*sys.argv[1:4]))
