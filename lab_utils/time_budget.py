"""How long each notebook takes in the ``full`` profile on a GPU node: an estimate to book GPU hours by.

No full-profile run of the lab on a GPU exists yet, so every number here is an
**estimate (no GPU run yet)** (:mod:`lab_utils.core.estimates` holds the cost model and says
every assumption), built from what the lab knows without one:

- *what the full profile runs*: each experiment's own plan
  (:func:`lab_utils.plan.make_plan` of :data:`lab_utils.experiments.registry.EXPERIMENTS` with the
  full profile's settings, for :data:`lab_utils.core.machine.BUDGET_NODE`), so the estimate
  follows the settings and the plans when they change: a notebook's time is the sum of
  ``experiment.cost(run)`` over its runs, plus one start-up per launch group
  (:data:`~lab_utils.core.estimates.LAUNCH_S`, or :data:`~lab_utils.core.estimates.IN_PROCESS_RUN_S`
  for an in-process group) and :data:`~lab_utils.core.estimates.NOTEBOOK_START_S` per notebook;
- notebooks run in order (01 ... 08), so a run an earlier notebook already planned (notebook 03's
  T(1), from notebook 02) is not counted again;
- a notebook whose experiments are not in the registry yet keeps its hand-written cost model
  (:data:`_LEGACY`, one function per notebook, each deleted when its notebook registers).

>>> budget_table()            # doctest: +SKIP  (one row per notebook, and a total)
>>> budget_line("01")         # doctest: +SKIP  (the one-line Markdown a notebook shows)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from lab_utils import questions
from lab_utils.core import config, profiles
from lab_utils.core.errors import LabError
from lab_utils.core.estimates import (
    COMPILE_S,
    IN_PROCESS_RUN_S,
    LABEL,
    LAUNCH_S,
    NODE,
    NOTEBOOK_START_S,
    TINY_SHAKESPEARE_CHARS,
    fast_epoch_seconds,
    gpt_epoch_seconds,
    spec_epoch_seconds,
    test_pass_seconds,
)
from lab_utils.core.machine import BUDGET_NODE
from lab_utils.experiments import comm, fastpath, gpt, large_batch, quantize, registry, sweep
from lab_utils.models.gpt import gpt_config, train_flops_per_token
from lab_utils.plan import make_plan


def notebooks() -> dict[str, str]:
    """``{"01": "batch size sweep", ...}``: every notebook of ``labs/`` and its topic (its file name)."""
    out = {}
    for path in sorted(config.labs_dir().glob("[0-9][0-9]_*.ipynb")):
        number, _, topic = path.stem.partition("_")
        out[number] = topic.replace("_", " ")
    return out


def answers(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: what a notebook answers (the README's question map)."""
    return questions.labels_for(_check(notebook)).replace(questions.PART2, "Part 2 project")


@dataclass(frozen=True)
class Part:
    """One piece of a notebook's estimated time: a run (``start_up`` False) or a start-up."""

    what: str
    seconds: float
    gpus: int = 1
    start_up: bool = False


def notebook_parts(notebook: str) -> list[Part]:
    """The pieces of one notebook's estimated full-profile time: its start-up, then each launch
    group's start-up and runs (the registry's plans), or the legacy model of an unregistered one."""
    nb = _check(notebook)
    return [Part("start-up", NOTEBOOK_START_S, 0, start_up=True), *_lab_parts().get(nb, [])]


def _lab_parts() -> dict[str, list[Part]]:
    """Every notebook's runs, in notebook order: a run an earlier notebook planned is not counted again."""
    seen: set[tuple[str, str]] = set()
    out: dict[str, list[Part]] = {}
    for nb in notebooks():
        experiments = registry.for_notebook(nb)
        if experiments:
            out[nb] = [p for e in experiments for p in plan_parts(e, seen)]
        elif nb in _LEGACY:
            out[nb] = _LEGACY[nb]()
    return out


def plan_parts(experiment, seen: set[tuple[str, str]] | None = None) -> list[Part]:
    """``experiment``'s full-profile plan for the budget's node as parts: each run's
    ``experiment.cost(run)`` and one start-up per launch group (``LAUNCH_S``, or ``IN_PROCESS_RUN_S``
    for an in-process one). Runs that cannot run on that node (``skip``) and runs in ``seen`` (planned
    by an earlier notebook, whose store this one reuses) are not counted; ``seen`` gets this plan's."""
    seen = set() if seen is None else seen
    if experiment.cost is None:
        raise LabError(f"Experiment {experiment.name!r} has no cost(run): the time budget cannot sum its "
                       "plan; "
                       "give its Experiment a cost function (lab_utils/experiments/README.md).")
    runs = make_plan(experiment, profiles.settings(experiment.settings, "full"), BUDGET_NODE, "full")
    parts: list[Part] = []
    started: set[object] = set()
    for i, run in enumerate(runs):
        if run.skip is not None or (run.experiment, run.key) in seen:
            continue
        seen.add((run.experiment, run.key))
        gpus = run.processes if run.device == "cuda" else 0
        group = run.group if run.group is not None else ("alone", i)
        if group not in started:
            started.add(group)
            cost = IN_PROCESS_RUN_S if run.in_process else LAUNCH_S
            parts.append(Part(f"start-up of {run.group or run.name}", cost, gpus, start_up=True))
        parts.append(Part(run.name, float(experiment.cost(run)), gpus))
    return parts


# --------------------------------------------------------------------------- legacy cost models
# One function per notebook whose experiments are not in experiments/registry.py yet. When a notebook's
# experiments register, its plan is summed instead and its function here is deleted
# (tests/test_time_budget.py fails until it is; and once every notebook is registered, _LEGACY goes).


def _legacy_01() -> list[Part]:
    s = profiles.settings(sweep.Settings, "full")
    return [Part(f"batch {b}: {s.epochs} epochs", IN_PROCESS_RUN_S + s.epochs * spec_epoch_seconds(1, b))
            for b in s.batch_sizes]


def _legacy_04() -> list[Part]:
    s = profiles.settings(comm.Settings, "full")
    return [Part(f"all-reduce benchmark, {p} ranks, 8 B ... 1 GiB", LAUNCH_S + 30.0, p)
            for p in s.bench_ranks]


def _legacy_05() -> list[Part]:
    s = profiles.settings(large_batch.Settings, "full")
    parts = []
    for run in large_batch.plan_runs(s, s.devices):
        n = run.devices
        parts.append(Part(f"{run.name}: {n} x {run.batch_per_device}, {s.epochs} epochs + tests",
                          LAUNCH_S + s.epochs * (spec_epoch_seconds(n, run.batch_per_device)
                                                 + test_pass_seconds(n)), n))
    parts.append(Part("communication accounting (a few steps on 2 and 4 ranks)", 2 * LAUNCH_S, s.devices))
    return parts


def _legacy_gpt_epoch(s, devices: int, micro_batch: int) -> float:
    cfg = gpt_config(s.size)
    windows = (int(0.9 * TINY_SHAKESPEARE_CHARS) - cfg.block_size) // (s.stride or cfg.block_size)
    return gpt_epoch_seconds(windows * cfg.block_size * train_flops_per_token(cfg), devices, micro_batch)


def _legacy_06() -> list[Part]:
    s = profiles.settings(gpt.Settings, "full")
    parts = [Part(f"scaling {n} x {b}", LAUNCH_S + s.scaling_epochs * 1.1 * _legacy_gpt_epoch(s, n, b), n)
             for n in s.scaling_devices for b in s.scaling_batch_sizes]
    acc_devices = s.accumulation_devices or 4
    parts += [Part(f"accumulation micro-batch {mb}", LAUNCH_S + s.accumulation_epochs * 1.1
                   * _legacy_gpt_epoch(s, acc_devices, mb), acc_devices) for mb in s.micro_batches]
    parts.append(Part("final model for notebook 07", LAUNCH_S + s.train_epochs * 1.1
                      * _legacy_gpt_epoch(s, 4, s.train_batch_size), 4))
    return parts


def _legacy_07() -> list[Part]:
    s = profiles.settings(quantize.Settings, "full")
    # evaluation tokens + timed generation, per variant: 45 s on the CPU, 10 s on the GPU
    return [Part(f"{len(s.variants)} variants on {device}", len(s.variants) * per)
            for device, per in (("cpu", 45.0), ("cuda", 10.0))]


def _legacy_08() -> list[Part]:
    s = profiles.settings(fastpath.Settings, "full")
    spec = spec_epoch_seconds(1, s.batch_size)
    fast = fast_epoch_seconds("bf16")
    parts = [Part("loader alone (2 pipelines)", 2 * (IN_PROCESS_RUN_S + s.data_min_seconds))]
    for step in s.steps:
        fp32 = step in ("device_loader", "channels_last")  # before the bf16 step
        one = spec if step == "spec" else fast_epoch_seconds("tf32" if fp32 else "bf16")
        compile_s = COMPILE_S if step == "compile" else 0.0
        parts.append(Part(f"waterfall: {step}", IN_PROCESS_RUN_S + one + compile_s))
    parts.append(Part("profiler trace", IN_PROCESS_RUN_S + COMPILE_S))
    if s.accuracy_epochs:
        parts.append(Part(f"accuracy: spec, {s.accuracy_epochs} epochs + tests",
                          IN_PROCESS_RUN_S + s.accuracy_epochs * (spec + test_pass_seconds(1))))
        parts.append(Part(f"accuracy: fastest, {s.accuracy_epochs} epochs + tests",
                          IN_PROCESS_RUN_S + COMPILE_S + s.accuracy_epochs * 1.2 * fast))
    return parts


_LEGACY: dict[str, Callable[[], list[Part]]] = {"01": _legacy_01, "04": _legacy_04, "05": _legacy_05,
                                                 "06": _legacy_06, "07": _legacy_07, "08": _legacy_08}


def _check(notebook: str) -> str:
    nb = str(notebook).strip()
    nb = nb.zfill(2) if nb.isdigit() else nb
    if nb not in notebooks():
        raise LabError(f"No notebook {notebook!r}; use one of: {', '.join(notebooks())}.")
    return nb


def estimate_minutes(notebook: str, parts: list[Part] | None = None) -> int:
    """Estimated full-profile wall time of one notebook, whole minutes rounded up."""
    return math.ceil(sum(p.seconds for p in parts or notebook_parts(notebook)) / 60)


def _gpus(notebook: str, parts: list[Part] | None = None) -> str:
    counts = sorted({p.gpus for p in parts or notebook_parts(notebook) if p.gpus})
    if not counts:
        return "any"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _largest(parts: list[Part]) -> str:
    runs = [p for p in parts if not p.start_up]
    if not runs:
        return "start-up"
    top = max(runs, key=lambda p: p.seconds)
    return f"{len(runs)} runs; longest: {top.what} (~{math.ceil(top.seconds / 60)} min)"


def budget_table():
    """One row per notebook (and a total): estimated full-profile minutes on a 4 x H100 SXM node."""
    import pandas as pd

    lab = _lab_parts()  # the plans are made once for the whole table
    rows = []
    for nb, topic in notebooks().items():
        parts = [Part("start-up", NOTEBOOK_START_S, 0, start_up=True), *lab.get(nb, [])]
        rows.append({"notebook": nb, "topic": topic, "answers": answers(nb), "GPUs": _gpus(nb, parts),
                     "estimated minutes": estimate_minutes(nb, parts),
                     "what takes the time": _largest(parts)})
    total = sum(r["estimated minutes"] for r in rows)
    rows.append({"notebook": "all", "topic": "the whole lab, in order", "answers": "",
                 "GPUs": "1-4", "estimated minutes": total,
                 "what takes the time": f"~{total / 60:.1f} GPU-node hours"})
    return pd.DataFrame(rows)


def budget_markdown() -> str:
    """:func:`budget_table` as the Markdown table the README carries (a test keeps them equal)."""
    return budget_table().to_markdown(index=False)


def budget_line(notebook_number: str) -> str:
    """One line of Markdown for a notebook's first cell: its estimated full-profile wall time."""
    nb = _check(notebook_number)
    parts = notebook_parts(nb)
    return (f"**Time budget (full profile, {NODE} node): ~{estimate_minutes(nb, parts)} min** for notebook "
            f"{nb} ({notebooks()[nb]}, GPUs: {_gpus(nb, parts)}), {LABEL}; the quick profile on a CPU takes "
            "a few minutes. How it is estimated: README, *Time budget*.")
