"""How long each notebook takes in the ``full`` profile on a GPU node: an estimate to book GPU hours by.

No full-profile run of the lab on a GPU exists yet, so every number here is an **estimate (no GPU run yet)**
(:mod:`lab_utils.experiments.shared.estimates` holds the cost model and its assumptions). A notebook's time is
the sum of ``experiment.cost(run)`` over each of its experiments' own full-profile plan for
:data:`lab_utils.engine.machine.BUDGET_NODE` (so it follows the settings and plans when they change), plus one
start-up per launch group and one per notebook. Notebooks run in order, so a run an earlier notebook already
planned (notebook 03's T(1), from notebook 02) is not counted again.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lab_utils.app import questions
from lab_utils.engine import config, profiles
from lab_utils.engine.machine import BUDGET_NODE
from lab_utils.engine.plan import make_plan
from lab_utils.experiments import registry
from lab_utils.experiments.shared.estimates import (
    IN_PROCESS_RUN_S,
    LABEL,
    LAUNCH_S,
    NODE,
    NOTEBOOK_START_S,
)
from lab_utils.learn.errors import LabError


def notebooks() -> dict[str, str]:
    """``{"01": "batch size sweep", ...}``: every notebook of ``labs/`` and its topic (its file name)."""
    out = {}
    for path in sorted(config.labs_dir().glob(config.NOTEBOOK_GLOB)):
        number, _, topic = path.stem.partition("_")
        out[number] = topic.replace("_", " ")
    return out


def answers(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: what a notebook answers (the question map)."""
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
    group's start-up and runs (the registry's plans)."""
    return _lab_parts()[_check(notebook)]


def _lab_parts() -> dict[str, list[Part]]:
    """Every notebook's parts, in notebook order: a run an earlier notebook planned is not counted again."""
    seen: set[tuple[str, str]] = set()
    return {nb: [Part("start-up", NOTEBOOK_START_S, 0, start_up=True),
                 *(p for e in registry.for_notebook(nb) for p in plan_parts(e, seen))] for nb in notebooks()}


#: A plan names the data it trains on, and resolving it fails where the data is missing (offline, before
#: ``make prepare``); a run's cost does not depend on it, so the budget plans on the stand-ins.
_BUDGET_DATA = {"dataset": "synthetic", "corpus": "stdlib"}


def _budget_settings(experiment):
    """The full profile's settings of ``experiment``, its data fields on the stand-ins (see _BUDGET_DATA)."""
    fields = {f.name for f in dataclasses.fields(experiment.settings)}
    data = {k: v for k, v in _BUDGET_DATA.items() if k in fields}
    return profiles.settings(experiment.settings, "full", **data)


def plan_parts(experiment, seen: set[tuple[str, str]] | None = None) -> list[Part]:
    """``experiment``'s full-profile plan for the budget's node as parts: each run's cost and one
    start-up per launch group (``LAUNCH_S``, or ``IN_PROCESS_RUN_S`` in-process). Runs that cannot run
    there (``skip``) and runs in ``seen`` (an earlier notebook's) are not counted; ``seen`` gets these."""
    seen = set() if seen is None else seen
    if experiment.cost is None:
        raise LabError(f"Experiment {experiment.name!r} has no cost(run): the time budget cannot sum its "
                       "plan; give its Experiment a cost function (lab_utils/experiments/README.md).")
    runs = make_plan(experiment, _budget_settings(experiment), BUDGET_NODE, "full")
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
        parts = lab[nb]
        rows.append({"notebook": nb, "topic": topic, "answers": answers(nb), "GPUs": _gpus(nb, parts),
                     "estimated minutes": estimate_minutes(nb, parts),
                     "what takes the time": _largest(parts)})
    total = sum(r["estimated minutes"] for r in rows)
    rows.append({"notebook": "all", "topic": "the whole lab, in order", "answers": "",
                 "GPUs": "1-4", "estimated minutes": total,
                 "what takes the time": f"~{total / 60:.1f} GPU-node hours"})
    return pd.DataFrame(rows)


def budget_markdown() -> str:
    """:func:`budget_table` as Markdown (``make docs`` writes it into ``docs/generated/time-budget.md``)."""
    return budget_table().to_markdown(index=False)


def budget_line(notebook_number: str) -> str:
    """One line of Markdown for a notebook's first cell: its estimated full-profile wall time."""
    nb = _check(notebook_number)
    parts = notebook_parts(nb)
    return (f"**Time budget (full profile, {NODE} node): ~{estimate_minutes(nb, parts)} min** for notebook "
            f"{nb} ({notebooks()[nb]}, GPUs: {_gpus(nb, parts)}), {LABEL}; the quick profile on a CPU takes "
            "a few minutes. How it is estimated: docs/generated/time-budget.md.")
