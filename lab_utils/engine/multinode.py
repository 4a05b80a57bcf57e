"""Multi-node DDP (``slurm/multinode.sbatch``): an experiment's runs across N nodes as ONE job file for
the torchrun agents that srun starts (one per node, meeting at a c10d rendezvous), and their records
stored through the store's door.

Why not :func:`lab_utils.engine.plan.measure` itself: its launcher starts ``torchrun`` on this node, and a
multi-node launch is one agent per node started by ``srun``, with its folder on storage every node
sees (global rank 0 may be on any node). So the job script keeps that launch::

    python -m lab_utils measure NAME --nodes N --job DIR [--set ...]    # DIR/job.json, DIR/job.env
    srun ... python -m torch.distributed.run --nnodes N --nproc-per-node $NPROC_PER_NODE \\
        --rdzv-backend c10d ... -m $WORKER DIR/job.json                    # the harness's JSON job
    python -m lab_utils measure NAME --nodes N --job DIR --collect [--set ...]

and everything else is the plan's: the runs are the experiment's own plan for a machine of N nodes'
devices (:func:`runs_across`), the job is the harness's, reuse is the store's (a resubmitted job
measures only what is missing), and an out-of-memory is a stored row after which the larger runs are
not tried. Each configuration's ``tag`` is ``nodes=N``, so a 2-node x 1-GPU record is never taken for
a 1-node x 2-GPU one. Each rank runs the plan's torch threads (``THREADS_PER_RANK`` in job.env, the
profile's ``cpu_threads`` for CPU processes), as the one-node launcher gives them, so that both
set-ups do the same arithmetic whatever CPUs the job has.

A launch that SLURM stopped (the job script then writes ``DIR/stopped``) is collected like any
other: what global rank 0 finished is stored; the configuration it was on reads ``stopped`` (not
stored, so a resubmitted job measures it), the ones after it "not run".
"""

from __future__ import annotations

import json
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from lab_utils.engine.launcher import write_job
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run, make_plan, run_line
from lab_utils.engine.records import Record, RecordsReader, jsonable, read_failures
from lab_utils.learn.errors import LabError

JOB_ENV = "job.env"  # WORKER, NPROC_PER_NODE and THREADS_PER_RANK, for the job script to source
STOPPED = "stopped"  # the job script's note that SLURM's signal stopped the launch (its name, a time)


def runs_across(experiment: Experiment, settings: Any, nodes: int, profile: str,
                machine: Machine | None = None) -> list[Run]:
    """The runs of ``experiment``'s plan (for a machine of ``nodes`` x this node's GPUs) that use every
    node: their process count a multiple of ``nodes``, all one launch (one world size, one worker), each
    configuration tagged ``nodes=N``. Raises :class:`LabError` when the plan has none or several."""
    if nodes < 2:
        raise LabError(f"--nodes must be 2 or more for a multi-node job, got {nodes}.")
    here = machine or Machine.here()
    runs = make_plan(experiment, settings, replace(here, gpus=here.gpus * nodes), profile)
    live = [r for r in runs if r.skip is None and r.processes >= nodes and r.processes % nodes == 0]
    if not live:
        reasons = sorted({r.skip for r in runs if r.skip})
        raise LabError(f"{experiment.name}'s plan has no run over {nodes} nodes here"
                       + (f" ({'; '.join(reasons)})" if reasons else "")
                       + "; choose its process count with --set (e.g. --set devices=N_NODES_x_GPUS).")
    shapes = {(r.processes, r.worker.__name__, r.experiment) for r in live}
    if len(shapes) > 1:
        raise LabError(f"{experiment.name}'s plan has runs of {len(shapes)} world sizes or workers "
                       f"({sorted(s[0] for s in shapes)}); one multi-node job is one launch: choose one with "
                       "--set.")
    if any("tag" not in r.config for r in live):
        raise LabError(f"{experiment.name}'s configurations have no 'tag' to mark them nodes={nodes}: a "
                       "multi-node record could not be told from a one-node one.")
    return [replace(r, config={**r.config, "tag": f"nodes={nodes}"}) for r in live]


def prepare(store, experiment: Experiment, runs: list[Run], folder: Path, profile: str,
            force: bool = False) -> list[Run]:
    """Write ``folder``/job.json (the runs not stored yet, smallest first; after a stored out-of-memory
    none) and ``folder``/job.env (``THREADS_PER_RANK`` empty when the plan leaves the threads to the
    launch, as for GPUs); returns the runs written (none: no files, nothing to launch)."""
    folder.mkdir(parents=True, exist_ok=True)
    for old in [folder / "job.json", folder / JOB_ENV, folder / "records.jsonl", folder / STOPPED,
                *folder.glob("failure-rank*.json")]:
        old.unlink(missing_ok=True)  # never collect an earlier launch's records
    todo = []
    for run in runs:
        rec = None if force else store.reusable(run.experiment, run.config, run.hardware())
        if rec is not None and rec.status == "oom":
            break  # a larger run needs more memory still
        if rec is None:
            todo.append(run)
    for run in runs:
        print(f"  {run.name:<28} {'to measure' if run in todo else 'in the store or not tried'}", flush=True)
    if todo:
        first = todo[0]
        write_job({"experiment": first.experiment, "profile": profile,
                   "configs": [jsonable(dict(r.config)) for r in todo],
                   "options": jsonable(dict(first.options)),
                   "worker": first.worker.__name__, "labels": [r.name for r in todo],
                   "hardware": jsonable(first.hardware())}, folder)
        (folder / JOB_ENV).write_text(f"WORKER={shlex.quote(first.worker.__name__)}\n"
                                      f"NPROC_PER_NODE={first.processes // _nodes(first)}\n"
                                      f"THREADS_PER_RANK={first.threads or ''}\n", encoding="utf-8")
    return todo


def _nodes(run: Run) -> int:
    return int(str(run.config["tag"]).removeprefix("nodes="))


def collect(store, folder: Path, profile: str) -> list[tuple[str, Record]]:
    """Store what the agents wrote into ``folder``: every record of ``records.jsonl`` (per-rank ones too),
    then, for the first configuration without a record, a ``stopped`` row when SLURM stopped the launch
    (``folder``/stopped; not stored, whatever a rank wrote as it was stopped), else for the one a failure
    file names an ``oom`` or ``error`` row (stored); configurations after it were never run (rows, not
    stored). Returns (label, row) per configuration of the job, in its order."""
    job = json.loads((folder / "job.json").read_text(encoding="utf-8"))
    configs, experiment = job["configs"], job["experiment"]
    got = RecordsReader(folder / "records.jsonl").new()
    stored = (store.run_many(experiment, configs, lambda todo: got, force=True) if got
              else [None] * len(configs))
    failures = read_failures(folder)
    failure = failures[0] if failures else None
    stop = folder / STOPPED
    stopped_by = (stop.read_text(encoding="utf-8").split() or ["a signal"])[0] if stop.is_file() else None
    rows, ended = [], None
    for i, (cfg, rec) in enumerate(zip(configs, stored, strict=True)):
        if rec is not None:
            rows.append(rec)
        elif ended is not None:
            rows.append(Record(experiment, cfg, status="skipped", reason=f"not run: {ended}",
                               profile=profile))
        elif stopped_by is not None:
            rows.append(Record(experiment, cfg, status="stopped", profile=profile,
                               reason=f"stopped by {stopped_by} (SLURM) before it finished; not stored: "
                                      "submit again to measure it"))
            ended = f"the job was stopped during configuration {i + 1}"
        elif failure is not None and failure.get("config_index") in (i, None):
            status = "oom" if failure.get("status") == "oom" else "error"
            row = Record(experiment, cfg, status=status, reason=failure.get("reason"), profile=profile,
                         hardware=job.get("hardware") or {})
            rows.append(store.run_many(experiment, [cfg], lambda todo, row=row: [row], force=True)[0] or row)
            ended = f"configuration {i + 1} of the job ended it ({status})"
        else:
            rows.append(Record(experiment, cfg, status="error", profile=profile,
                               reason="the agents wrote no record of it; check the job's log"))
            ended = ended or "an earlier configuration has no record"
    return list(zip(job.get("labels") or [str(i + 1) for i in range(len(rows))], rows, strict=True))


def main(lab, experiment: Experiment, settings: Any, nodes: int, job: str | None, collect_only: bool,
         force: bool) -> int:
    """``python -m lab_utils measure NAME --nodes N --job DIR [--collect]`` (see the module docstring)."""
    if not job:
        raise LabError("--nodes needs --job DIR: the folder (on storage every node sees) for the agents' "
                       "job.")
    folder = Path(job)
    profile = lab.profile.name
    if collect_only:
        if not (folder / "job.json").is_file():
            raise LabError(f"{folder} holds no job.json: run measure with --nodes and --job first.")
        rows = collect(lab.store, folder, profile)
        for label, rec in rows:
            print(run_line(label, rec), flush=True)
        print(f"records: {lab.store.path(rows[0][1].experiment)}" if rows else "records: none")
        return 1 if any(r.status == "error" for _, r in rows) else 0
    runs = runs_across(experiment, settings, nodes, profile)
    print(f"{experiment.name} (notebook {experiment.notebook}), profile {profile}: {len(runs)} run(s) on "
          f"{nodes} nodes x {runs[0].processes // nodes} process(es)", flush=True)
    todo = prepare(lab.store, experiment, runs, folder, profile, force)
    print(f"job: {folder / 'job.json'}" if todo else "nothing to measure: every run is in the store",
          flush=True)
    return 0
