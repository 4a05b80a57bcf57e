"""The lab's command line: ``python -m lab_utils {run,measure,report,prepare,bench,info,doctor,student,
grade,fold,docs} ...`` (``--help`` on each says what it does and takes).

Bad input is reported as one ``error:`` line (exit code 2), without a traceback. So is a GPU
node whose GPUs this torch cannot use: ``info``, ``run`` and ``measure`` stop before any work instead
of running on the CPU (``lab_utils.engine.environment.check_gpu_node``).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import signal
import sys
from dataclasses import fields
from pathlib import Path

from lab_utils.engine import proc
from lab_utils.learn.errors import LabError, LaunchError

# Benchmarks live next to what they measure; each entry is "module:function(argv) -> int".
BENCHES = {
    "timers": ("lab_utils.app.bench_timers:main",
               "what the timers cost a training step (ResNet-18 and GPT, two batches): median paired ratio"),
    "allreduce": ("lab_utils.experiments.n04_allreduce.tables:bench_main",
                  "all-reduce bandwidth (nccl-tests columns) under torchrun"),
    "data": ("lab_utils.experiments.n08_speed_limits.tables:bench_data_main",
             "spec DataLoader vs device-resident loader, images/s"),
    "train": ("lab_utils.experiments.n08_speed_limits.tables:bench_train_main",
              "spec training vs each fast-path step, images/s"),
    "grading": ("lab_utils.app.grading.bench:main",
                "grading a class of solved notebooks, with and without the sandbox, s per notebook"),
}


def _prepare(args) -> int:
    from lab_utils.experiments.shared import data, text_data

    root = Path(args.data_dir) if args.data_dir else None
    path = data.prepare_cifar10(root)
    print(f"CIFAR-10 ready in {path}")
    corpus = text_data.prepare_corpus(root)
    print(f"text corpus ready: {corpus}")
    return 0


class Stopped(KeyboardInterrupt):
    """SIGTERM (scancel, a SLURM time limit, a requeue) during ``measure``: raised in the main thread so
    that every ``finally`` runs (the launcher stops its torchrun tree and removes its folder)."""


def _stop_on_sigterm(signum, frame) -> None:
    raise Stopped(signal.Signals(signum).name)


def parse_sets(settings_cls: type, base, sets: list[str]) -> dict:
    """``--set KEY=VALUE`` items as overrides of ``base`` (the profile's settings): each VALUE a Python
    literal, else a string; a single value where ``base`` holds a tuple becomes a 1-tuple."""
    known = {f.name for f in fields(settings_cls)}
    out = {}
    for item in sets:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key:
            raise LabError(f"--set takes KEY=VALUE, got {item!r}; e.g. --set batch_sizes=32,128.")
        try:
            value = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            value = text.strip()
        if key in known and isinstance(getattr(base, key), tuple) and not isinstance(value, tuple | list):
            value = (value,)
        out[key] = value
    return out


def _measure(args) -> int:
    """``measure``: the experiment's plan through :func:`lab_utils.engine.plan.measure` (or, with ``--nodes``,
    a multi-node job's file and its records: :mod:`lab_utils.engine.multinode`); one line per run."""
    from lab_utils.engine import multinode, plan, profiles
    from lab_utils.engine.session import session_for
    from lab_utils.experiments import registry

    experiment = registry.by_name(args.name)
    lab = session_for(args.profile)
    base = profiles.settings(experiment.settings, lab.profile.name)
    settings = profiles.override(base, experiment.name, **parse_sets(experiment.settings, base, args.sets))
    if args.nodes != 1 or args.job or args.collect:
        return multinode.main(lab, experiment, settings, args.nodes, args.job, args.collect, args.force)
    runs = plan.make_plan(experiment, settings, profile=lab.profile.name)
    print(f"{experiment.name} (notebook {experiment.notebook}), profile {lab.profile.name}: "
          f"{len(runs)} run(s)", flush=True)
    try:
        records = plan.measure(lab, experiment, settings, force=args.force, runs=runs)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    by_key = {rec.key: rec for rec in plan.aggregates(records)}
    for run in runs:
        print(plan.run_line(run.name, by_key.get(run.key)), flush=True)
    for name in dict.fromkeys(r.experiment for r in runs if r.skip is None):
        print(f"records: {lab.store.path(name)}")
    return 0


def _gpu_node_guard(profile: str | None) -> tuple[str, str]:
    """Stop before any work when the driver reports GPUs that torch cannot use (LabError). An unknown
    profile is refused first, before torch loads (seconds). Returns the profile's name and why."""
    from lab_utils.engine import config

    name, why = config.resolve_profile_name(profile)
    from lab_utils.engine.environment import check_gpu_node  # imports torch

    check_gpu_node(name, why)
    return name, why


def _info(args) -> int:
    name, why = _gpu_node_guard(args.profile)
    from lab_utils.engine import hardware
    from lab_utils.experiments.shared import data

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

    ms = sub.add_parser("measure", help="measure one experiment's plan into the result store (what its "
                                        "notebook measures; SLURM's jobs call it)",
                        description=MEASURE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    ms.add_argument("name", metavar="NAME", help="the experiment (e.g. scaling, compute_vs_comm)")
    ms.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    ms.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="sets",
                    help="change one setting (repeatable): --set batch_sizes=32,128 --set epochs=1")
    ms.add_argument("--force", action="store_true", help="measure again what the store holds")
    ms.add_argument("--nodes", type=int, default=1, help="multi-node DDP: the nodes of the job (with --job)")
    ms.add_argument("--job", default=None, metavar="DIR",
                    help="with --nodes: write DIR/job.json for the torchrun agents (or, with --collect, "
                         "store what they wrote there)")
    ms.add_argument("--collect", action="store_true",
                    help="store the records the agents wrote into --job DIR")

    rp = sub.add_parser("report", help="write the hand-in: report.md, report.html and handin.json from the "
                                       "stored results and your notebooks")
    rp.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    rp.add_argument("--out", default=None, help="the hand-in folder (default: results/<profile>/handin)")
    rp.add_argument("--labs", default=None, help="the folder of your notebooks (default: labs/)")
    rp.add_argument("--check", action="store_true",
                    help="list what is not ready to hand in (placeholders, missing tables, quick or "
                         "synthetic numbers) and exit 1 if anything is")

    pr = sub.add_parser("prepare", help="download the datasets into data/ (needs internet)")
    pr.add_argument("--data-dir", default=None)

    b = sub.add_parser("bench", help="benchmarks: " + ", ".join(BENCHES))
    b.add_argument("name", nargs="?", choices=sorted(BENCHES), metavar="NAME",
                   help="; ".join(f"{k}: {v[1]}" for k, v in BENCHES.items()))
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for that benchmark (--help)")

    i = sub.add_parser("info", help="machine, versions, profile and data status")
    i.add_argument("--profile", default=None)

    d = sub.add_parser("doctor", help="first session on a GPU node: check what no CPU test can (<= 10 min)",
                       add_help=False)
    d.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the doctor (--help)")

    st = sub.add_parser("student", help="build the student copy and the grading bundle (otter assign)",
                        description=STUDENT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    st.add_argument("--out", default="dist", help="output folder (default: dist): student/ and grading/")
    st.add_argument("--discussion", action="store_true",
                    help="build the post-deadline copy instead: the student copy with the discussion cells "
                         "in, DIR/discussion/ (the grading bundle is left as it is)")
    st.add_argument("notebooks", nargs="*", help="only these notebooks (e.g. 01 02; default: every "
                                                 "notebook with an '# ASSIGNMENT CONFIG' cell)")

    g = sub.add_parser("grade", help="grade handed-in notebooks, each in a sandbox, into a gradebook",
                       description=GRADE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("submissions", metavar="SUBMISSIONS",
                   help="a folder (or zip file) of handed-in notebooks: <student>/NN_*.ipynb, "
                        "<student>.ipynb, LMS exports, zips")
    g.add_argument("--bundle", default="dist/grading", help="the grading bundle (default: dist/grading)")
    g.add_argument("--out", default="grades", help="where the gradebook and feedback/ go (default: grades)")
    g.add_argument("--roster", default=None, help="CSV of the class (columns student and/or id): students "
                                                  "without a submission get a row with 0")
    g.add_argument("--student", default=None, help="regrade only this student (name or id); the others' "
                                                   "grades are kept")
    g.add_argument("--jobs", type=int, default=2, help="notebooks graded at once (default: 2)")
    g.add_argument("--timeout", type=float, default=120,
                   help="seconds one notebook may take before it is stopped (default: 120)")
    g.add_argument("--case-timeout", type=float, default=20,
                   help="seconds one case may take (an endless loop in a function; default: 20)")
    g.add_argument("--no-sandbox", action="store_true",
                   help="grade without bwrap: the submissions' code runs with your rights "
                        "(see docs/grading.md)")

    fo = sub.add_parser("fold", help="fold points given by hand into the gradebook and feedback",
                        description=FOLD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    fo.add_argument("hand_points", metavar="HAND_POINTS_CSV",
                    help="CSV: student, question, points[, comment]")
    fo.add_argument("--out", default="grades", help="the gradebook folder (default: grades)")

    dc = sub.add_parser("docs", help="write docs/generated/ (time budget, question map, hand-in) from the "
                                     "code", add_help=False)
    dc.add_argument("args", nargs=argparse.REMAINDER, help="arguments for docs (--help)")
    return p


MEASURE_HELP = """Measure one experiment's plan (what its notebook measures) into the result store.

NAME is an experiment of lab_utils/experiments/registry.py (an unknown name lists them). Its settings
are the profile's (its Settings' QUICK or FULL), changed by --set KEY=VALUE: the value is read as a
Python literal (32,128 is a tuple; a single value where the setting holds a tuple becomes one);
None keeps the profile's value. The plan is made for this machine (its GPUs, or gloo CPU processes);
what is already stored from the same devices is not measured again (--force measures it again);
a run that cannot run here is a row saying why. One line per run, then where the records are.
The notebook measuring the same settings finds them stored and measures nothing.

SIGTERM or Ctrl-C stops the running launch and its processes; what was stored is kept (run again
to resume). Exit status: 0 done, 1 a run failed (the error names it; measured again next time),
2 bad input, 130/143 stopped.

Multi-node DDP (slurm/multinode.sbatch): --nodes N --job DIR writes DIR/job.json, the runs of the
plan that use all N nodes (N x the GPUs of this node, or gloo processes) and are not stored yet,
for one torchrun agent per node (python -m torch.distributed.run --nnodes N ... -m WORKER
DIR/job.json; WORKER is the job's "worker"); nothing to measure: no job.json. Then --collect
stores the records the agents wrote into DIR (the same NAME, settings and --nodes)."""

STUDENT_HELP = """Build the student copy of the lab and the grading bundle from the notebooks in labs/.

Every labs/NN_*.ipynb with an '# ASSIGNMENT CONFIG' cell is a master notebook (otter assign v7
format). The answers of every test case are computed from the master's own solution; otter assign
then writes the student notebooks. Output:
  DIR/student/           what students get (clone or unpack): labs/ with the student notebooks
                         (no solution, no hidden test, no discussion: a cell the master tags
                         "discussion" leaves one line "Discussed after the deadline."; public checks
                         for grader.check), lab_utils/, the Makefile and requirements; no master, no
                         test, no bundle
  DIR/discussion/        with --discussion, instead: the same copy with the discussion cells in, to
                         publish after the deadline (make discussion)
  DIR/grading/           the grading bundle (keep it): manifest.json, NN_*.json (every case with
                         its expected answer), otter/ (otter's autograder zips, for otter or
                         Gradescope; make grade does not use them)
The build stops with one sentence if an exercise cannot be built or anything solution-like
reaches the student copy."""

GRADE_HELP = """Grade handed-in notebooks (no GPU needed), each in its own sandbox.

Build the bundle first (make student). SUBMISSIONS is a folder (or a zip file) holding
  <student>/NN_*.ipynb         one folder per student (student = folder name),
  <student>.ipynb              one notebook per student (student = file stem),
  LMS exports                  Canvas name_userid_submissionid_NN_....ipynb, Moodle
                               "Full Name_id_assignsubmission_file_" folders (id = student id),
  *.zip                        unpacked (only .ipynb members).
A student's latest file of a notebook is graded (modification time, then resubmission number);
the others are listed. The notebook is recognized from the stamp make student writes into its
metadata (else its title; a file name alone is "not this lab's notebook"). 00 and 08 hold no
exercise ("nothing to grade"); a file that cannot be read says why; other files (a PDF) are listed
in their student's row.

Only the exercise functions (with the imports, definitions and constants they use) run, in a
bubblewrap sandbox (no network, no file of yours, limits on time, memory, file size and
processes), each question in a process of its own, on the bundle's cases; answers are compared
outside the sandbox. Without bwrap the command stops unless you give --no-sandbox on purpose.

Writes OUT/gradebook.csv (one row per student: id, one column per question named after the
assignment's question, e.g. "Q3.2 ring bytes (04-b)", total, flags, notes), details.csv
(one row per question: points, file, flag, the reason for lost points), feedback/<student>.md,
hand_points_template.csv and grading.json (what later runs, --student and fold build on).
Exit status 1 when a submission could not be graded (its rows say why)."""

FOLD_HELP = """Fold points given by hand into the gradebook and feedback.

HAND_POINTS_CSV has the columns student (name or id), question, points, and optionally comment
(start from OUT/hand_points_template.csv, written by grade). Points for an autograded question
replace the automatic ones (e.g. after checking a flagged answer by hand). Folding again updates;
grading again keeps what was folded."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["doctor"], ["docs"]):  # their options (--only, --check, --help) are their own parsers'
        args = argparse.Namespace(command=argv[0], args=argv[1:])
    else:
        args = build_parser().parse_args(argv)
    try:
        if args.command == "run":
            # A signal while the runner loads (seconds) is noted, and the run ends with its line and report.
            with proc.StopSignals() as stop:
                from lab_utils.app import runner

                runner.resolve_notebooks(args.notebooks)  # a wrong name: one line before torch loads
                _gpu_node_guard(args.profile)
                return runner.main(args.notebooks, args.profile, args.timeout, stop=stop)
        if args.command == "measure":
            # before the GPU-node guard and torch load (seconds): a SIGTERM while they do ends with the line
            # too, instead of killing the process silently
            previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
            try:
                _gpu_node_guard(args.profile)
                return _measure(args)
            finally:
                signal.signal(signal.SIGTERM, previous)
        if args.command == "report":
            from lab_utils.app import handin

            return handin.main(args.profile, args.out, args.check, args.labs)
        if args.command == "prepare":
            return _prepare(args)
        if args.command == "bench":
            if args.name is None:  # a bare `bench`: say which there are, not argparse's "NAME, args required"
                print("python -m lab_utils bench NAME [--help]: name one of these benchmarks:",
                      file=sys.stderr)
                for k, (_, what) in BENCHES.items():
                    print(f"  {k:10s} {what}", file=sys.stderr)
                return 2
            module, func = BENCHES[args.name][0].split(":")
            return int(getattr(importlib.import_module(module), func)(args.args) or 0)
        if args.command == "info":
            return _info(args)
        if args.command == "doctor":
            from lab_utils.app import doctor

            return doctor.main(args.args)
        if args.command == "docs":
            from lab_utils.app import docs

            return docs.main(args.args)
        if args.command == "student":
            from lab_utils.app.grading import build

            build.build(args.out, notebooks=args.notebooks or None, discussion=args.discussion)
            return 0
        if args.command == "grade":
            from lab_utils.app.grading import grade, sandbox

            limits = sandbox.Limits(wall_seconds=args.timeout, case_seconds=args.case_timeout)
            return grade.grade(args.submissions, args.bundle, args.out, roster=args.roster,
                               student=args.student, jobs=args.jobs, limits=limits,
                               use_sandbox=not args.no_sandbox)
        if args.command == "fold":
            from lab_utils.app.grading import gradebook

            n = gradebook.fold(args.hand_points, args.out)
            print(f"folded {n} point(s) given by hand into {args.out}/gradebook.csv and {args.out}/feedback/")
            return 0
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        if isinstance(e, Stopped):
            print(f"stopped by {e}: the running launch and its processes were stopped; records already "
                  "stored are kept (run again to resume).", file=sys.stderr)
            return 143
        print("interrupted: results already recorded are kept in results/.", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
