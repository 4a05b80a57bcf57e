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
import subprocess
import sys
from pathlib import Path

import pytest
from grading_submissions import (
    UTILIZATION,
    hostile,
    shared_dist,
    solved,
    student_notebook,
    with_function,
    write,
)

from lab_utils.grading import sandbox

REPO = Path(__file__).resolve().parent.parent
WHY_NOT = sandbox.probe()
pytestmark = pytest.mark.skipif(bool(WHY_NOT), reason=f"no sandbox here: {WHY_NOT}")
BOOK = "04_allreduce_bandwidth"
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
    """The bundle tests/test_grading.py built in this session, else notebooks 02 and 04 built here."""
    from lab_utils.grading import build

    out = shared_dist(tmp_path_factory)
    manifest = out / "grading" / "manifest.json"
    built = set(json.loads(manifest.read_text())["notebooks"]) if manifest.exists() else set()
    if not {"02_multi_gpu_scaling", BOOK} <= built:
        build.build(out, notebooks=["02", "04"])
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
    from lab_utils.grading import notebooks as nbs

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
    that ignores that alarm stops at the notebook's time limit; the others are graded normally."""
    subs = tmp_path / "handed_in"
    good = solved(student_notebook(dist, BOOK), BOOK)
    write(subs / "honest" / f"{BOOK}.ipynb", good)
    write(subs / "loop" / f"{BOOK}.ipynb", with_function(good, "q04_utilization", (
        UTILIZATION + "    while True:\n        pass\n")))
    write(subs / "stubborn" / f"{BOOK}.ipynb", with_function(good, "q04_utilization", (
        "import signal\n\n\n" + UTILIZATION +
        "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n")))
    r = _grade(subs, dist, tmp_path / "grades", "--case-timeout", "5", "--timeout", "15")
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _rows(tmp_path / "grades")
    assert "stopped by the case time limit (5 s)" in rows[("loop", "q04_utilization")]["message"]
    assert float(rows[("loop", "q04_ring_bytes")]["points"]) == 2
    stubborn = rows[("stubborn", "q04_utilization")]
    assert float(stubborn["points"]) == 0 and "time limit (15 s for the notebook)" in stubborn["message"]
    assert all(float(rows[("honest", q)]["points"]) == float(rows[("honest", q)]["max_points"])
               for q in ("q04_gradient_bytes", "q04_ring_bytes", "q04_utilization"))

