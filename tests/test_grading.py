"""The student copy, the grading bundle and grading, through the documented commands.

``make student`` builds the student copy and the bundle once (every graded notebook, 01-07 and 09; about
a minute on 2 cores); then, from the repository root with relative paths, ``make grade
SUBMISSIONS=...`` grades the folders the issue names: every exercise solved (41 of 41 points on 23
questions), the same notebooks blank (0, "not done yet", or a find-the-bug exercise's bug by name), and
cheats and known mistakes (the lab's own function called, ``math.isclose`` replaced: 0 or flagged, and the
summary says so; the log2 tree, Normalize before ToTensor, the mean over ranks: 0, the mistake named).
Every test case of every bundle also runs the way otter runs it, as a doctest. The class gradebook (LMS
file names, zips, duplicates, a roster, ``--student``, folding points given by hand) is checked on
notebooks 02-03.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from grading_submissions import (
    BOOKS,
    RIGHT,
    UTILIZATION,
    make,
    rel,
    shared_dist,
    solved,
    student_notebook,
    with_function,
    write,
)

from lab_utils.app import questions
from lab_utils.app.grading import EXERCISES, build, exercise_code, giveaways, programs, reaching, sandbox
from lab_utils.app.grading import notebooks as nbs

REPO = Path(__file__).resolve().parent.parent
SANDBOX_ARGS = [] if not sandbox.probe() else ["--no-sandbox"]   # the bookkeeping tests run either way
# The autograded points of the masters (35 on 20 exercises with 01-c, 04-d, 05-b and 06-d).
AUTO_POINTS = sum(q.points for b in BOOKS for q in nbs.parse_master(REPO / "labs" / f"{b}.ipynb").questions
                  if not q.manual)


def blank_says(name: str, message: str) -> bool:
    """What an untouched exercise says: "not done yet" (`make grade`: also a find-the-bug exercise's function
    as handed out), or in its check the name of a find-the-bug exercise's bug, a known mistake."""
    ex = EXERCISES[name]
    named = ex.find_the_bug and any(f"{m.name}: {m.why}" in message for m in ex.mistakes)
    return "not done yet" in message or named


def read_csv(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = shared_dist(tmp_path_factory)
    r = make("student", f"DIST={rel(out)}", timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("built ") == len(BOOKS), r.stdout
    return out


# --------------------------------------------------------------------------- the student copy


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.timeout(900)
def test_student_copy_carries_the_handin_and_every_file_its_notebooks_name(dist):
    """Issue 35: the student copy's README has the question map and how to hand in (`make report`); no
    sentence of a student notebook points at a file of the lab the copy does not hold, or at a README
    section its README lacks. Issue 50: the copy carries the pages its README and notebooks name
    (docs/generated/, written fresh by the build, and docs/cluster.md), and no instructor's page."""
    from lab_utils.app import docs, handin

    student = dist / "student"
    readme = (student / "README.md").read_text()
    assert handin.HOWTO.strip() in readme and questions.question_map_markdown() in readme
    assert {p.name: p.read_text() for p in (student / "docs" / "generated").glob("*.md")} == docs.pages()
    assert (student / "docs" / "cluster.md").read_text() == (REPO / "docs" / "cluster.md").read_text()
    assert sorted(p.name for p in (student / "docs").glob("*.md")) == ["cluster.md"]
    for name in re.findall(r"`(docs/[\w/.-]+)`", readme):
        assert (student / name).is_file(), f"the student README names {name}, which the copy lacks"
    assert "report:" in (student / "Makefile").read_text()  # make report works there
    headings = set(re.findall(r"^#+ (.+)$", readme, re.M))
    for nb_path in sorted((student / "labs").glob("*.ipynb")):
        nb = json.loads(nb_path.read_text())
        text = "\n".join(nbs.source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
        for path in re.findall(r"`([\w.-]+/[\w./-]*|[\w-]+\.(?:md|py|toml|txt|sbatch))`", text):
            if (REPO / path.split("/")[0]).exists():  # a file of the lab, not a result or another project's
                assert (student / path).exists(), f"{nb_path.name} names {path}, which the student copy lacks"
        for section in re.findall(r"README(?:'s|,)\s+\(?\"([^\"]+)\"", text):
            assert " ".join(section.split()) in headings, f"{nb_path.name} names README section {section!r}"


def test_student_copy_holds_no_solution_and_no_hidden_test(dist):
    student = dist / "student"
    masters = [nbs.parse_master(REPO / "labs" / f"{b}.ipynb") for b in BOOKS]
    assert build.tree_leaks(student, masters) == []
    assert not (student / "tests").exists() and not (student / "grading").exists()
    assert sorted(p.name for p in (student / "labs").glob("*.ipynb")) == \
        sorted(p.name for p in (REPO / "labs").glob("[0-9][0-9]_*.ipynb"))
    for f in ("Makefile", "requirements.txt", "constraints.txt", "pyproject.toml", "lab_utils/__init__.py",
              "lab_utils/app/grading/exercises/__init__.py", "README.md"):
        assert (student / f).is_file(), f
    assert "make venv" in (student / "README.md").read_text()
    for book, master in zip(BOOKS, masters):
        nb = student_notebook(dist, book)
        assert not any(nbs.raw_mark(c) for c in nb["cells"])
        version = nbs.notebook_version(REPO / "labs" / f"{book}.ipynb")
        assert nb["metadata"][nbs.METADATA_KEY] == {"notebook": book, "version": version}
        assert all(not c.get("outputs") for c in nb["cells"] if c["cell_type"] == "code")
        tagged = {(c["metadata"].get(nbs.METADATA_KEY) or {}).get("question") for c in nb["cells"]
                  if nbs.ANSWER_TAG in c["metadata"].get("tags", [])}
        assert tagged == {q.name for q in master.questions}, tagged
        for c in nb["cells"]:
            question = (c["metadata"].get(nbs.METADATA_KEY) or {}).get("question")
            if nbs.ANSWER_TAG in c["metadata"].get("tags", []) and c["cell_type"] == "code":
                # blank, or (find the bug) the earlier report's body: live code, no "..."
                blank = nbs.source(c).rstrip().endswith("...")
                assert blank != EXERCISES[question].find_the_bug, nbs.source(c)
        tests = nb["metadata"]["otter"]["tests"]
        assert all(not case["hidden"] for t in tests.values() for s in t["suites"] for case in s["cases"])
    bundle = json.loads((dist / "grading" / "manifest.json").read_text())
    auto = [q for b in bundle["notebooks"].values() for q in b["questions"] if not q["manual"]]
    assert sum(q["points"] for q in auto) == AUTO_POINTS == 41 and len(auto) == len(EXERCISES) == 23


# ------------------------------------------------------------------ the student copy makes students think


def _answer_question(cell: dict) -> str | None:
    """The question whose answer cell ``cell`` is, in a student notebook (None for other cells)."""
    if nbs.ANSWER_TAG not in cell.get("metadata", {}).get("tags", []):
        return None
    return (cell["metadata"].get(nbs.METADATA_KEY) or {}).get("question")


def _masters() -> dict[str, nbs.Master]:
    return {b: nbs.parse_master(REPO / "labs" / f"{b}.ipynb") for b in BOOKS}


def test_every_graded_question_lists_what_gives_it_away():
    """Each graded question names the claims that state its answer (beside its reference answer)."""
    found = giveaways.all_giveaways(_masters().values())
    missing = [q.name for m in _masters().values() for q in m.questions if not found.get(q.name)]
    assert missing == [], f"no give-aways listed for {missing}"


def test_no_graded_answer_is_given_away_before_its_answer_cell(dist):
    """No give-away phrase of a graded question stands in the student copy above its answer cell (in its
    notebook, markdown or code) or anywhere in an earlier notebook."""
    books = [(p.stem, giveaways.student_view(json.loads(p.read_text())["cells"], _answer_question))
             for p in sorted((dist / "student" / "labs").glob("[0-9][0-9]_*.ipynb"))]
    assert giveaways.find_giveaways(books, giveaways.all_giveaways(_masters().values())) == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_discussion_is_left_out_of_the_student_copy_and_published_by_make_discussion(dist, tmp_path):
    """`make student` leaves every cell the masters tag "discussion" out (one pointer line per run of
    them); `make discussion` builds the same copy with every one of them in, and leaves the bundle."""
    bundle = (dist / "grading" / "manifest.json").read_text()
    r = make("discussion", f"DIST={rel(dist)}", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "discussion copy:" in r.stdout and (dist / "grading" / "manifest.json").read_text() == bundle
    tagged_somewhere = 0
    for master in sorted((REPO / "labs").glob("[0-9][0-9]_*.ipynb")):
        cells = json.loads(master.read_text())["cells"]
        tagged = [nbs.source(c) for c in cells if giveaways.is_discussion(c)]
        runs = sum(1 for i, c in enumerate(cells)
                   if giveaways.is_discussion(c) and (i == 0 or not giveaways.is_discussion(cells[i - 1])))
        tagged_somewhere += len(tagged)
        student = [nbs.source(c) for c in student_notebook(dist, master.stem)["cells"]]
        published = [nbs.source(c) for c in
                     json.loads((dist / "discussion" / "labs" / master.name).read_text())["cells"]]
        assert [t for t in tagged if t in student] == [], master.name
        assert student.count(giveaways.DISCUSSION_POINTER) == runs, master.name
        assert [t for t in tagged if t not in published] == [], master.name
        assert giveaways.DISCUSSION_POINTER not in published, master.name
    assert tagged_somewhere > 0, "no master notebook tags a discussion cell"
    for f in ("README.md", "Makefile", "lab_utils/__init__.py", "tools/cuda_wheels.py"):
        assert (dist / "discussion" / f).is_file(), f


def test_no_show_source_above_an_exercise_shows_the_labs_own_answer(dist):
    """A show_source cell above an exercise's answer cell must not print the lab's implementation of the
    function that exercise asks for (the solution, one cell above the blank)."""
    shown_early = []
    for path in sorted((dist / "student" / "labs").glob("[0-9][0-9]_*.ipynb")):
        above = []
        for c in json.loads(path.read_text())["cells"]:
            q = _answer_question(c)
            if q in EXERCISES:
                names = {n.rsplit(".", 1)[-1] for n in EXERCISES[q].implemented_by}
                calls = [m for text in above for m in re.findall(r"show_source\(([^)]*)\)", text)]
                shown = {w for call in calls for w in re.findall(r"[A-Za-z_][\w.]*", call)}
                shown_early += [f"{path.stem}: {q} shows {n}" for n in names
                                if n in shown or any(w.endswith("." + n) for w in shown)]
            if c["cell_type"] == "code":
                above.append(nbs.source(c))
    assert shown_early == []


ALTERNATIVES = Path(__file__).resolve().parent / "alternatives"


def _alternative(question: str) -> str:
    path = ALTERNATIVES / f"{question}.py"
    assert path.is_file(), f"no alternative correct answer for {question}: write {rel(path)}"
    return path.read_text()


def test_every_exercise_has_an_alternative_correct_answer_written_otherwise():
    """tests/alternatives/<question>.py: another correct implementation, not the master's own text."""
    for master in _masters().values():
        for q in master.questions:
            if not q.manual:
                alt = _alternative(q.name)
                assert exercise_code.function_dump(_def(alt, EXERCISES[q.name].function)) != \
                    exercise_code.function_dump(_def(q.solution, EXERCISES[q.name].function)), q.name


def _def(source: str, name: str):
    import ast

    return next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == name)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_every_alternative_correct_answer_passes_its_check_and_earns_full_marks(dist, tmp_path):
    """Every correct answer earns its points, and the public check agrees: each exercise cell replaced by
    its alternative (tests/alternatives/), the check the student's check cell makes (the bundle's public
    cases and their expected answers, through exercises.verdict, the call in every check cell: how a
    check cell shows it in a kernel is test_a_failing_check_shows_its_sentence_first's) says ok, and
    `make grade` gives every autograded question its full points."""
    from lab_utils.app.grading.exercises import verdict

    folder = tmp_path / "alternatives"
    for book in BOOKS:
        nb = solved(student_notebook(dist, book), book)
        bundle = json.loads((dist / "grading" / f"{book}.json").read_text())["questions"]
        for q, spec in bundle.items():
            nb = with_function(nb, q, _alternative(q))
            ns: dict = {"__name__": f"alternative_{q}"}
            exec(compile(_alternative(q), f"<tests/alternatives/{q}.py>", "exec"), ns)
            for t in (t for t in spec["tests"] if not t["hidden"]):
                said = verdict(q, ns[spec["function"]], [c["case"] for c in t["cases"]],
                               [c["expected"] for c in t["cases"]])
                assert said == "", f"{q}'s public check says: {said}"
        write(folder / "zoe" / f"{book}.ipynb", nb)
    grades = tmp_path / "grades_alternatives"
    r = make("grade", f"SUBMISSIONS={rel(folder)}", f"DIST={rel(dist)}", f"GRADES={rel(grades)}",
             f"GRADE_ARGS={' '.join(SANDBOX_ARGS)}", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    details = _details(grades, "zoe")
    for q in AUTOGRADED:
        row = details[q]
        assert float(row["points"]) == float(row["max_points"]) and row["message"] == "", row


# --------------------------------------------------------------------------- Exercise 01-b

Q01 = "01_batch_size_sweep"


def _gradebook_rows(grades: Path) -> dict[tuple[str, str], dict]:
    with open(grades / "details.csv", newline="") as f:
        return {(r["student"], r["question"]): r for r in csv.DictReader(f)}


NORMALIZE = "T.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010))"
FLIP_FIRST = ("from torchvision import transforms as T\n\n\ndef cifar10_train_transform():\n"
              f"    return T.Compose([T.RandomHorizontalFlip(), T.RandomCrop(32, padding=4), T.ToTensor(),\n"
              f"                      {NORMALIZE}])\n")
NORMALIZE_BEFORE_CROP = ("from torchvision import transforms as T\n\n\ndef cifar10_train_transform():\n"
                         f"    return T.Compose([T.ToTensor(), {NORMALIZE},\n"
                         "                      T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()])\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_accepted_orders_and_alternatives_score_full_marks_through_make_grade(dist, tmp_path):
    """`make student`, then `make grade` on notebook 01 handed in four ways: the master's solutions; every
    exercise from tests/alternatives/ (01-b ToTensor first); 01-b with the flip before the crop; 01-b with
    Normalize before the crop. The first three earn all 6 autograded points with no message; the last 0 on
    01-b, named, and its other exercises their points."""
    nb = solved(student_notebook(dist, Q01), Q01)
    alt = nb
    for q in ("q01_step_timer", "q01_train_transform", "q01_peak_memory"):
        alt = with_function(alt, q, _alternative(q))
    subs = tmp_path / "subs"
    write(subs / "alice" / f"{Q01}.ipynb", nb)
    write(subs / "tom" / f"{Q01}.ipynb", alt)
    write(subs / "flo" / f"{Q01}.ipynb", with_function(nb, "q01_train_transform", FLIP_FIRST))
    write(subs / "nora" / f"{Q01}.ipynb", with_function(nb, "q01_train_transform", NORMALIZE_BEFORE_CROP))
    grades = tmp_path / "grades"
    r = make("grade", f"SUBMISSIONS={rel(subs)}", f"DIST={rel(dist)}", f"GRADES={rel(grades)}",
             f"GRADE_ARGS={' '.join(SANDBOX_ARGS)}", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = _gradebook_rows(grades)
    for student in ("alice", "tom", "flo"):
        for q in ("q01_step_timer", "q01_train_transform", "q01_peak_memory"):
            row = rows[(student, q)]
            assert float(row["points"]) == float(row["max_points"]) == 2 and row["message"] == "", row
    nora = rows[("nora", "q01_train_transform")]
    assert float(nora["points"]) == 0 and "Normalize before the crop" in nora["message"], nora
    assert float(rows[("nora", "q01_peak_memory")]["points"]) == 2


def _blank_namespace(nb: dict, name: str) -> dict:
    """The student's untouched answer cell of ``name``, run: the function returns None."""
    cell = next(c for c in nb["cells"] if c["cell_type"] == "code"
                and (c["metadata"].get(nbs.METADATA_KEY) or {}).get("question") == name)
    ns: dict = {}
    exec(nbs.source(cell), ns)
    return ns


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_case_of_every_bundle_runs_as_a_doctest(dist):
    """Otter runs test cells as doctests: with the master's solution every case passes (no stray
    output), with the blank student function each says "not done yet" (a find-the-bug exercise's starting
    function: its bug); the student notebook's
    checks are the bundle's public ones."""
    from otter.test_files import OKTestFile

    for book in BOOKS:
        master = nbs.parse_master(REPO / "labs" / f"{book}.ipynb")
        nb = student_notebook(dist, book)
        with zipfile.ZipFile(dist / "grading" / "otter" / f"{book}-autograder.zip") as z:
            for q in master.questions:
                if q.manual:
                    continue
                spec: dict = {}
                exec(z.read(f"tests/{q.name}.py").decode(), spec)
                test = OKTestFile.from_spec(spec["test"])
                assert [c.hidden for c in test.test_cases] == [t.hidden for t in q.tests]
                public = [c for c in spec["test"]["suites"][0]["cases"] if not c["hidden"]]
                in_notebook = nb["metadata"]["otter"]["tests"][q.name]["suites"][0]["cases"]
                assert [c["code"] for c in in_notebook] == [c["code"] for c in public]
                ns: dict = {}
                exec(q.solution, ns)
                test.run(ns)
                failed = [r.message for r in test.test_case_results if not r.passed]
                assert not failed, f"{book} {q.name}: {failed[0][-1500:]}"
                test.run(_blank_namespace(nb, q.name))
                for r in test.test_case_results:
                    assert not r.passed and blank_says(q.name, r.message), r.message[-800:]


# --------------------------------------------------------------------------- make grade, as documented


def _by_student(path: Path) -> dict[str, dict]:
    """gradebook.csv by student, each question's column also under its otter name (``q02_speedup``)."""
    rows = read_csv(path / "gradebook.csv")
    names = {questions.gradebook_column(q): q for q in [*EXERCISES, *BY_HAND]}
    return {r["student"]: {**r, **{names[k]: v for k, v in r.items() if k in names}} for r in rows}


def _details(path: Path, student: str) -> dict[str, dict]:
    return {r["question"]: r for r in read_csv(path / "details.csv") if r["student"] == student}


AUTOGRADED = sorted(q for q in EXERCISES)
BY_HAND = sorted(s.by_hand for s in questions.SECTIONS if s.by_hand)   # q01_report ... q05_messages ...
RING = "def ring_bytes_per_rank_per_epoch(size_bytes, world_size, dataset_size, per_device_batch):\n"
RING_LOG2 = ("import math\n\n\n" + RING
             + "    it = math.ceil(math.ceil(dataset_size / world_size) / per_device_batch)\n"
             + "    return it * size_bytes * math.log2(world_size)\n")
CALLS_THE_LAB = ("from lab_utils.experiments.n04_allreduce import experiment as comm\n\n\n" + RING
                 + "    return comm.ring_bytes_per_epoch(size_bytes, world_size, dataset_size,\n"
                 + "                                     per_device_batch)\n")
WRONG_GIB = UTILIZATION + RIGHT.replace("/ 1e9", "/ 2 ** 30")
MEAN_OF_RANKS = "def run_epoch_seconds(rank_seconds):\n    return sum(rank_seconds) / len(rank_seconds)\n"
# The earlier cohort's own mistakes (issue 32): its Table 3 divided ONE gradient per epoch by the epoch's
# communication time; its Table 2 printed T(N) as the compute time.
RING_ONE_PER_EPOCH = RING + "    return size_bytes\n"
GBPS_ONE_PER_EPOCH = UTILIZATION + "    return gradient_bytes / comm_seconds / 1e9\n"
COMPUTE_IS_TN = ("def compute_and_comm(t1_seconds, tn_seconds, devices):\n"
                 "    return tn_seconds, tn_seconds - t1_seconds / devices\n")
SUM_ONLY = ("import torch.distributed as dist\n\n\ndef average_gradients(grads):\n"
            "    for g in grads:\n        dist.all_reduce(g)\n    return grads\n")
NORMALIZE_FIRST = ("from torchvision import transforms as T\n\n\ndef cifar10_train_transform():\n"
                   "    return T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(),\n"
                   "                      T.Normalize((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),\n"
                   "                      T.ToTensor()])\n")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_make_grade_solved_blank_and_cheats(dist, tmp_path):
    """The issue's three folders, each through `make grade SUBMISSIONS=<folder>` from the repo root."""
    folders = {name: tmp_path / name for name in ("solved", "blank", "cheats")}
    for book in BOOKS:
        nb = student_notebook(dist, book)
        write(folders["solved"] / "alice" / f"{book}.ipynb", solved(nb, book))
        write(folders["blank"] / "bob" / f"{book}.ipynb", nb)
    for book in ("00_environment", "08_speed_limits"):   # all nine handed in: 00 and 08 hold no exercise
        write(folders["solved"] / "alice" / f"{book}.ipynb", student_notebook(dist, book))
    nb04 = solved(student_notebook(dist, "04_allreduce_bandwidth"), "04_allreduce_bandwidth")
    write(folders["cheats"] / "carol" / "04_allreduce_bandwidth.ipynb",
          with_function(nb04, "q04_ring_bytes", CALLS_THE_LAB))
    write(folders["cheats"] / "dave" / "04_allreduce_bandwidth.ipynb",
          with_function(nb04, "q04_utilization", WRONG_GIB, extra_cell="import math\n\nmath.isclose = "
                                                                       "lambda *a, **k: True\n"))
    write(folders["cheats"] / "erin" / "04_allreduce_bandwidth.ipynb",
          with_function(nb04, "q04_ring_bytes", RING_LOG2))
    nb01 = solved(student_notebook(dist, "01_batch_size_sweep"), "01_batch_size_sweep")   # known mistakes
    write(folders["cheats"] / "gina" / "01_batch_size_sweep.ipynb",
          with_function(nb01, "q01_train_transform", NORMALIZE_FIRST))
    nb06 = solved(student_notebook(dist, "06_gpt_ddp"), "06_gpt_ddp")
    write(folders["cheats"] / "hal" / "06_gpt_ddp.ipynb", with_function(nb06, "q06_rank_time", MEAN_OF_RANKS))
    write(folders["cheats"] / "kim" / "04_allreduce_bandwidth.ipynb",   # the earlier cohort's Table 3
          with_function(with_function(nb04, "q04_ring_bytes", RING_ONE_PER_EPOCH), "q04_utilization",
                        GBPS_ONE_PER_EPOCH))
    nb03 = solved(student_notebook(dist, "03_compute_vs_communication"), "03_compute_vs_communication")
    write(folders["cheats"] / "lee" / "03_compute_vs_communication.ipynb",   # its Table 2
          with_function(nb03, "q03_compute_comm", COMPUTE_IS_TN))
    nb09 = solved(student_notebook(dist, "09_build_ddp"), "09_build_ddp")   # run on 2 and 3 gloo ranks
    write(folders["cheats"] / "mia" / "09_build_ddp.ipynb", with_function(nb09, "q09_average", SUM_ONLY))
    runs = {}
    for name, folder in folders.items():
        grades = tmp_path / f"grades_{name}"
        r = make("grade", f"SUBMISSIONS={rel(folder)}", f"DIST={rel(dist)}", f"GRADES={rel(grades)}",
                 f"GRADE_ARGS={' '.join(SANDBOX_ARGS)}", timeout=600)
        print(r.stdout)
        assert r.returncode == 0, r.stdout + r.stderr
        runs[name] = (grades, r.stdout)

    grades, out = runs["solved"]
    alice = _by_student(grades)["alice"]
    assert float(alice["total"]) == AUTO_POINTS, alice
    details = _details(grades, "alice")
    for q in AUTOGRADED:
        row = details[q]
        assert float(row["points"]) == float(row["max_points"]) and row["message"] == "", row
        assert details[q]["flag"] == "" and details[q]["sandbox"] in ("bwrap", "none")
    assert "8 notebook(s) of 1 student(s) graded" in out and "could not be graded" not in out
    assert "nothing to grade, no exercise (2): alice 00_environment; alice 08_speed_limits" in out
    assert "00, 08: nothing to grade (no exercise)" in alice["notes"]
    header = list(read_csv(grades / "gradebook.csv")[0])      # issue 35: the assignment's questions
    assert header[2:7] == ["Q1 step timer (01-a)", "Q1 train transform (01-b)", "Q1 peak memory (01-c)",
                           "Q1 report (01, by hand)", "Q2 speedup (02-a)"], header
    assert "Q3.2 ring bytes (04-b)" in header and "Q5 set epoch (05-c)" in header
    assert {r["column"] for r in read_csv(grades / "details.csv") if r["question"] == "q04_ring_bytes"} == \
        {"Q3.2 ring bytes (04-b)"}
    feedback = (grades / "feedback" / "alice.md").read_text()
    assert "My answer to q04_report" in feedback
    assert f"{AUTO_POINTS:g} / {AUTO_POINTS + 22:g}" in feedback   # 11 hand-graded x 2 points
    # issue 35: Q6, hand-graded in notebook 05, reaches the gradebook, the feedback and the template
    assert "Q4.1 accuracy (05, by hand)" in header and "Q7 gradients only (05, by hand)" in header
    assert alice["Q6 messages (05, by hand)"] == "" and "no handin.json" in alice["flags"]
    q6 = details["q05_messages"]
    assert (q6["column"], q6["max_points"], q6["points"], q6["message"]) == \
        ("Q6 messages (05, by hand)", "2.0", "", "graded by hand")
    assert "**q05_messages** (not graded yet):\n\n> My answer to q05_messages: the table shows it." \
        in feedback
    template = read_csv(grades / "hand_points_template.csv")
    assert [r["question"] for r in template] == [q for q in details if q in BY_HAND] and len(template) == 11
    hand = tmp_path / "hand_q6.csv"
    hand.write_text("student,question,points,comment\nalice,q05_messages,2,names the buffer broadcast\n")
    r = make("fold", f"HAND={rel(hand)}", f"GRADES={rel(grades)}", timeout=120)
    assert r.returncode == 0 and "folded 1 point(s)" in r.stdout, r.stdout + r.stderr
    alice = _by_student(grades)["alice"]
    assert float(alice["Q6 messages (05, by hand)"]) == 2 and float(alice["total"]) == AUTO_POINTS + 2
    assert "Comment: names the buffer broadcast" in (grades / "feedback" / "alice.md").read_text()

    grades, out = runs["blank"]
    bob = _by_student(grades)["bob"]
    assert float(bob["total"]) == 0.0
    details = _details(grades, "bob")
    for q in AUTOGRADED:
        assert float(details[q]["points"]) == 0 and blank_says(q, details[q]["message"]), details[q]
    reports = [r for q, r in details.items() if q in BY_HAND]
    assert len(reports) == 11 and all(r["message"] == "no answer" and r["points"] == "" for r in reports)
    assert "> no answer" in (grades / "feedback" / "bob.md").read_text()

    grades, out = runs["cheats"]
    carol, dave, erin = (_details(grades, s) for s in ("carol", "dave", "erin"))
    assert float(carol["q04_ring_bytes"]["points"]) == 0
    assert "lab's own code" in carol["q04_ring_bytes"]["flag"]
    assert "the cases gave 2 / 2" in carol["q04_ring_bytes"]["flag"]
    assert float(carol["q04_gradient_bytes"]["points"]) == 1 and carol["q04_gradient_bytes"]["flag"] == ""
    assert float(dave["q04_utilization"]["points"]) == 0 and "math.isclose" in dave["q04_utilization"]["flag"]
    assert "GiB for GB" in dave["q04_utilization"]["message"]
    assert float(erin["q04_ring_bytes"]["points"]) == 0 and erin["q04_ring_bytes"]["flag"] == ""
    assert "(44695848, 4, 50000, 128)" in erin["q04_ring_bytes"]["message"]
    assert "the log2 tree formula" in erin["q04_ring_bytes"]["message"]
    flagged = re.search(r"flagged, check by hand \((\d+)\): (.*)", out)
    assert flagged and "carol" in flagged.group(2) and "dave" in flagged.group(2), out
    assert "math.isclose" in flagged.group(2)
    assert "erin" not in flagged.group(2)
    gina, hal = _details(grades, "gina"), _details(grades, "hal")
    assert float(gina["q01_train_transform"]["points"]) == 0 and float(gina["q01_step_timer"]["points"]) == 2
    assert "Normalize before ToTensor" in gina["q01_train_transform"]["message"]
    assert float(hal["q06_rank_time"]["points"]) == 0 and float(hal["q06_mfu"]["points"]) == 1
    assert "[1384.64, 806.75]" in hal["q06_rank_time"]["message"]
    assert "averaging ranks" in hal["q06_rank_time"]["message"] and "gina" not in flagged.group(2)
    kim, lee = _details(grades, "kim"), _details(grades, "lee")
    for q in ("q04_ring_bytes", "q04_utilization"):   # one gradient per epoch: named, 0 points, not flagged
        assert float(kim[q]["points"]) == 0 and kim[q]["flag"] == "", kim[q]
        assert "one all-reduce per epoch" in kim[q]["message"] and "250.1 MB/s" in kim[q]["message"], kim[q]
    assert "(44695848, 2, 50000, 128)" in kim["q04_ring_bytes"]["message"]
    assert kim["q04_utilization"]["message"].startswith("achieved_gb_per_s(44695848, 2, 196, 1.05) gives")
    assert float(kim["q04_gradient_bytes"]["points"]) == 1
    assert float(lee["q03_compute_comm"]["points"]) == 0 and lee["q03_compute_comm"]["flag"] == ""
    assert "compute = T(N)" in lee["q03_compute_comm"]["message"], lee["q03_compute_comm"]
    assert "23.15 s" in lee["q03_compute_comm"]["message"]
    mia = _details(grades, "mia")
    assert float(mia["q09_average"]["points"]) == 0 and float(mia["q09_buckets"]["points"]) == 2
    assert "summing without dividing" in mia["q09_average"]["message"], mia["q09_average"]
    assert mia["q09_average"]["sandbox"] == ("none" if SANDBOX_ARGS else "bwrap")
    print("make grade messages:", kim["q04_ring_bytes"]["message"], kim["q04_utilization"]["message"],
          lee["q03_compute_comm"]["message"], sep="\n")


# --------------------------------------------------------------------------- a class


def _run_grade(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab_utils", "grade", *args, *SANDBOX_ARGS], cwd=REPO,
                          capture_output=True, text=True, timeout=400)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_class_gradebook_lms_zip_duplicates_roster_regrade_and_fold(dist, tmp_path):
    nb02 = student_notebook(dist, "02_multi_gpu_scaling")
    nb03 = student_notebook(dist, "03_compute_vs_communication")
    good02, good03 = solved(nb02, "02_multi_gpu_scaling"), solved(nb03, "03_compute_vs_communication")
    subs = tmp_path / "handed_in"
    stage = tmp_path / "stage"
    # a Canvas bulk download: Jane handed in 02 twice (the later one is solved), Bob once
    early = write(stage / "doejane_1001_5001_02_multi_gpu_scaling.ipynb", nb02)
    late = write(stage / "doejane_1001_5002_02_multi_gpu_scaling-1.ipynb", good02)
    bob = write(stage / "smithbob_1002_5003_02_multi_gpu_scaling.ipynb", good02)
    subs.mkdir()
    with zipfile.ZipFile(subs / "submissions.zip", "w") as z:
        z.writestr(zipfile.ZipInfo(early.name, (2026, 3, 1, 10, 0, 0)), early.read_text())
        z.writestr(zipfile.ZipInfo(late.name, (2026, 3, 2, 10, 0, 0)), late.read_text())
        z.writestr(zipfile.ZipInfo(bob.name, (2026, 3, 1, 9, 0, 0)), bob.read_text())
    write(subs / "Jane Doe_1001_assignsubmission_file_" / "03_compute_vs_communication.ipynb", good03)
    (subs / "hank.pdf").write_bytes(b"%PDF-1.4 not a notebook")
    roster = tmp_path / "roster.csv"
    roster.write_text("Student,ID\n\"Doe, Jane\",1001\n\"Smith, Bob\",1002\n\"Nobody, Ned\",1003\n")
    grades = tmp_path / "grades"
    common = ["--bundle", rel(dist / "grading"), "--out", rel(grades), "--roster", rel(roster)]

    r = _run_grade(rel(subs), *common)
    print(r.stdout, r.stderr)
    assert r.returncode == 1, r.stdout + r.stderr         # hank.pdf could not be graded
    assert "could not be graded (1): hank" in r.stdout and "no submission (1): Nobody, Ned" in r.stdout
    book = _by_student(grades)
    assert set(book) == {"Doe, Jane", "Smith, Bob", "Nobody, Ned", "hank"}
    jane, bob_row, ned = book["Doe, Jane"], book["Smith, Bob"], book["Nobody, Ned"]
    assert (jane["id"], bob_row["id"], ned["id"]) == ("1001", "1002", "1003")
    assert (float(jane["q02_speedup"]), float(jane["q03_compute_comm"]), float(jane["total"])) == (2, 2, 8)
    assert float(bob_row["q02_speedup"]) == 2 and float(bob_row["q03_compute_comm"]) == 0
    assert float(ned["total"]) == 0 and "no submission" in ned["notes"]
    jd = _details(grades, "Doe, Jane")
    assert jd["q02_speedup"]["file"] == f"submissions.zip!{late.name}"
    state = json.loads((grades / "grading.json").read_text())
    notes = state["students"]["id:1001"]["notebooks"]["02_multi_gpu_scaling"]["notes"]
    assert any(early.name in n and "latest" in n for n in notes), notes

    # --student: Bob hands in a new 03; only he is regraded, Jane keeps her grades
    write(subs / "smithbob_1002_5009_03_compute_vs_communication.ipynb", good03)
    r = _run_grade(rel(subs), *common, "--student", "1002")
    assert r.returncode == 0, r.stdout + r.stderr
    book = _by_student(grades)
    assert float(book["Smith, Bob"]["q03_compute_comm"]) == 2 and float(book["Smith, Bob"]["total"]) == 8
    assert float(book["Doe, Jane"]["total"]) == 8 and "Nobody, Ned" in book

    # points given by hand: folded into totals and feedback; a bad file changes nothing
    hand = tmp_path / "hand.csv"
    hand.write_text("student,question,points,comment\nDoe, Jane,q02_report,1.5,clear reasoning\n"
                    "1002,q03_compute_comm,1,checked by hand\n".replace("Doe, Jane", '"Doe, Jane"'))
    r = subprocess.run(["make", "--no-print-directory", "fold", f"HAND={rel(hand)}", f"GRADES={rel(grades)}"],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "folded 2 point(s)" in r.stdout, r.stdout + r.stderr
    book = _by_student(grades)
    assert float(book["Doe, Jane"]["q02_report"]) == 1.5 and float(book["Doe, Jane"]["total"]) == 9.5
    assert float(book["Smith, Bob"]["q03_compute_comm"]) == 1
    assert "clear reasoning" in (grades / "feedback" / "Doe_Jane.md").read_text()
    bad = tmp_path / "bad.csv"
    bad.write_text("student,question,points\nDoe, Jane,q02_report,7\n".replace("Doe, Jane", '"Doe, Jane"'))
    r = subprocess.run([sys.executable, "-m", "lab_utils", "fold", str(bad), "--out", str(grades)],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "worth 2" in r.stderr and "Nothing was folded" in r.stderr
    assert float(_by_student(grades)["Doe, Jane"]["q02_report"]) == 1.5
    # grading again keeps what was folded
    r = _run_grade(rel(subs), *common)
    assert float(_by_student(grades)["Doe, Jane"]["total"]) == 9.5


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_regrading_one_student_without_the_roster_keeps_one_row(dist, tmp_path):
    """docs/grading.md: a first run with `--roster`, then `make grade ... GRADE_ARGS="--student 'Doe, Jane'"`
    (no roster). A folder named after the student carries no id, so the regrade must find the row the
    roster made by name; it used to add a second "Doe, Jane" row without an id."""
    nb02 = student_notebook(dist, "02_multi_gpu_scaling")
    subs = tmp_path / "handed_in"
    write(subs / "Doe, Jane" / "02_multi_gpu_scaling.ipynb", nb02)
    write(subs / "alice" / "02_multi_gpu_scaling.ipynb", solved(nb02, "02_multi_gpu_scaling"))
    roster = tmp_path / "students.csv"
    roster.write_text('student,id\nalice,1001\n"Doe, Jane",1002\n')
    grades = tmp_path / "grades"
    where = [f"SUBMISSIONS={rel(subs)}", f"DIST={rel(dist)}", f"GRADES={rel(grades)}"]
    extra = " ".join(SANDBOX_ARGS)
    r = make("grade", *where, f"GRADE_ARGS=--roster {rel(roster)} {extra}", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    write(subs / "Doe, Jane" / "02_multi_gpu_scaling.ipynb", solved(nb02, "02_multi_gpu_scaling"))
    r = make("grade", *where, f"GRADE_ARGS=--student 'Doe, Jane' {extra}", timeout=400)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = read_csv(grades / "gradebook.csv")
    assert sorted((x["student"], x["id"]) for x in rows) == [("Doe, Jane", "1002"), ("alice", "1001")]
    assert {x["student"]: float(x["total"]) for x in rows} == {"Doe, Jane": 4, "alice": 4}


@pytest.mark.timeout(120)
def test_grade_help_missing_bundle_and_no_sandbox(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lab_utils", "grade", "--help"], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0 and "gradebook.csv" in r.stdout and "make student" in r.stdout
    r = subprocess.run([sys.executable, "-m", "lab_utils", "grade", str(tmp_path), "--bundle",
                        str(tmp_path / "nothing")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert r.returncode == 2 and "make student" in r.stderr
    r = make("grade", timeout=60)
    assert r.returncode == 2 and "usage: make grade SUBMISSIONS=" in r.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_without_bwrap_grading_needs_no_sandbox_on_purpose(dist, tmp_path):
    """No bwrap on PATH: grade refuses in one sentence; with --no-sandbox it grades, says so loudly,
    and marks every row that ran code."""
    subs = tmp_path / "subs"
    book = "02_multi_gpu_scaling"
    write(subs / "alice" / f"{book}.ipynb", solved(student_notebook(dist, book), book))
    env = {**os.environ, "PATH": str(tmp_path / "empty")}
    args = [sys.executable, "-m", "lab_utils", "grade", str(subs), "--bundle", str(dist / "grading"), "--out",
            str(tmp_path / "grades")]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO, env=env)
    assert r.returncode == 2 and "bwrap is not installed" in r.stderr and "--no-sandbox" in r.stderr, r.stderr
    assert not (tmp_path / "grades" / "gradebook.csv").exists()
    r = subprocess.run([*args, "--no-sandbox"], capture_output=True, text=True, timeout=200, cwd=REPO,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "WARNING: graded WITHOUT a sandbox" in r.stdout
    rows = read_csv(tmp_path / "grades" / "details.csv")
    assert {r["sandbox"] for r in rows} == {"none"}
    assert float(_by_student(tmp_path / "grades")["alice"]["total"]) == 4
    assert "graded without a sandbox" in _by_student(tmp_path / "grades")["alice"]["notes"]


def _student_stack(tmp_path: Path) -> dict[str, str]:
    """The environment of a student's machine that already has this lab's Python stack (torch and the
    rest of requirements.txt), but not this checkout: the test's own site-packages, seen through the user
    site of a fresh ``PYTHONUSERBASE`` (a venv made with ``--system-site-packages`` sees it; a path added
    by a .pth line runs none of that folder's .pth files, so this checkout's editable lab_utils stays out),
    and a fresh ``HOME`` for ``make kernel``."""
    import sysconfig

    base = tmp_path / "userbase"
    site = Path(sysconfig.get_path("purelib", "posix_user", vars={"userbase": str(base)}))
    site.mkdir(parents=True)
    (site / "lab-stack.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAB_")}   # this suite's results folder
    return {**env, "PYTHONUSERBASE": str(base), "HOME": str(home), "MPLBACKEND": "Agg"}


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_student_copy_installs_and_runs_on_its_own(dist, tmp_path):
    """Issue 48: the student copy, unpacked alone, as its README says: `make venv` (here with
    SYSTEM_TORCH=1, on a machine whose Python has the stack: no torch download in a test), `make kernel`,
    a notebook run headless with its blanks (`make lab NOTEBOOKS=...`: the check says "not done yet"),
    `make report`; nothing comes from this checkout (lab_utils is the copy's own); the README's other
    targets resolve, and the lab's own test suite is refused in one sentence."""
    import shutil

    copy = tmp_path / "unpacked"
    shutil.copytree(dist / "student", copy)
    env = _student_stack(tmp_path)
    readme = (copy / "README.md").read_text()

    def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run(["make", "--no-print-directory", *args], cwd=copy, env=env, capture_output=True,
                              text=True, timeout=timeout)

    for target in ("venv", "prepare", "kernel", "report", "lab"):
        assert f"make {target}" in readme, target
    r = run("venv", "SYSTEM_TORCH=1")
    assert r.returncode == 0, r.stdout + r.stderr
    where = subprocess.run([str(copy / ".venv" / "bin" / "python"), "-c",
                            "import lab_utils, torch; print(lab_utils.__file__)"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert where.stdout.strip() == str(copy / "lab_utils" / "__init__.py"), where.stdout + where.stderr
    r = run("-n", "prepare")   # downloads: not run offline, but the target resolves
    assert r.returncode == 0 and "lab_utils prepare" in r.stdout, r.stdout + r.stderr
    r = run("kernel")
    assert r.returncode == 0, r.stdout + r.stderr
    kernels = Path(env["HOME"]) / ".local" / "share" / "jupyter" / "kernels"
    spec = json.loads((kernels / "dl-perf-lab" / "kernel.json").read_text())
    assert spec["argv"][0] == str(copy / ".venv" / "bin" / "python")
    r = run("lab", "NOTEBOOKS=labs/01_batch_size_sweep.ipynb", "PROFILE=quick")
    assert r.returncode == 0 and "ok     01_batch_size_sweep" in r.stdout, r.stdout + r.stderr
    executed = json.loads((copy / "results" / "quick" / "executed" / "01_batch_size_sweep.ipynb").read_text())
    checks = [c for c in executed["cells"] if c["cell_type"] == "code"
              and 'grader.check("q01_step_timer")' in nbs.source(c)]
    assert checks and "not done yet" in json.dumps(checks[0]["outputs"]), checks
    errors = [o for c in executed["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert errors == []
    r = run("report", "PROFILE=quick")
    handed_in = copy / "results" / "quick" / "handin" / "report.md"
    assert r.returncode == 0 and handed_in.is_file(), r.stdout + r.stderr
    r = run("test")
    assert r.returncode == 2 and "does not hold" in r.stdout, r.stdout + r.stderr


def _run_check_cells(dist: Path, tmp_path: Path, book: str, functions: dict[str, str]) -> dict[str, dict]:
    """What a student sees: the student notebook's init cell, each exercise cell holding the given code,
    and its check cell (``grader.check("...")``), run in a kernel as JupyterLab runs them (nbclient).
    Returns question -> the check cell's display data (mime type -> text)."""
    import nbformat
    from nbclient import NotebookClient

    here = tmp_path / book
    here.mkdir()
    full = student_notebook(dist, book)
    (here / f"{book}.ipynb").write_text(json.dumps(full))   # otter reads the tests from its metadata
    cells = [c for c in full["cells"] if c["cell_type"] == "code"]
    run = [nbformat.v4.new_code_cell(nbs.source(cells[0]))]   # the init cell: grader = Notebook(...)
    for question, code in functions.items():
        run += [nbformat.v4.new_code_cell(code), nbformat.v4.new_code_cell(f'grader.check("{question}")')]
    nb = nbformat.v4.new_notebook(cells=run)
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(here)}}).execute()
    shown = {}
    for question, cell in zip(functions, nb.cells[2::2], strict=True):
        data = [o["data"] for o in cell.outputs if o.get("output_type") == "execute_result"]
        assert len(data) == 1, cell.outputs
        shown[question] = data[0]
    return shown


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failing_check_shows_its_sentence_first(dist, tmp_path):
    """Issue 32, item 8: the student copies of notebooks 04 and 03 filled with the earlier reports'
    answers. Each failing grader.check shows first the one sentence with the case and the mistake's
    name; otter's doctest transcript (no traceback, no doctest.py) is folded away below it. A right
    answer still shows otter's "passed"."""
    shown = _run_check_cells(dist, tmp_path, "04_allreduce_bandwidth",
                             {"q04_ring_bytes": RING_ONE_PER_EPOCH, "q04_utilization": GBPS_ONE_PER_EPOCH})
    shown |= _run_check_cells(dist, tmp_path, "03_compute_vs_communication",
                              {"q03_compute_comm": COMPUTE_IS_TN})
    right = "def run_epoch_seconds(rank_seconds):\n    return max(rank_seconds)\n"
    shown |= _run_check_cells(dist, tmp_path, "06_gpt_ddp", {"q06_rank_time": right})
    first = {
        "q04_ring_bytes": "q04_ring_bytes: ring_bytes_per_rank_per_epoch(44695848, 2, 50000, 128) gives "
                          "44695848, expected 8760386208: one all-reduce per epoch: every step of the epoch "
                          "ends",
        "q04_utilization": "q04_utilization: achieved_gb_per_s(44695848, 2, 196, 1.05) gives 0.04256747429, "
                           "expected 8.34322496: one all-reduce per epoch:",
        "q03_compute_comm": "q03_compute_comm: compute_and_comm(33.64, 17.87, 2) gives [17.87, 1.05], "
                            "expected [16.82, 1.05]: compute = T(N): ",
    }
    for question, start in first.items():
        plain, page = shown[question]["text/plain"], shown[question]["text/html"]
        print(plain)
        assert plain.startswith(start) and "\n" not in plain.strip(), plain   # one line: the sentence
        visible = page.split("<details>")[0]
        head = f"<p><strong style='color: #b00;'>{question}:</strong> {start[len(question) + 2:]}"
        assert visible.startswith(head), visible
        assert "Traceback" not in visible and "doctest" not in visible and "Expected" not in visible
        assert "Got:" in page.split("<details>")[1] and "Traceback" not in page   # otter's transcript, folded
    assert "250.1 MB/s" in shown["q04_utilization"]["text/plain"]
    assert "23.15 s" in shown["q03_compute_comm"]["text/plain"]
    assert "passed" in shown["q06_rank_time"]["text/plain"]
    assert "passed" in shown["q06_rank_time"]["text/html"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_grading_gives_its_load_and_cpu_time(dist):
    """docs/grading.md: `python -m lab_utils bench grading` gives each time with the load it ran under and the
    CPU time, from which the class's time on idle cores is estimated; every copy scores full marks."""
    r = subprocess.run([sys.executable, "-m", "lab_utils", "bench", "grading", "--students", "1", "--bundle",
                        rel(dist / "grading")], cwd=REPO, capture_output=True, text=True, timeout=500)
    print(r.stdout, r.stderr)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if "s per notebook" in line]
    assert len(lines) == (1 if sandbox.probe() else 2), r.stdout
    for line in lines:
        m = re.search(r"load average [\d.]+ -> [\d.]+ on \d+ cores\); CPU ([\d.]+) s per notebook; "
                      r"60 students x 8 notebooks: [\d.]+ min at this load, about ([\d.]+) min on \d idle "
                      rf"cores; all {AUTO_POINTS:g}/{AUTO_POINTS:g}", line)
        assert m and float(m.group(1)) > 0 and float(m.group(2)) > 0, line


# --------------------------------------------------------------------------- reading a submission


@pytest.mark.timeout(60)
def test_reaching_other_modules_and_changing_them_is_flagged():
    """Issue 35: the paths from an exercise to the grader's own module (through any module's sys, os,
    builtins, importlib) and writes into other modules (.update(), setattr, __dict__, sys.modules) are
    flagged; what an honest exercise writes is not."""
    import ast

    def flags(code: str) -> list[str]:
        return reaching.exercise_flags(ast.parse(code).body, "f")

    def patches(code: str) -> list[str]:
        cells = {"cells": [{"cell_type": "code", "source": code}]}
        return reaching.monkeypatches(programs.parse_program(cells))

    for reach, said in (("torch.sys.modules['x']", "reaches sys through torch.sys"),
                        ("np.os.listdir('/')", "reaches os through np.os"),
                        ("torch.nn.modules.module.builtins", "reaches builtins through"),
                        ("getattr(torch, 'sys')", "reaches sys through getattr(torch, 'sys')"),
                        ("torch.__dict__", "reads .__dict__")):
        code = f"import torch\nimport numpy as np\n\n\ndef f(m):\n    x = {reach}\n    return 1\n"
        assert any(said in f for f in flags(code)), (reach, flags(code))
        assert any(said.replace("reads .", "") in p for p in patches(code)) or said.startswith("reads")
    assert any("reaches sys through from torch import sys" in f for f in flags("from torch import sys\n"))
    assert any("calls EXERCISES.update() on another module" in f
               for f in flags("from m import EXERCISES\n\n\ndef f():\n    EXERCISES.update(a=1)\n"))
    assert patches("import math\nmath.__dict__.update(isclose=1)\n") == \
        ["calls math.__dict__.update() on another module (code cell 1)"]
    assert patches("import sys\nsys.modules['lab_utils.app.grading'] = None\n")[0] == \
        "assigns to sys.modules['lab_utils.app.grading'] (code cell 1)"
    assert patches("import math\nsetattr(math, 'isclose', 1)\n") == \
        ["assigns to math.isclose (setattr) (code cell 1)"]
    honest = ("import math\nimport os\nimport sys\nimport torch\nimport matplotlib.pyplot as plt\n"
              "os.environ['LAB_PROFILE'] = 'quick'\nplt.rcParams['font.size'] = 8\nplt.rcParams.update({})\n"
              "sys.path.append('..')\nx = torch.add(torch.zeros(2), 1)\n\n\n"
              "def grad_bytes(model):\n    n = len(list(model.modules()))\n"
              "    return sum(p.numel() * p.element_size() for p in model.parameters()) + 0 * n\n")
    assert patches(honest) == [] and flags(honest.split("\n\n\n")[1]) == []


@pytest.mark.timeout(60)
def test_a_canvas_bulk_zip_files_other_files_under_their_students(tmp_path):
    """A PDF in a Canvas bulk download (handed in as the folder, or as SUBMISSIONS itself) belongs to the
    student its Canvas name names: never a student named after the zip."""
    from lab_utils.app.grading.submissions import find_submissions

    with zipfile.ZipFile(tmp_path / "submissions.zip", "w") as z:
        z.writestr("doejane_1001_5001_02_multi_gpu_scaling.ipynb", "{}")
        z.writestr("doejane_1001_5004_report.pdf", "%PDF")
        z.writestr("smithbob_late_1002_5005_notes.txt", "notes")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "submissions.zip").write_bytes((tmp_path / "submissions.zip").read_bytes())
    for root in (tmp_path / "submissions.zip", tmp_path / "folder"):
        found = find_submissions(root, tmp_path / f"staging-{root.stem}")
        assert sorted((s.student.name, s.student.id, s.kind, s.problem) for s in found) == [
            ("doejane", "1001", "notebook", ""), ("doejane", "1001", "other", ""),
            ("smithbob", "1002", "other", "")]


@pytest.mark.timeout(60)
def test_a_student_entry_may_add_columns_flags_and_notes(tmp_path):
    """The place later work adds to a row (e.g. where a student's numbers came from): an entry's
    ``columns`` are written after ``possible``, its ``flags`` and ``notes`` beside the notebooks'."""
    from lab_utils.app.grading import gradebook
    from lab_utils.app.grading.grade import missing_record, new_entry
    from lab_utils.app.grading.submissions import Student

    info = {"questions": [{"name": "q02_speedup", "points": 2.0, "manual": False}]}
    alice, bob = new_entry(Student("alice", "1")), new_entry(Student("bob", "2"))
    for s in (alice, bob):
        s["notebooks"]["02_multi_gpu_scaling"] = missing_record(info)
    alice["columns"]["profile"] = "quick"
    alice["flags"].append("quick profile: not the assignment's sizes")
    alice["notes"].append("handed in with the CPU profile")
    state = {"students": {"id:1": alice, "id:2": bob}, "questions": [
        {"name": "q02_speedup", "points": 2.0, "notebook": "02_multi_gpu_scaling",
         "column": questions.gradebook_column("q02_speedup")}]}
    gradebook.write_outputs(state, tmp_path)
    rows = read_csv(tmp_path / "gradebook.csv")
    assert list(rows[0]) == ["student", "id", "Q2 speedup (02-a)", "total", "possible", "profile", "flags",
                             "notes"]
    assert (rows[0]["profile"], rows[1]["profile"]) == ("quick", "")
    assert rows[0]["flags"] == "quick profile: not the assignment's sizes" and rows[1]["flags"] == ""
    assert rows[0]["notes"] == "no submission of 02; handed in with the CPU profile"


@pytest.mark.timeout(60)
def test_consecutive_hand_graded_answers_each_keep_their_question():
    """Otter writes one question's END and the next one's BEGIN into one cell (notebook 05: Q4.1, Q4.2, Q6
    and Q7 in a row): each answer goes to its own question, stamped or not (the build stamps by the same
    rule)."""
    def md(text, answer=False):
        return {"cell_type": "markdown", "metadata": {"tags": [nbs.ANSWER_TAG]} if answer else {},
                "source": text}

    cells = [md("<!-- BEGIN QUESTION -->\n\n**Q4.1 (graded by hand, 2 points).**"), md("first", True),
             md("<!-- END QUESTION -->\n\n<!-- BEGIN QUESTION -->\n\n**Q4.2**"),
             md(nbs.ANSWER_PLACEHOLDER, True),
             md("<!-- END QUESTION -->\n\n<!-- BEGIN QUESTION -->\n\n**Q6**"), md("third", True),
             md("<!-- END QUESTION -->\n\n"), md("not an answer")]
    names = ["q05_accuracy", "q05_report", "q05_messages"]
    assert nbs.answers({"cells": cells}, names) == {"q05_accuracy": "first", "q05_report": "",
                                                    "q05_messages": "third"}
