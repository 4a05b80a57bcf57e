"""An experiment is a plan of runs, and THE ``measure`` that carries out any plan.

An :class:`Experiment` says *what* to measure: ``plan(settings, machine, profile)`` returns a list of
:class:`Run`, a pure function of the settings and the machine, so the same plan serves the notebook,
the time budget, doctor and SLURM (``python -m lab_utils measure``). :func:`measure` says *how*, once
for every experiment:

1. **Placement** is the plan's. A run that cannot run here carries ``skip`` ("needs 4 GPUs"): a row
   that says so, never a number, not stored (a bigger machine measures it later).
2. **Reuse**: a configuration stored from this machine's devices is not measured again unless
   ``force``; a ``together`` group (one comparison) is reused only whole, from one launch. Every run's
   config carries its worker's ``METRICS_VERSION`` (:func:`versioned`): a record an older lab stored,
   under other meanings, is measured again, and ``measure`` says so.
3. **The launch**: the runs of one ``group`` still to measure go to their worker as ONE JSON job (one
   start-up). GPU work always goes through ``torchrun``, so the notebook's kernel never opens a CUDA
   context; ``in_process`` runs (CPU only) call the same worker code in this process.
4. **Out of memory** ends its group: its later runs (larger batches) are rows "not tried: <label>
   ran out of memory"; a stored ``oom`` does the same on resume.
5. **Any other failure** stores an ``error`` record for its run (measured again next time); the rest
   of its launch are rows that say so, the other groups go on, and one
   :class:`~lab_utils.learn.errors.LaunchError` at the end names every failed run.

Records travel one way: worker -> records file -> this process -> the store -> the caller, which gets
every record of the plan, per-rank ones included, in plan order (each run's aggregate first).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from types import ModuleType
from typing import Any

import torch

from lab_utils.engine import launcher
from lab_utils.engine.backends import pinned_threads
from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import hardware_summary
from lab_utils.engine.harness import Job, execute
from lab_utils.engine.machine import Machine
from lab_utils.engine.records import (
    METRICS_VERSION_KEY,
    Record,
    aggregates,
    canonical_key,
    configuration_key,
    failures_to,
    jsonable,
    ranks_of,
    run_key,
)
from lab_utils.engine.session import session_for
from lab_utils.engine.store import ResultStore
from lab_utils.learn.errors import LabError, LaunchError, first_line

__all__ = ["Experiment", "Run", "aggregates", "make_plan", "measure", "not_tried", "skipped_row", "versioned"]


@dataclass(frozen=True)
class Run:
    """One configuration to measure: what keys its record, what executes it, and where. Runs of one
    ``group`` share one launch, in plan order, and the out-of-memory rule."""

    experiment: str
    config: dict[str, Any]             # the record's configuration (the resume key), what the worker gets
    worker: ModuleType | None = None   # a worker module (run_config), what torchrun starts
    processes: int = 1                 # ranks
    device: str = "cpu"                # "cuda" or "cpu": a stored record must match its name and count
    group: str | None = None
    together: bool = False             # the group is one comparison (reused only whole)
    skip: str | None = None            # why it cannot run here (a row)
    in_process: bool = False           # a CPU run executed in this process
    threads: int | None = None         # torch threads per process on a CPU
    timeout_s: float = 3600.0
    options: dict[str, Any] = field(default_factory=dict)  # worker inputs outside the key (a checkpoint)
    label: str = ""                    # how progress lines and rows name the run

    @property
    def key(self) -> str:
        return canonical_key(self.config)

    @property
    def name(self) -> str:
        return self.label or self.key

    def hardware(self) -> dict[str, Any]:
        """What a record of this run says of its devices here (the reuse check compares it); no device
        name for GPUs this machine does not have (a plan made for another machine)."""
        if self.device == "cuda" and not torch.cuda.is_available():
            return {"device_type": "cuda", "device_name": None, "device_count": self.processes}
        return hardware_summary(self.device, self.processes)


@dataclass(frozen=True)
class Experiment:
    """One experiment of a notebook: its settings and its plan, and what the time budget and
    doctor need of it. ``name`` is also the command line's (``python -m lab_utils measure NAME``).

    ``cost(run)``: seconds one run takes on the budget's node (:data:`lab_utils.engine.machine.BUDGET_NODE`),
    start-up excluded (the time budget adds it per launch). ``doctor(full_settings)``: the smallest
    full-profile settings, which doctor measures on the node through :func:`measure`. ``also_in``: the
    earlier notebooks that measure it too (notebook 02 runs notebook 04's all-reduce benchmark), where the
    time budget counts its runs first.
    """

    name: str
    notebook: str
    settings: type
    plan: Callable[[Any, Machine, str], list[Run]]
    cost: Callable[[Run], float] | None = None
    doctor: Callable[[Any], Any] | None = None
    title: str = ""
    also_in: tuple[str, ...] = ()


def skipped_row(run: Run, reason: str | None = None) -> Record:
    """The row of a run that is not measured (not stored: it follows from the plan or another row)."""
    return Record(run.experiment, dict(run.config), status="skipped", reason=reason or run.skip,
                  hardware={"device_type": run.device, "device_name": None, "device_count": run.processes})


def not_tried(run: Run, oom: Run) -> Record:
    """The row of a run after ``oom``, an earlier run of its group, ran out of memory."""
    return skipped_row(run, f"not tried: {oom.label or 'a smaller configuration'} already ran out of memory")


def run_line(label: str, rec: Record | None) -> str:
    """A progress line: the run's label, its record's status, and the training seconds or the reason."""
    if rec is None:
        return f"  {label:<28} {'missing':<8} no record"
    seconds = rec.metrics.get("train_seconds")
    detail = f"train_seconds {seconds:.3f}" if isinstance(seconds, int | float) and rec.status == "ok" else (
        rec.reason or "")
    return f"  {label:<28} {rec.status:<8} {detail}".rstrip()


def make_plan(experiment: Experiment, settings: Any, machine: Machine | None = None,
              profile: str = "full") -> list[Run]:
    """``experiment.plan`` on validated settings (``machine``: this one by default), every run
    :func:`versioned`."""
    validate = getattr(settings, "validate", None)
    settings = (validate() or settings) if callable(validate) else settings
    return [versioned(run) for run in experiment.plan(settings, machine or Machine.here(), profile)]


def versioned(run: Run) -> Run:
    """``run`` with ``metrics_version`` in its config (part of the resume key): its worker module's
    ``METRICS_VERSION``, which a worker bumps when one of its metrics changes meaning, so that a record
    stored under another version, or under none (a lab older than the key), is measured again, not
    reused. A run without a worker (a row the plan gives) is returned as it is."""
    if run.worker is None:
        return run
    version = getattr(run.worker, "METRICS_VERSION", None)
    if not isinstance(version, int) or isinstance(version, bool):
        raise LabError(f"Worker {run.worker.__name__} defines no METRICS_VERSION (an int): every worker "
                       "names the version of its metrics, which is part of each record's key.")
    if run.config.get(METRICS_VERSION_KEY) == version:
        return run
    return replace(run, config={**run.config, METRICS_VERSION_KEY: version})


def _older_lab_line(stored: Sequence[Record], run: Run) -> str | None:
    """The sentence for a run whose configuration is among ``stored`` (its experiment's records) only
    under another metrics version."""
    want = configuration_key(run.config)
    old = next((r for r in reversed(stored) if r.key != run.key and configuration_key(r.config) == want),
               None)
    if old is None:
        return None
    was = old.config.get(METRICS_VERSION_KEY)
    return (f"{run.experiment}: {run.name}: the stored record is from an older lab (metrics version "
            f"{was if was is not None else 'none'}, now {run.config[METRICS_VERSION_KEY]}): measured again")


# --------------------------------------------------------------------------- measure


def measure(lab: Any, experiment: Experiment, settings: Any, force: bool = False, verbose: bool = True,
            machine: Machine | None = None, runs: Sequence[Run] | None = None) -> list[Record]:
    """Carry out ``experiment``'s plan for ``settings`` on this machine (see the module docstring).

    ``lab``: the notebook's session (its profile and store), or a profile name. ``runs``: a plan
    already made (a subset chosen on the command line, doctor's). Returns every record, plan order.
    """
    lab = session_for(lab)
    profile = lab.profile.name
    runs = make_plan(experiment, settings, machine, profile) if runs is None else [versioned(r) for r in runs]
    for run in runs:
        if run.device == "cuda" and run.in_process:
            raise LabError(f"The plan marks {run.name} in_process on a GPU: GPU work runs through the "
                           "launcher, never in the notebook's kernel.")
        if run.worker is None and run.skip is None:
            raise LabError(f"Run {run.name} names no worker: the experiment's plan must give one.")
    results: dict[int, list[Record]] = {}
    failed: list[str] = []
    measured: list[str] = []
    for members in groups(runs):
        _group(lab.store, profile, runs, members, force, verbose, results, failed, measured)
    if verbose and runs:
        print(f"{experiment.name}: measured now: {', '.join(measured) or 'nothing (all from the store)'}",
              flush=True)
    if failed:
        raise LaunchError(f"{len(failed)} run(s) of {experiment.name} failed; their rows say why, they are "
                          "measured again next time, and the records stored before are kept: "
                          + "; ".join(failed))
    return [rec for i in range(len(runs)) for rec in results.get(i, [])]


def groups(runs: Sequence[Run]) -> list[list[int]]:
    """The runs' indices grouped by ``group`` (a run without one is alone), in plan order."""
    groups: dict[Any, list[int]] = {}
    for i, run in enumerate(runs):
        groups.setdefault(run.group if run.group is not None else ("alone", i), []).append(i)
    return list(groups.values())


def _group(store: ResultStore, profile: str, runs: Sequence[Run], members: list[int], force: bool,
           verbose: bool, results: dict[int, list[Record]], failed: list[str], measured: list[str]) -> None:
    """One group: rows for skipped runs, reuse, then one launch for the rest, and the OOM rule."""
    for i in members:
        if runs[i].skip is not None:
            results[i] = [skipped_row(runs[i])]
    live = [i for i in members if runs[i].skip is None]
    if not live:
        return
    together = any(runs[i].together for i in live)
    found = {} if force else {i: rec for i in live
                              if (rec := store.reusable(runs[i].experiment, runs[i].config,
                                                        runs[i].hardware())) is not None}
    if together and (len(found) < len(live) or len({r.metrics.get("run_id") for r in found.values()}) > 1):
        found = {}
    unfound = [i for i in live if i not in found]
    if verbose and not force and unfound:
        stored: dict[str, list[Record]] = {}  # one read of each experiment's records for the group
        for i in unfound:
            exp = runs[i].experiment
            if exp not in stored:
                stored[exp] = store.records(exp)
            if (line := _older_lab_line(stored[exp], runs[i])) is not None:
                print(line, flush=True)
    todo: list[int] = []
    oom: Run | None = None
    for i in live:  # the out-of-memory rule on what is stored: nothing after a stored oom is tried
        if oom is not None:
            results[i] = [not_tried(runs[i], oom)]
        elif i in found:
            results[i] = [found[i], *_stored_ranks(store, runs[i])]
            oom = runs[i] if found[i].status == "oom" else None
        else:
            todo.append(i)
    if not todo:
        return
    got, failure = _launch(store, profile, [runs[i] for i in todo], together, verbose)
    measured += [runs[i].name for i in todo if runs[i].key in got]
    for i in todo:
        run = runs[i]
        if oom is not None:
            results[i] = [not_tried(run, oom)]
        elif run.key in got:
            results[i] = got[run.key]
            oom = run if got[run.key][0].status == "oom" else None
        elif failure is not None and failure.get("status") != "not run":  # the run the launch was on
            status = "oom" if failure.get("status") == "oom" else "error"
            rec = Record(run.experiment, dict(run.config), status=status, reason=failure.get("reason"),
                         profile=profile, hardware=run.hardware())
            results[i] = [_store(store, rec)]
            if status == "oom":
                oom = run
            else:
                failed.append(f"{run.name}: {failure.get('reason')}")
                failure = {"status": "not run",
                           "reason": f"not run: {run.name}, before it in its launch, failed"}
        else:  # never started (an earlier run of its launch failed), or no record came back: not stored
            why = (failure["reason"] if failure is not None
                   else "the worker ended without a record for it; check its log")
            results[i] = [Record(run.experiment, dict(run.config), status="error", profile=profile,
                                 hardware=run.hardware(), reason=why)]
            if failure is None:
                failed.append(f"{run.name}: no record")


def _stored_ranks(store: ResultStore, run: Run) -> list[Record]:
    """The per-rank records stored with a reused run's record (none for a one-process worker's)."""
    return ranks_of(run, store.latest(run.experiment))


def _store(store: ResultStore, rec: Record) -> Record:
    """Append one record through the store's door (the parent alone writes the store)."""
    return store.run_many(rec.experiment, [rec.config], lambda todo: [rec], force=True)[0] or rec


def _launch(store: ResultStore, profile: str, todo: list[Run], together: bool,
            verbose: bool) -> tuple[dict[str, list[Record]], dict[str, Any] | None]:
    """Measure ``todo`` (one group) in one job, storing each record as it arrives.

    Returns ({run key: its records, aggregate first}, the failure that ended the job, or None).
    """
    first = todo[0]
    job = Job(experiment=first.experiment, profile=profile, configs=[jsonable(dict(r.config)) for r in todo],
              options=jsonable(dict(first.options)))
    if verbose:
        where = "in this process" if first.in_process else f"{first.processes} process(es), {first.device}"
        print(f"{first.experiment}: measuring {', '.join(r.name for r in todo)} ({where}) ...", flush=True)
    keys = {r.key for r in todo}
    run_id = uuid.uuid4().hex[:12] if together else None
    got: dict[str, list[Record]] = {}

    def last_word(failure: dict[str, Any]) -> None:
        """An in-process run ended by the watchdog (its thread, just before the exit): store its row."""
        i = failure.get("config_index")
        if isinstance(i, int) and 0 <= i < len(todo):
            run = todo[i]
            _store(store, Record(run.experiment, dict(run.config), status=failure["status"],
                                 reason=failure["reason"], profile=profile, hardware=run.hardware()))

    try:
        with failures_to(last_word):
            for rec in _records(first, job):
                if run_id is not None:  # fewer records with this run_id than group_runs: stopped part-way
                    rec.metrics.update(run_id=run_id, group_runs=len(todo))
                rec.profile = rec.profile or profile
                _store(store, rec)
                key = run_key(rec)
                if key in keys:
                    group = got.setdefault(key, [])
                    group.insert(0 if rec.key == key else len(group), rec)
    except LaunchError as e:
        if verbose:
            print(f"{first.experiment}: {e}", flush=True)
        return got, e.failure or {"status": "error", "reason": first_line(e, 300)}
    return got, None


def _records(run: Run, job: Job) -> Iterator[Record]:
    """The job's records as they are written: from this process, or from the launched workers."""
    if run.in_process:
        with pinned_threads(run.threads):
            for records in execute(run.worker, job, DistContext(device=torch.device("cpu"))):
                yield from records
        return
    yield from launcher.stream(run.worker.__name__, asdict(job), nproc=run.processes, timeout_s=run.timeout_s,
                               threads_per_rank=run.threads)
