"""The lab's command line: ``python -m lab_utils {run,prepare,bench,info} ...``.

- ``run [NOTEBOOK ...] [--profile quick|full] [--timeout S]``: execute notebooks headless
  and write ``results/<profile>/report.md``.
- ``prepare``: download CIFAR-10 and the text corpus into ``data/`` (needs internet).
- ``bench NAME [args]``: benchmarks that print ratios measured side by side in one run
  (``timers``, ``allreduce``, ``data``, ``train``).
- ``info``: the machine, versions, chosen profile and data status.
- ``doctor [--profile P] [--budget S] [--only NAMES]``: the first session on a new GPU node: checks
  on the real machine what no CPU test can (``lab_utils.doctor``); exit 1 when a check fails.
- ``student [--out DIR]``: build the student edition and the grading bundle (otter assign).
- ``grade SUBMISSIONS_DIR [--bundle DIR] [--out DIR] [--timeout S] [--jobs N]``: grade handed-in
  notebooks headless (otter run, no Docker) into a gradebook and feedback files.

Bad input is reported as one ``error:`` line (exit code 2), without a traceback. So is a GPU
node whose GPUs this torch cannot use: ``info`` and ``run`` stop before any work instead of
running on the CPU (``lab_utils.core.environment.check_gpu_node``).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from lab_utils.core.errors import LabError

# Benchmarks live next to what they measure; each entry is "module:function(argv) -> int".
BENCHES = {
    "timers": ("lab_utils.experiments.bench_timers:main",
               "overhead of the phase timers on a training loop"),
    "allreduce": ("lab_utils.experiments.comm_tables:bench_main",
                  "all-reduce bandwidth (nccl-tests columns) under torchrun"),
    "data": ("lab_utils.experiments.fastpath_tables:bench_data_main",
             "spec DataLoader vs device-resident loader, images/s"),
    "train": ("lab_utils.experiments.fastpath_tables:bench_train_main",
              "spec training vs each fast-path step, images/s"),
}


def _call(target: str, argv: list[str]) -> int:
    module, func = target.split(":")
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise LabError(f"This lab has no {module} ({e}); update the checkout.") from None
    return int(getattr(mod, func)(argv) or 0)


def _prepare(args) -> int:
    from pathlib import Path

    from lab_utils.core import data

    root = Path(args.data_dir) if args.data_dir else None
    path = data.prepare_cifar10(root)
    print(f"CIFAR-10 ready in {path}")
    try:
        text_data = importlib.import_module("lab_utils.core.text_data")
    except ModuleNotFoundError:
        return 0
    corpus = text_data.prepare_corpus(root)
    print(f"text corpus ready: {corpus}")
    return 0


def _gpu_node_guard(profile: str | None) -> None:
    """Stop before any work when the driver reports GPUs that torch cannot use (LabError)."""
    from lab_utils.core import config
    from lab_utils.core.environment import check_gpu_node

    check_gpu_node(*config.resolve_profile_name(profile))


def _info(args) -> int:
    from lab_utils.core import config, data, hardware

    _gpu_node_guard(args.profile)
    name, why = config.resolve_profile_name(args.profile)
    out = {"profile": name, "why": why, "machine": hardware.describe_machine(),
           "dataset": data.dataset_status()}
    print(json.dumps(out, indent=2, default=str))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m lab_utils", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="execute notebooks headless and write the report")
    r.add_argument("notebooks", nargs="*", help="notebook paths or names (default: all, in order)")
    r.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    r.add_argument("--timeout", type=float, default=3600, help="per-cell timeout in seconds")

    pr = sub.add_parser("prepare", help="download the datasets into data/ (needs internet)")
    pr.add_argument("--data-dir", default=None)

    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    b.add_argument("name", choices=sorted(BENCHES), metavar="NAME",
                   help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for that benchmark (--help)")

    i = sub.add_parser("info", help="machine, versions, profile and data status")
    i.add_argument("--profile", default=None)

    d = sub.add_parser("doctor", help="first session on a GPU node: check what no CPU test can (<= 10 min)",
                       add_help=False)
    d.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the doctor (--help)")

    st = sub.add_parser("student", help="build the student edition and the grading bundle (otter assign)",
                        description=STUDENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--out", default="dist", help="output folder (default: dist): student/ and grading/")
    st.add_argument("notebooks", nargs="*", help="only these notebooks (e.g. 01 02; default: every "
                                                 "notebook with an '# ASSIGNMENT CONFIG' cell)")

    g = sub.add_parser("grade", help="grade a folder of submitted notebooks headless (otter run)",
                       description=GRADE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("submissions", metavar="SUBMISSIONS_DIR",
                   help="<student>/NN_*.ipynb (one folder per student) or <student>.ipynb")
    g.add_argument("--bundle", default="dist/grading", help="the grading bundle (default: dist/grading)")
    g.add_argument("--out", default="grades", help="where gradebook.csv and feedback/ go (default: grades)")
    g.add_argument("--timeout", type=float, default=120,
                   help="seconds one submission may take before it is stopped (default: 120)")
    g.add_argument("--jobs", type=int, default=1, help="submissions graded at once (default: 1)")
    return p


STUDENT_HELP = """Build the student edition and the grading bundle from the notebooks in labs/.

Every labs/NN_*.ipynb with an '# ASSIGNMENT CONFIG' cell is a master notebook (otter assign v7
format). For each, otter assign writes:
  DIR/student/NN_*.ipynb            solutions and hidden tests stripped, outputs cleared; public
                                    tests inside the notebook for grader.check(); stamped with
                                    the notebook's lab version (metadata dl_perf_lab)
  DIR/grading/NN_*-autograder.zip   otter's autograder with all tests (public and hidden)
  DIR/grading/manifest.json         versions, questions and points
The build fails if any solution or hidden-test text is left in a student notebook.
Hand out DIR/student/ (students open the notebooks with the lab's kernel: they import lab_utils).
Keep DIR/grading/ for `python -m lab_utils grade`."""

GRADE_HELP = """Grade handed-in notebooks headless with otter run (no Docker, no GPU needed).

Build the bundle first (make student). Collect the submissions in one folder, either
  SUBMISSIONS_DIR/<student>/NN_*.ipynb   one folder per student (student = folder name), or
  SUBMISSIONS_DIR/<student>.ipynb        one notebook per student (student = file stem).
The lab notebook is recognized from the notebook's metadata (else its file name).
Every notebook runs in its own subprocess with a time limit (--timeout); the experiment cells
(tagged otter_ignore) are skipped, so only imports and exercises run.

Writes OUT/gradebook.csv (student, notebook, question, points, max_points, error) and
OUT/feedback/<student>.md (scores, failed test messages, answers of the hand-graded questions).
Hand-graded questions have empty points. A broken submission (syntax error, endless loop,
deleted check cells, a notebook from another lab version, not a notebook) gets rows whose
error says why; the batch always goes on. About 12 s per notebook on 2 cores."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["doctor"]:  # its options (--only, --help) are the doctor's own parser's
        args = argparse.Namespace(command="doctor", args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            from lab_utils import runner

            _gpu_node_guard(args.profile)
            return runner.main(args.notebooks, args.profile, args.timeout)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "bench":
            return _call(BENCHES[args.name][0], args.args)
        if args.command == "info":
            return _info(args)
        if args.command == "doctor":
            from lab_utils import doctor

            return doctor.main(args.args)
        if args.command == "student":
            from lab_utils import grading

            grading.build(args.out, notebooks=args.notebooks or None)
            return 0
        if args.command == "grade":
            from lab_utils import grading

            grading.grade(args.submissions, args.bundle, args.out, args.timeout, args.jobs)
            return 0
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: results already recorded are kept in results/.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
