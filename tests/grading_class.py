"""A class's hand-in folder as an instructor receives it (issue 35's trial of 60 students, scalable).

:func:`make_class` writes, from the built student copy (``make student``), one folder holding

- a **Canvas bulk download** (``submissions.zip``): Jane handed in notebook 02 three times (the
  second solved, the third cut off in upload: the second is graded) and her report as a PDF;
  Bob's 04 has a known mistake (the log2 tree formula: exactly its 2 points lost);
- a **Moodle** folder (``Lee Ann_1003_assignsubmission_file_/``): 03 solved, and 00 and 08, which
  hold no exercise ("nothing to grade");
- **hostile students**, each in a folder of their own: Mallet's ``q04_gradient_bytes`` rewires
  ``q04_ring_bytes``'s check through ``torch.sys.modules`` (and his ring bytes ``return 0``); Peeker's
  ``q04_utilization`` tries nine files, the last a classmate's notebook; Writer's writes to the
  instructor's home; Looper's 02 loops forever; Stubborn's 03 loops and ignores the time limit's
  alarm; Killer's ``q04_gradient_bytes`` kills the grading process;
- **broken files** (Bea): an HTML page saved as ``04_allreduce_bandwidth.ipynb``, a truncated 02,
  an empty 03, a 210 MB 05 (a sparse file: no disk used) and ``scratch.ipynb`` (not JSON);
- **not this lab's** (Otto): another course's ``04_linear_regression.ipynb``, and a 02 whose
  metadata lost its stamp (recognised by its title);
- ``hank.pdf``: a student who handed in no notebook;
- ``correct`` students with ``correct_books`` solved, spread over the forms above (a folder, a zip
  of their own, Canvas members of a second bulk zip, a Moodle folder);
- ``students.csv``, the roster: everyone above and two students who handed in nothing;
- ``handin.json`` files (``make report``'s, tests/handin_files.py): Mallet's from a quick CPU run on
  synthetic data; full runs on four A100s from Jane (a member of the Canvas zip), Peeker, Writer, the
  folder-form correct students and Killer, whose speedups and GB/s are half the others' (the outlier
  of the A100 group); Lee Ann's from two V100s (a group too small to judge), its notebook 03 stamped
  with another version; Bob and the others hand in none.

``python tests/grading_class.py OUT --dist dist --correct 48`` writes the issue's class of 60
(roster of 62) into OUT, to time ``make grade`` on it.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from grading_submissions import (
    BOOKS,
    RIGHT,
    UTILIZATION,
    hostile,
    solved,
    student_notebook,
    with_function,
    write,
)
from handin_files import handin, write_handin

from lab_utils.app.grading import notebooks as nbs

NB04 = "04_allreduce_bandwidth"
RING = "def ring_bytes_per_rank_per_epoch(size_bytes, world_size, dataset_size, per_device_batch):\n"
RING_ZERO = RING + "    return 0\n"
RING_LOG2 = ("import math\n\n\n" + RING
             + "    it = math.ceil(math.ceil(dataset_size / world_size) / per_device_batch)\n"
             + "    return it * size_bytes * math.log2(world_size)\n")
# Issue 35: the body of q04_gradient_bytes reaches the grader's module through torch.sys.modules and
# makes the next question's check run the lab's own function instead of the student's.
REWIRE = '''import dataclasses
import torch


def grad_bytes(model):
    """Bytes of the gradients DDP all-reduces for `model` (an nn.Module)."""
    ex = torch.sys.modules["lab_utils.app.grading.exercises"]
    ring = torch.sys.modules["importlib"].import_module("lab_utils.learn.ring")
    ex.EXERCISES.update(q04_ring_bytes=dataclasses.replace(
        ex.EXERCISES["q04_ring_bytes"], call=lambda fn, case: ring.ring_bytes_per_epoch(*case)))
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
'''
KILL_THE_GRADER = '''import os
import signal


def grad_bytes(model):
    """Bytes of the gradients DDP all-reduces for `model` (an nn.Module)."""
    os.kill(os.getppid(), signal.SIGKILL)
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
'''
SPEEDUP = "def speedup_and_efficiency(t1_seconds, tn_seconds, n_devices):\n"
LOOP = SPEEDUP + "    while True:\n        pass\n"
STUBBORN = ("import signal\n\n\ndef compute_and_comm(t1_seconds, tn_seconds, n_devices):\n"
            "    signal.signal(signal.SIGALRM, signal.SIG_IGN)\n    while True:\n        pass\n")
HTML_PAGE = ("<!DOCTYPE html>\n<html><head><title>04_allreduce_bandwidth.ipynb - JupyterLab</title></head>\n"
             "<body><div id='main'>Loading...</div></body></html>\n")
FOREIGN = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": "# Linear regression from scratch"},
                     {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [],
                      "source": "def fit(x, y):\n    return sum(y) / len(y)\n"}],
           "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3"}},
           "nbformat": 4, "nbformat_minor": 5}
MISSING = [("Nobody, Ned", "1901"), ("Absent, Abe", "1902")]


@dataclass
class Class:
    """The folder, its roster and who is who (``students``: roster name -> id)."""
    root: Path
    roster: Path
    students: dict[str, str] = field(default_factory=dict)
    correct: list[str] = field(default_factory=list)
    classmate_file: Path | None = None


def peeking(paths: list[str]) -> str:
    """``achieved_gb_per_s`` that first tries to read each of ``paths``, then answers right."""
    tries = "".join(f"        {p!r},\n" for p in paths)
    return (UTILIZATION + "    for path in [\n" + tries + "    ]:\n        try:\n"
            + "            open(path).read(100)\n        except OSError:\n            pass\n" + RIGHT)


def _zip(path: Path, members: list[tuple[str, str | bytes, tuple]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data, date in members:
            z.writestr(zipfile.ZipInfo(name, date), data)


def make_class(dist: Path, root: Path, correct: int = 1,
               correct_books: tuple[str, ...] = tuple(BOOKS)) -> Class:
    """Write the class folder (see the module docstring) into ``root``; return it with its roster."""
    root.mkdir(parents=True, exist_ok=True)
    needed = dict.fromkeys(["02_multi_gpu_scaling", "03_compute_vs_communication", NB04, *correct_books])
    blank = {b: student_notebook(dist, b) for b in needed}
    good = {b: json.dumps(solved(blank[b], b)) for b in needed}
    cls = Class(root, root.parent / "students.csv")
    day = (2026, 3, 1, 10, 0, 0)
    later = (2026, 3, 2, 10, 0, 0)
    latest = (2026, 3, 3, 10, 0, 0)

    # Canvas bulk download: Jane (02 twice, a PDF), Bob (a known mistake in 04)
    _zip(root / "submissions.zip", [
        ("doejane_1001_5001_02_multi_gpu_scaling.ipynb", json.dumps(blank["02_multi_gpu_scaling"]), day),
        ("doejane_1001_5002_02_multi_gpu_scaling-1.ipynb", good["02_multi_gpu_scaling"], later),
        ("doejane_1001_5004_report.pdf", b"%PDF-1.4 the written report", later),
        ("doejane_1001_5006_02_multi_gpu_scaling-2.ipynb", good["02_multi_gpu_scaling"][:2000], latest),
        ("smithbob_1002_5003_04_allreduce_bandwidth.ipynb",
         json.dumps(with_function(json.loads(good[NB04]), "q04_ring_bytes", RING_LOG2)), day),
        ("doejane_1001_5008_handin.json", json.dumps(handin(scale=1.01)), later)])
    cls.students.update({"Doe, Jane": "1001", "Smith, Bob": "1002"})
    # Moodle: Lee Ann hands in 03, and 00 and 08 (no exercise)
    moodle = root / "Lee Ann_1003_assignsubmission_file_"
    cls.classmate_file = write(moodle / "03_compute_vs_communication.ipynb",
                               json.loads(good["03_compute_vs_communication"]))
    for extra in ("00_environment", "08_speed_limits"):
        write(moodle / f"{extra}.ipynb", student_notebook(dist, extra))
    cls.students["Ann Lee"] = "1003"
    write_handin(moodle, handin(device="Tesla V100-SXM2-16GB", count=2,
                                versions={"03_compute_vs_communication": "0ld"}))

    nb04 = json.loads(good[NB04])
    hostile_code = hostile(Path.home(), cls.classmate_file, dist / "grading" / f"{NB04}.json")
    folders = {
        "Mallet, Max": {NB04: with_function(with_function(nb04, "q04_gradient_bytes", REWIRE),
                                            "q04_ring_bytes", RING_ZERO)},
        "Peeker, Pat": {NB04: with_function(nb04, "q04_utilization", peeking(
            ["/etc/hostname", "/etc/passwd", "/etc/shadow", str(Path.home() / ".ssh" / "id_rsa"),
             str(Path.home() / ".bash_history"), "/proc/1/environ", "/root/.netrc",
             str(dist / "grading" / f"{NB04}.json"), str(cls.classmate_file)]))},
        "Writer, Wes": {NB04: with_function(nb04, "q04_utilization", hostile_code["h_home"])},
        "Killer, Kim": {NB04: with_function(nb04, "q04_gradient_bytes", KILL_THE_GRADER)},
        "Looper, Lou": {"02_multi_gpu_scaling": with_function(json.loads(good["02_multi_gpu_scaling"]),
                                                              "q02_speedup", LOOP)},
        "Stubborn, Stu": {"03_compute_vs_communication": with_function(
            json.loads(good["03_compute_vs_communication"]), "q03_compute_comm", STUBBORN)},
    }
    for i, (name, books) in enumerate(folders.items()):
        for book, nb in books.items():
            write(root / name / f"{book}.ipynb", nb)
        cls.students[name] = f"{1010 + i}"
    write_handin(root / "Mallet, Max", handin(quick_cpu=True))
    for name, scale in (("Peeker, Pat", 1.0), ("Writer, Wes", 1.02), ("Killer, Kim", 0.5)):
        write_handin(root / name, handin(scale=scale))

    # broken files (Bea): each row must say why it could not be read
    bea = root / "Broken, Bea"
    bea.mkdir()
    (bea / f"{NB04}.ipynb").write_text(HTML_PAGE)
    text02 = good["02_multi_gpu_scaling"]
    (bea / "02_multi_gpu_scaling.ipynb").write_text(text02[:len(text02) // 2])
    (bea / "03_compute_vs_communication.ipynb").write_bytes(b"")
    with open(bea / "05_large_batch_training.ipynb", "wb") as f:
        f.truncate(210 * 2 ** 20)     # 210 MB on paper, no disk used
    (bea / "scratch.ipynb").write_text("print('hello')\n")
    cls.students["Broken, Bea"] = "1020"
    # not this lab's: another course's notebook named like lab 04; a 02 whose stamp was lost
    otto = root / "Other, Otto"
    write(otto / "04_linear_regression.ipynb", FOREIGN)
    unstamped = json.loads(good["02_multi_gpu_scaling"])
    del unstamped["metadata"][nbs.METADATA_KEY]
    write(otto / "my_copy_of_lab2.ipynb", unstamped)
    cls.students["Other, Otto"] = "1021"
    (root / "hank.pdf").write_bytes(b"%PDF-1.4 only a report")
    cls.students["hank"] = "1022"

    canvas: list[tuple[str, str, tuple]] = []
    for i in range(correct):
        name, sid = f"Correct, Student{i:02d}", f"{1100 + i}"
        form = i % 4
        for book in correct_books:
            if form == 0:
                write(root / name / f"{book}.ipynb", json.loads(good[book]))
                write_handin(root / name, handin(scale=0.98))
            elif form == 3:
                write(root / f"Student{i:02d} Correct_{sid}_assignsubmission_file_" / f"{book}.ipynb",
                      json.loads(good[book]))
            elif form == 2:
                canvas.append((f"correctstudent{i:02d}_{sid}_{6000 + i}_{book}.ipynb", good[book], day))
        if form == 1:
            _zip(root / f"{name}.zip", [(f"labs/{book}.ipynb", good[book], day) for book in correct_books])
        cls.students[name] = sid
        cls.correct.append(name)
    if canvas:
        _zip(root / "submissions (2).zip", canvas)
    rows = [*cls.students.items(), *MISSING]
    cls.roster.write_text("student,id\n" + "".join(f'"{n}",{i}\n' for n, i in rows))
    return cls


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the class folder to write (its roster goes beside it)")
    p.add_argument("--dist", type=Path, default=Path("dist"), help="the make student output (default: dist)")
    p.add_argument("--correct", type=int, default=48, help="students who solved every exercise (default: 48)")
    args = p.parse_args(argv)
    cls = make_class(args.dist, args.out, correct=args.correct)
    print(f"{len(cls.students)} students handed in (roster of {len(cls.students) + len(MISSING)}): "
          f"{cls.root}; roster {cls.roster}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
