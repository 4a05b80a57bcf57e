"""Grading runs every submission in a sandbox (bubblewrap): hostile submissions end as rows.

One folder of notebook 04 submissions: an honest one, and one per attack, each placed in the
body of ``achieved_gb_per_s`` (the code grading runs): writing to HOME (its own, and the
instructor's real one), reading another student's submission, reading the bundle's answers,
opening a network connection, allocating past the memory limit, forking without end, writing a
huge file. "mallory" adds the issue's extra cell (write ~/.grading_was_here, list every other
submission), which grading never runs. Each attack ends as a row naming what stopped it; the
other questions of the same notebook and the other students are graded normally; no file appears
outside the grader's output folder; honest submissions score the same without the sandbox.
Skipped, with the reason, where bwrap cannot make a sandbox (CI installs it: .ci/run).
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from grading_submissions import (
    RIGHT,
    UTILIZATION,
    hostile,
    make,
    rel,
    shared_dist,
    solved,
    student_notebook,
    with_function,
    write,
)

from lab_utils.app.grading import sandbox

REPO = Path(__file__).resolve().parent.parent
WHY_NOT = sandbox.probe()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"no sandbox here: {WHY_NOT}")
BOOK = "04_allreduce_bandwidth"


def auto_points(book: str) -> float:
    """The autograded points of one notebook (its masters' questions)."""
    from lab_utils.app.grading import notebooks as nbs

    return sum(q.points for q in nbs.parse_master(REPO / "labs" / f"{book}.ipynb").questions if not q.manual)


STOPPED = {                       # student -> what the row must name
    "h_home": "a write or read outside its folder",
    "h_other": "a file outside its folder",
    "h_bundle": "a file outside its folder",
    "h_network": "the network (the sandbox has none)",
    "h_memory": "the memory limit",
    "h_forkbomb": "the process limit",
    "h_hugefile": "the file size limit",
}
FLOORED_RING = ("def ring_bytes_per_rank_per_epoch(size_bytes, world_size, dataset_size, per_device_batch):\n"
                "    return size_bytes * (dataset_size // world_size // per_device_batch)\n")
MALLORY_CELL = """import glob, os
open(os.path.expanduser('~/.grading_was_here'), 'w').write('x')
open('mallory_saw.txt', 'w').write(str(glob.glob({pattern!r})) + os.getcwd())
"""


def _snapshot(*roots: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for root in roots for p in root.rglob("*")}


def _rows(grades: Path) -> dict[tuple[str, str], dict]:
    with open(grades / "details.csv", newline="") as f:
        return {(r["student"], r["question"]): r for r in csv.DictReader(f)}


def _grade(subs: Path, dist: Path, grades: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "lab_utils", "grade", str(subs), "--bundle", str(dist / "grading"),
           "--out", str(grades), "--jobs", "2", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The bundle tests/test_grading.py built in this session, else notebooks 02-04 built here."""
    from lab_utils.app.grading import build

    out = shared_dist(tmp_path_factory)
    manifest = out / "grading" / "manifest.json"
    built = set(json.loads(manifest.read_text())["notebooks"]) if manifest.exists() else set()
    if not {"02_multi_gpu_scaling", "03_compute_vs_communication", BOOK} <= built:
        build.build(out, notebooks=["02", "03", "04"])
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_hostile_submissions_end_as_rows_and_touch_nothing(dist, tmp_path):
    home = Path.home()
    subs, grades = tmp_path / "handed_in", tmp_path / "grades"
    good = solved(student_notebook(dist, BOOK), BOOK)
    honest = write(subs / "honest" / f"{BOOK}.ipynb", good)
    write(subs / "honest02" / "02_multi_gpu_scaling.ipynb",
          solved(student_notebook(dist, "02_multi_gpu_scaling"), "02_multi_gpu_scaling"))
    for name, code in hostile(home, honest, dist / "grading" / f"{BOOK}.json").items():
        write(subs / name / f"{BOOK}.ipynb", with_function(good, "q04_utilization", code))
    write(subs / "mallory" / f"{BOOK}.ipynb",
          with_function(good, "q04_utilization", good_utilization(good),
                        extra_cell=MALLORY_CELL.format(pattern=str(subs / "*" / "*.ipynb"))))
    before = _snapshot(subs, dist)
    home_before = sorted(p.name for p in home.iterdir())

    r = _grade(subs, dist, grades)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(grades)
    for student, stop in STOPPED.items():
        row = rows[(student, "q04_utilization")]
        assert float(row["points"]) == 0 and row["sandbox"] == "bwrap", row
        assert f"stopped by {stop}" in row["message"], (student, row["message"])
        for q in ("q04_gradient_bytes", "q04_ring_bytes"):   # the rest of the notebook: graded normally
            other = rows[(student, q)]
            assert float(other["points"]) == float(other["max_points"]), other
    assert "stopped by the sandbox or a limit (7)" in r.stdout
    for student in ("honest", "mallory"):
        assert all(float(rows[(student, q)]["points"]) == float(rows[(student, q)]["max_points"])
                   for q in ("q04_gradient_bytes", "q04_ring_bytes", "q04_utilization")), student
    assert float(rows[("honest02", "q02_speedup")]["points"]) == 2
    # nothing was written outside the grader's output folder (the sandboxes' folders are gone)
    assert not (home / ".grading_was_here").exists() and sorted(p.name for p in home.iterdir()) == home_before
    assert _snapshot(subs, dist) == before
    assert not list(REPO.glob("mallory_saw.txt")) and not list(tmp_path.rglob("mallory_saw.txt"))
    assert not list(tmp_path.rglob("big.bin"))


def good_utilization(nb: dict) -> str:
    from lab_utils.app.grading import notebooks as nbs

    cell = next(c for c in nb["cells"] if (c["metadata"].get(nbs.METADATA_KEY) or {}).get("question")
                == "q04_utilization" and c["cell_type"] == "code")
    return nbs.source(cell)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_honest_submissions_score_the_same_without_the_sandbox(dist, tmp_path):
    subs = tmp_path / "handed_in"
    for book in (BOOK, "02_multi_gpu_scaling"):
        nb = student_notebook(dist, book)
        write(subs / "honest" / f"{book}.ipynb", solved(nb, book))
        write(subs / "blank" / f"{book}.ipynb", nb)
    write(subs / "partial" / f"{BOOK}.ipynb", with_function(solved(student_notebook(dist, BOOK), BOOK),
                                                            "q04_ring_bytes", FLOORED_RING))
    with_box = _grade(subs, dist, tmp_path / "with")
    without = _grade(subs, dist, tmp_path / "without", "--no-sandbox")
    assert with_box.returncode == 0 and without.returncode == 0, with_box.stdout + without.stdout
    a, b = _rows(tmp_path / "with"), _rows(tmp_path / "without")
    assert {k: r["points"] for k, r in a.items()} == {k: r["points"] for k, r in b.items()}
    assert {r["sandbox"] for r in a.values()} >= {"bwrap"} and {r["sandbox"] for r in b.values()} >= {"none"}
    assert float(a[("partial", "q04_ring_bytes")]["points"]) == 0
    print("with the sandbox:", with_box.stdout.split("summary:")[1].split("\n")[0])
    print("without:", without.stdout.split("summary:")[1].split("\n")[0])


def test_the_sandbox_binds_the_lab_package_not_the_checkout():
    binds = sandbox.library_paths()
    assert REPO / "lab_utils" in binds and REPO not in binds
    assert sandbox.exposed([REPO / "dist" / "grading", REPO / "grades"]) == []
    assert sandbox.exposed([REPO / "lab_utils" / "x"]) != []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_endless_loops_end_as_rows(dist, tmp_path):
    """A loop in a function stops at the case time limit (its other cases are not waited for); code
    that ignores that alarm is ended by the grader soon after (its question's process is killed, the
    notebook's other questions are graded); code slow in every case stops at the notebook's limit."""
    subs = tmp_path / "handed_in"
    good = solved(student_notebook(dist, BOOK), BOOK)
    write(subs / "honest" / f"{BOOK}.ipynb", good)
    write(subs / "loop" / f"{BOOK}.ipynb", with_function(good, "q04_utilization", (
        UTILIZATION + "    while True:\n        pass\n")))
    write(subs / "stubborn" / f"{BOOK}.ipynb", with_function(good, "q04_gradient_bytes", (
        "import signal\n\n\ndef grad_bytes(model):\n"
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n")))
    write(subs / "slow" / f"{BOOK}.ipynb", with_function(good, "q04_utilization", (
        "import time\n\n\n" + UTILIZATION + "    time.sleep(4)\n" + RIGHT)))
    # The notebook's limit leaves room for an honest run on a loaded machine (11 s of 15 at load 7 on 2
    # cores once, which made the loop's row a notebook stop): 5 + 11 < 30 < 8 cases x 4 s of the slow one.
    r = _grade(subs, dist, tmp_path / "grades", "--case-timeout", "5", "--timeout", "30")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(tmp_path / "grades")
    loop = rows[("loop", "q04_utilization")]["message"]
    assert re.search(r"was stopped by the case time limit \(5 s\) \(line [23] of the function\) "
                     r"\(\d+ of \d+ cases wrong\)\.$", loop), loop    # no empty detail (": ;")
    assert float(rows[("loop", "q04_ring_bytes")]["points"]) == 2
    stubborn = rows[("stubborn", "q04_gradient_bytes")]
    assert float(stubborn["points"]) == 0 and "stopped by" not in stubborn["message"]
    assert "gave no answer: its code ran past the case time limit (5 s) and ignored the alarm; the grader " \
           "ended its process (" in stubborn["message"], stubborn["message"]
    assert float(rows[("stubborn", "q04_ring_bytes")]["points"]) == 2     # the next question runs
    assert float(rows[("stubborn", "q04_utilization")]["points"]) == 1
    slow = rows[("slow", "q04_utilization")]
    assert float(slow["points"]) == 0 and "the time limit (30 s for the notebook)" in slow["message"], slow
    assert ".;" not in slow["message"] and ": ;" not in slow["message"]
    assert all(float(rows[("honest", q)]["points"]) == float(rows[("honest", q)]["max_points"])
               for q in ("q04_gradient_bytes", "q04_ring_bytes", "q04_utilization"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_class_through_make_grade(dist, tmp_path):
    """Issue 35's trial, scaled down (tests/grading_class.py: LMS exports, zips, broken files, hostile
    and missing students), graded with `make grade SUBMISSIONS=... GRADE_ARGS="--roster ..."` from the
    repository root. Each defect the trial found is asserted on the gradebook it writes."""
    from grading_class import MISSING, make_class

    cls = make_class(dist, tmp_path / "handed_in", correct=1,
                     correct_books=("02_multi_gpu_scaling", "03_compute_vs_communication"))
    grades = tmp_path / "grades"
    home = Path.home()
    home_before = sorted(p.name for p in home.iterdir())
    r = make("grade", f"SUBMISSIONS={rel(cls.root)}", f"DIST={rel(dist)}", f"GRADES={rel(grades)}",
             f"GRADE_ARGS=--roster {rel(cls.roster)} --case-timeout 3", timeout=500)
    print(r.stdout, r.stderr)
    assert r.returncode != 0 and "exit status 1: 7 submission(s) could not be graded" in r.stdout, r.stdout
    rows = _rows(grades)
    with open(grades / "gradebook.csv", newline="") as f:
        book = {row["student"]: row for row in csv.DictReader(f)}
    notes = {name: row["notes"] for name, row in book.items()}
    # every student on the roster has one row, and no one else: no fake student named after a zip
    assert set(book) == set(cls.students) | {n for n, _ in MISSING}, sorted(book)
    assert f"no submission ({len(MISSING)}): Nobody, Ned; Absent, Abe" in r.stdout

    # one question's code cannot rewire another's check: Mallet's `return 0` scores nothing, flagged
    ring, grad = rows[("Mallet, Max", "q04_ring_bytes")], rows[("Mallet, Max", "q04_gradient_bytes")]
    assert float(ring["points"]) == 0 and "yours 0" in ring["message"], ring
    assert "the notebook reaches sys through torch.sys (code cell" in ring["flag"], ring
    assert float(grad["points"]) == 0 and "the exercise code reaches sys through torch.sys" in grad["flag"]
    assert "Mallet, Max 04_allreduce_bandwidth q04_gradient_bytes, q04_ring_bytes, q04_utilization, " \
           "q04_predicted_bandwidth: the notebook reaches sys through torch.sys" in r.stdout

    # a PDF in the Canvas bulk zip is filed under its student (and is no notebook to grade)
    assert "handed in, not notebooks (not graded): submissions.zip!doejane_1001_5004_report.pdf" in \
        notes["Doe, Jane"]
    assert "no notebook handed in, only hank.pdf" in notes["hank"] and float(book["hank"]["total"]) == 0

    # unreadable notebooks say why, filed under the notebook their name names; no "no submission" for them
    bea = notes["Broken, Bea"]
    built = json.loads((dist / "grading" / "manifest.json").read_text())["notebooks"]
    for nn, why in (("02", "the notebook is cut off (it ends after"), ("03", "the file is empty (0 bytes)"),
                    ("04", "not a notebook: a web page (HTML) saved as .ipynb"),
                    ("05", "too large for a notebook (220 MB; the limit is 50 MB)")):
        said = rf"Broken, Bea/{nn}_\w+\.ipynb\)?: could not be read: {re.escape(why)}"
        assert re.search(said, bea), (nn, bea)
        if any(b.startswith(nn) for b in built):    # filed under its notebook (05: when the bundle has it)
            assert f"{nn} (Broken, Bea/{nn}_" in bea, (nn, bea)
    assert "scratch.ipynb: could not be read: not a notebook: not JSON" in bea
    assert "no submission" not in bea, bea        # what it handed in is there, each with why
    assert rows[("Broken, Bea", "q04_ring_bytes")]["message"].startswith(
        "not graded: could not be read: not a notebook: a web page (HTML)")

    # another course's notebook named like lab 04 is not graded as lab 04
    otto = notes["Other, Otto"]
    assert "04_linear_regression.ipynb: not this lab's notebook: no dl_perf_lab stamp" in otto, otto
    assert "a file name is not enough" in otto and "no function" not in (grades / "details.csv").read_text()
    assert rows[("Other, Otto", "q04_ring_bytes")]["message"] == "no submission"
    assert "02: no dl_perf_lab stamp in its metadata (not saved from the student copy's notebook?): " \
           "recognised as 02_multi_gpu_scaling by its title, check by hand" in otto
    assert float(rows[("Other, Otto", "q02_speedup")]["points"]) == 2

    # older resubmissions, what the sandbox stopped, what the code asked for: in the row
    assert "02: also handed in, not graded (the latest readable file wins): submissions.zip!doejane_1001_" \
           "5001_02_multi_gpu_scaling.ipynb, submissions.zip!doejane_1001_5006_02_multi_gpu_scaling-2." \
           "ipynb (could not be read: the notebook is cut off" in notes["Doe, Jane"], notes["Doe, Jane"]
    assert rows[("Doe, Jane", "q02_speedup")]["file"] == \
        "submissions.zip!doejane_1001_5002_02_multi_gpu_scaling-1.ipynb"
    assert float(book["Doe, Jane"]["total"]) == auto_points("02_multi_gpu_scaling")
    assert "04: stopped by the sandbox or a limit: a write or read outside its folder" in notes["Writer, Wes"]
    assert "02: stopped by the sandbox or a limit: the case time limit (3 s)" in notes["Looper, Lou"]
    peeks = notes["Peeker, Pat"]       # every attempt is listed: the classmate's notebook was the ninth
    assert peeks.count("open /") == 9 and f"open {cls.classmate_file} (read)" in peeks, peeks

    # messages: one sentence each, no doubled punctuation, no empty detail
    text = (grades / "details.csv").read_text() + (grades / "gradebook.csv").read_text()
    assert ".;" not in text and ": ;" not in text and ":;" not in text and ";;" not in text
    assert re.search(r"speedup_and_efficiency\(41\.3, 23\.15, 2\) was stopped by the case time limit \(3 s\) "
                     r"\(line [23] of the function\) \(\d+ of \d+ cases wrong\)\.",
                     rows[("Looper, Lou", "q02_speedup")]["message"])
    assert "ignored the alarm" in rows[("Stubborn, Stu", "q03_compute_comm")]["message"]
    killed = rows[("Killer, Kim", "q04_ring_bytes")]["message"]
    assert "was not run: the submission's code ended the grading process (exit status" in killed, killed

    # each mistake loses exactly its points; correct work and 00/08 as expected
    assert float(book["Smith, Bob"]["total"]) == auto_points(BOOK) - 2 and "the log2 tree formula" in \
        rows[("Smith, Bob", "q04_ring_bytes")]["message"]
    assert [float(book[s]["total"]) for s in cls.correct] == \
        [auto_points("02_multi_gpu_scaling") + auto_points("03_compute_vs_communication")]
    assert float(book["Ann Lee"]["total"]) == auto_points("03_compute_vs_communication")
    assert "00, 08: nothing to grade (no exercise)" in notes["Ann Lee"]
    # where the numbers came from (handin.json, else the notebooks' stamps): columns, flags, feedback
    header = list(next(iter(book.values())))
    assert header[-6:] == ["profile", "device", "data", "lab version", "flags", "notes"], header
    mallet, good = book["Mallet, Max"], book[cls.correct[0]]
    assert (mallet["profile"], mallet["device"]) == ("quick", "cpu (AMD EPYC) x 1")
    for flag in ("quick profile", "synthetic data", "CPU (no GPU)"):
        assert flag in mallet["flags"], mallet["flags"]
        assert f"- flagged: {flag}" in (grades / "feedback" / "Mallet_Max.md").read_text()
    assert (good["profile"], good["device"], good["data"], good["lab version"]) == \
        ("full", "NVIDIA A100-SXM4-40GB x 4", "CIFAR-10", "0.1.0")
    assert good["flags"] == "", good["flags"]        # a full GPU run on real data: no flag at all
    assert book["Doe, Jane"]["device"] == "NVIDIA A100-SXM4-40GB x 4"     # from the Canvas zip
    assert "no handin.json" in book["Smith, Bob"]["flags"] and book["Smith, Bob"]["profile"] == ""
    assert "other lab version (03: 0ld (bundle: " in book["Ann Lee"]["flags"], book["Ann Lee"]["flags"]
    # class_results: 7 hand-ins x (3 speedups + 2 GB/s); Killer's numbers, half the A100 group's, are named
    with open(grades / "class_results.csv", newline="") as f:
        results = list(csv.DictReader(f))
    assert len(results) == 35 and {r["student"] for r in results} == {
        "Mallet, Max", "Peeker, Pat", "Writer, Wes", "Killer, Kim", "Doe, Jane", "Ann Lee", cls.correct[0]}
    flagged = {(r["student"], r["quantity"]) for r in results if r["outlier"] == "yes"}
    assert flagged == {("Killer, Kim", "speedup"), ("Killer, Kim", "gb_per_s")}, flagged
    small = {r["outlier"] for r in results if r["student"] in ("Ann Lee", "Mallet, Max")}
    assert small == {"too few to judge"}
    assert "outlier: Killer, Kim: speedup 0.925 for DDP (nccl), 2 GPU(s) x 128 on NVIDIA A100-SXM4-40GB " \
           "(group median 1.85" in r.stdout, r.stdout
    assert (grades / "class_results.png").stat().st_size > 10_000

    # nothing was written outside the sandbox
    assert not (home / ".grading_was_here").exists() and sorted(p.name for p in home.iterdir()) == home_before
