"""``python -m lab_utils bench grading``: how long grading a class takes, with and without the sandbox.

Grades ``--students`` copies of every graded notebook filled with the master's own solutions (each
must score full points), once in the bwrap sandbox and once with ``--no-sandbox``, and prints for each
the wall time per notebook and for ``--class-size`` students extrapolated linearly, *at the load it ran
under* (the load average before and after is printed beside it), and the CPU time per notebook (user
+ system of the grader and of every notebook's processes, as each reports it), with the class's time
on idle cores estimated from it (CPU time / cores). The bundle (``dist/grading``) is built when missing.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import resource
import tempfile
import time
from contextlib import redirect_stdout
from pathlib import Path

from lab_utils.app.grading import build, grade, gradebook, sandbox
from lab_utils.app.grading import notebooks as nbs


def fill_with_solutions(student_nb: dict, master: nbs.Master) -> dict:
    """The student notebook with each exercise cell replaced by the master's solution cell and each
    hand-graded answer cell given a text."""
    solutions = {q.name: q.solution for q in master.questions if not q.manual}
    nb = copy.deepcopy(student_nb)
    for c in nb["cells"]:
        q = (c.get("metadata", {}).get(nbs.METADATA_KEY) or {}).get("question")
        if q in solutions and c["cell_type"] == "code":
            c["source"] = solutions[q]
        elif q and c["cell_type"] == "markdown":
            c["source"] = f"My answer to {q}: the table shows it."
    return nb


def _own_cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def _run(subs: Path, bundle: Path, out: Path, jobs: int, use_sandbox: bool) -> tuple[float, float, dict]:
    """(wall seconds, CPU seconds, gradebook state) of grading ``subs``. The CPU time is the grader's
    own and what each notebook's process reported for itself and its question processes (bwrap does
    not pass its children's time on to ours)."""
    t0, c0 = time.perf_counter(), _own_cpu_seconds()
    with redirect_stdout(io.StringIO()):
        status = grade.grade(subs, bundle, out, jobs=jobs, use_sandbox=use_sandbox)
    seconds, cpu = time.perf_counter() - t0, _own_cpu_seconds() - c0
    state = gradebook.load_state(out)
    cpu += sum(b.get("cpu_seconds", 0.0) for s in state["students"].values() for b in s["notebooks"].values())
    if status != 0:
        raise SystemExit(f"grading failed (exit status {status}); see {out}/details.csv")
    return seconds, cpu, state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab_utils bench grading",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--students", type=int, default=10, help="students in the measured run (default: 10)")
    p.add_argument("--class-size", type=int, default=60, help="students to extrapolate to (default: 60)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 2, help="notebooks at once (default: cores)")
    p.add_argument("--bundle", default=str(build.DIST_DIR / "grading"), help="default: dist/grading")
    args = p.parse_args(argv)
    bundle = Path(args.bundle).resolve()
    if not (bundle / build.MANIFEST).exists():
        build.build(bundle.parent)
    manifest = build.load_manifest(bundle)
    student_dir = bundle.parent / "student" / "labs"
    books = sorted(manifest["notebooks"])
    with tempfile.TemporaryDirectory(prefix="bench-grading-") as tmp:
        subs = Path(tmp) / "handed_in"
        for book in books:
            master = nbs.parse_master(build.LABS_DIR / f"{book}.ipynb")
            nb = fill_with_solutions(json.loads((student_dir / f"{book}.ipynb").read_text()), master)
            for i in range(args.students):
                path = subs / f"student{i:02d}" / f"{book}.ipynb"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(nb))
        n = args.students * len(books)
        auto = sum(info["auto_points"] for info in manifest["notebooks"].values())
        why = sandbox.probe()
        modes = [("without the sandbox", False)] + ([("in the bwrap sandbox", True)] if not why else [])
        print(f"{args.students} students x {len(books)} notebooks = {n} notebooks, {args.jobs} at a time, "
              f"{os.cpu_count()} cores" + (f"; no sandbox here: {why}" if why else ""))
        cores = os.cpu_count() or 1
        for label, use in modes:
            load0 = os.getloadavg()[0]
            seconds, cpu, state = _run(subs, bundle, Path(tmp) / f"grades_{use}", args.jobs, use)
            load1 = os.getloadavg()[0]
            totals = {s["name"]: sum(q["points"] for b in s["notebooks"].values()
                                     for q in b["questions"].values() if not q["manual"])
                      for s in state["students"].values()}
            wrong = {k: v for k, v in totals.items() if v != auto}
            class_n = args.class_size * len(books)
            check = f"NOT full points: {wrong}" if wrong else f"all {auto:g}/{auto:g}"
            print(f"{label:>22}: {seconds:6.1f} s for {n} notebooks = {seconds / n:.2f} s per notebook "
                  f"(wall, {args.jobs} at a time, load average {load0:.1f} -> {load1:.1f} on {cores} cores); "
                  f"CPU {cpu / n:.2f} s per notebook; {args.class_size} students x {len(books)} notebooks: "
                  f"{seconds / n * class_n / 60:.1f} min at this load, about "
                  f"{cpu / n * class_n / min(cores, args.jobs) / 60:.1f} min on {min(cores, args.jobs)} idle "
                  f"cores; {check}")
            if wrong:
                return 1
    return 0
