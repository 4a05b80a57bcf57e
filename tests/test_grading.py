"""The student edition and headless grading (lab_utils.grading, otter-grader).

Builds the student edition of notebooks 01 and 02 once (about 10 s), then grades one folder of
submissions made from it: solved, empty, hard-coded public answers, and broken ones (syntax
error, endless loop, deleted check cells, another lab version, not a notebook). Each
``otter run`` is a subprocess with a time limit; the grading test takes about two minutes on
2 cores.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils import grading

REPO = Path(__file__).resolve().parent.parent
BOOKS = ["01_batch_size_sweep", "02_multi_gpu_scaling"]
LOOP_TIMEOUT_S = 40


def _src(cell) -> str:
    s = cell["source"]
    return "".join(s) if isinstance(s, list) else s


def _answer_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"
            and "otter_answer_cell" in c.get("metadata", {}).get("tags", [])]


def _master_function(book: str, name: str) -> str:
    nb = json.loads((REPO / "labs" / f"{book}.ipynb").read_text())
    for c in nb["cells"]:
        if c["cell_type"] == "code" and f"def {name}(" in _src(c):
            return _src(c)
    raise AssertionError(f"no def {name} in {book}")


def solve(student_nb: dict, book: str) -> dict:
    """The student notebook with every answer cell replaced by the master's solution cell."""
    nb = json.loads(json.dumps(student_nb))
    for c in _answer_cells(nb):
        name = re.search(r"def (\w+)\(", _src(c)).group(1)
        c["source"] = _master_function(book, name)
    for c in nb["cells"]:
        if c["cell_type"] == "markdown" and "otter_answer_cell" in c.get("metadata", {}).get("tags", []):
            c["source"] = "Weak scaling per step, strong per epoch; my numbers: ..."
    return nb


def hard_code(student_nb: dict, book: str) -> dict:
    """Answers that return the public tests' expected values and nothing else."""
    from lab_utils.experiments import scaling

    nb = json.loads(json.dumps(student_nb))
    (cell,) = _answer_cells(nb)
    if book.startswith("01"):
        cell["source"] = "def time_step(step, sync, clock=None):\n    step()\n    return 2.0 + 1e-4\n"
    else:
        table = {}
        for (n, b), t in scaling.ANCHOR_COHORT_SECONDS.items():
            t1 = scaling.ANCHOR_COHORT_SECONDS[(1, b)]
            table[(t1, t, n)] = (t1 / t, t1 / t / n)
        cell["source"] = (f"PUBLIC = {table!r}\n\n\ndef speedup_and_efficiency(t1_seconds, tn_seconds, "
                          "n_devices):\n    return PUBLIC.get((t1_seconds, tn_seconds, n_devices), "
                          "(1.0, 1.0))\n")
    return nb


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    manifest = grading.build(out, notebooks=BOOKS, timeout_s=240)
    return out, manifest


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_student_edition_has_no_solutions(bundle):
    out, manifest = bundle
    assert sorted(manifest["notebooks"]) == BOOKS
    for book in BOOKS:
        text = (out / "student" / f"{book}.ipynb").read_text()
        nb = json.loads(text)
        parts = grading.parse_master(REPO / "labs" / f"{book}.ipynb")
        assert parts.secret_lines, "the master should have solution lines to check against"
        assert grading.find_leaks(text, parts) == []
        for marker in ("BEGIN SOLUTION", "END SOLUTION", "HIDDEN", "ASSIGNMENT CONFIG", "BEGIN QUESTION\n"):
            assert marker not in text, marker
        # the function bodies are '...' and return None; outputs are cleared
        for c in _answer_cells(nb):
            body = _src(c).split('"""')[-1]
            assert body.strip() == "...", body
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
        # public tests in the metadata (for grader.check); no hidden test anywhere but the zip
        tests = nb["metadata"]["otter"]["tests"]
        assert all(not case["hidden"] for t in tests.values() for s in t["suites"] for case in s["cases"])
        assert nb["metadata"][grading.METADATA_KEY] == {"notebook": book,
                                                        "version": grading.notebook_version(
                                                            REPO / "labs" / f"{book}.ipynb")}
        # the grading bundle holds the hidden tests
        import zipfile

        with zipfile.ZipFile(out / "grading" / manifest["notebooks"][book]["autograder"]) as z:
            tests_text = "".join(z.read(n).decode() for n in z.namelist() if n.startswith("tests/"))
        assert "'hidden': True" in tests_text and {"01": "12.5", "02": "2233.5"}[book[:2]] in tests_text


def test_leak_check_catches_an_unstripped_solution(tmp_path):
    """A solution outside a raw SOLUTION block stays in otter's output: the build must refuse it."""
    master = json.loads((REPO / "labs" / "01_batch_size_sweep.ipynb").read_text())
    parts = grading.parse_master(REPO / "labs" / "01_batch_size_sweep.ipynb")
    text = json.dumps(master)
    leaks = grading.find_leaks(text, parts)
    assert "# BEGIN SOLUTION" in leaks and any("start = clock()" in s for s in leaks)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_student_notebook_01_runs_with_blanks(bundle, tmp_path):
    """The blank student notebook runs top to bottom (quick profile); its check says 'not done yet'."""
    import nbformat
    from nbclient import NotebookClient

    out, _ = bundle
    work = tmp_path / "student"
    work.mkdir()
    path = work / "01_batch_size_sweep.ipynb"
    path.write_text((out / "student" / path.name).read_text())
    nb = nbformat.read(path, as_version=4)
    env_before = dict(os.environ)
    os.environ.update({"LAB_PROFILE": "quick", "LAB_RESULTS_DIR": str(tmp_path / "results"),
                       "MPLBACKEND": "Agg"})
    try:
        NotebookClient(nb, timeout=150, kernel_name="python3",
                       resources={"metadata": {"path": str(work)}}).execute()
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    checks = [c for c in nb.cells if c.cell_type == "code" and 'grader.check("q01_step_timer")' in c.source]
    assert checks, "the check cell is in the student notebook"
    shown = json.dumps(checks[0].outputs)
    assert "not done yet" in shown, shown[:2000]


def _write(path: Path, nb: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb, indent=1))


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_grade_a_folder_of_submissions(bundle, tmp_path):
    out, manifest = bundle
    student = {b: json.loads((out / "student" / f"{b}.ipynb").read_text()) for b in BOOKS}
    subs = tmp_path / "submissions"
    for b in BOOKS:
        _write(subs / "alice_solved" / f"{b}.ipynb", solve(student[b], b))
        _write(subs / "carol_hardcoded" / f"{b}.ipynb", hard_code(student[b], b))
    _write(subs / "bob_empty.ipynb", student[BOOKS[0]])  # flat layout: student = file stem
    broken = solve(student[BOOKS[0]], BOOKS[0])
    syntax = json.loads(json.dumps(broken))
    _answer_cells(syntax)[0]["source"] = "def time_step(step, sync, clock=None)\n    return 1.0\n"
    _write(subs / "dave_syntax" / f"{BOOKS[0]}.ipynb", syntax)
    loop = json.loads(json.dumps(broken))
    _answer_cells(loop)[0]["source"] = "while True:\n    pass\n"
    _write(subs / "erin_loop" / f"{BOOKS[0]}.ipynb", loop)
    nocheck = json.loads(json.dumps(broken))
    nocheck["cells"] = [c for c in nocheck["cells"] if "grader.check(" not in _src(c)]
    _write(subs / "frank_nocheck" / f"{BOOKS[0]}.ipynb", nocheck)
    old = json.loads(json.dumps(broken))
    old["metadata"][grading.METADATA_KEY]["version"] = "0123456789ab"
    _write(subs / "gina_oldversion" / f"{BOOKS[0]}.ipynb", old)
    (subs / "hank.pdf").write_bytes(b"%PDF-1.4 not a notebook")

    gb = tmp_path / "grades"
    cmd = [sys.executable, "-m", "lab_utils", "grade", str(subs), "--bundle", str(out / "grading"),
           "--out", str(gb), "--timeout", str(LOOP_TIMEOUT_S), "--jobs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    print(proc.stdout)
    with open(gb / "gradebook.csv") as f:
        rows = list(csv.DictReader(f))
    assert list(rows[0]) == list(grading.GRADEBOOK_COLUMNS)
    by = {}
    for row in rows:
        by.setdefault(row["student"], []).append(row)

    def auto(student):
        return [r for r in by[student] if r["points"] != ""]

    # solved: full marks, no error; hand-graded questions listed without points
    assert {r["question"] for r in by["alice_solved"]} == {"q01_step_timer", "q01_report", "q02_speedup",
                                                           "q02_report"}
    for r in auto("alice_solved"):
        assert float(r["points"]) == float(r["max_points"]) > 0 and r["error"] == "", r
    assert all("graded by hand" in r["error"] for r in by["alice_solved"] if r["points"] == "")
    fb = (gb / "feedback" / "alice_solved.md").read_text()
    assert "Weak scaling per step" in fb and "02_multi_gpu_scaling" in fb
    # empty: zero, says not done yet
    (row,) = auto("bob_empty")
    assert float(row["points"]) == 0 and "not done yet" in row["error"], row
    # hard-coded public answers: public tests pass, hidden ones fail
    for r in auto("carol_hardcoded"):
        assert float(r["points"]) == 0 and "hidden test(s) failed" in r["error"], r
        assert "public tests failed" not in r["error"], r
    # broken ones: each row says why
    (row,) = auto("dave_syntax")
    assert float(row["points"]) == 0 and "syntax error" in row["error"], row
    (row,) = auto("erin_loop")
    assert float(row["points"]) == 0 and "time limit" in row["error"], row
    (row,) = auto("frank_nocheck")
    assert float(row["points"]) == float(row["max_points"]) and "check cell" in row["error"], row
    (row,) = auto("gina_oldversion")
    assert "another lab version" in row["error"], row
    (row,) = by["hank"]
    assert "not a notebook" in row["error"], row
    assert "graded 10 submission(s) of 8 student(s)" in proc.stdout, proc.stdout


@pytest.mark.timeout(60)
def test_grade_help_and_missing_bundle(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lab_utils", "grade", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "gradebook.csv" in r.stdout and "make student" in r.stdout
    r = subprocess.run([sys.executable, "-m", "lab_utils", "grade", str(tmp_path), "--bundle",
                        str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "make student" in r.stderr
