"""How long each notebook takes in the ``full`` profile on a GPU node: an estimate to book GPU hours by.

No full-profile run of the lab on a GPU exists yet, so every number here is an
**estimate (no GPU run yet)**, built from what the lab knows without one:

- *what the full profile runs*: batch sizes, epochs, device counts and runs, read from the
  full-profile settings of the experiment modules (``profiles.settings(sweep.Settings, "full")``, ...),
  so the estimate follows the settings when they change;
- *how long one spec-path ResNet-18 epoch takes*: the larger of a FLOP estimate
  (training FLOPs / an assumed fraction of the GPU's peak, :mod:`lab_utils.core.hardware`) and
  the epoch times earlier cohorts published (V100 / RTX 8000 class, SPEC.md). The spec
  path feeds the GPU from a 2-worker PIL ``DataLoader``; a faster GPU does not make that
  loader faster, so the published times are kept as a floor: an H100 is not assumed to
  beat them on the spec path;
- *fixed costs*: notebook start-up, one ``torchrun`` launch per DDP run, ``torch.compile``.

The node assumed is 4 x H100 SXM (bf16 989, TF32 495 TFLOP/s dense). Notebooks are
assumed to run in order (01 ... 08), so a later notebook reuses what an earlier one stored
(notebook 03 takes T(1) from notebook 02; notebook 07 the GPT checkpoint of notebook 06).

>>> budget_table()            # doctest: +SKIP  (one row per notebook, and a total)
>>> budget_line("01")         # doctest: +SKIP  (the one-line Markdown a notebook shows)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab_utils import questions
from lab_utils.core import profiles
from lab_utils.core.errors import LabError
from lab_utils.core.estimates import *  # noqa: F403  (moving: the helper rewrites time_budget)
from lab_utils.core.machine import BUDGET_NODE
from lab_utils.experiments import comm, fastpath, gpt, large_batch, quantize, registry, scaling, sweep
from lab_utils.plan import make_plan

#: The notebooks and their topics; what each answers comes from :mod:`lab_utils.questions`.
NOTEBOOKS: dict[str, str] = {
    "00": "environment", "01": "batch-size sweep", "02": "multi-GPU scaling",
    "03": "compute vs communication", "04": "all-reduce bandwidth", "05": "large-batch training",
    "06": "GPT with DDP", "07": "int8 quantization", "08": "speed limits", "09": "data parallelism by hand",
}


def answers(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: what a notebook answers (the README's question map)."""
    return questions.labels_for(_check(notebook)).replace(questions.PART2, "Part 2 project")


@dataclass(frozen=True)
class Part:
    """One piece of a notebook's estimated time."""

    what: str
    seconds: float
    gpus: int = 1


def notebook_parts(notebook: str) -> list[Part]:
    """The pieces of one notebook's estimated full-profile time."""
    nb = _check(notebook)
    parts = [Part("start-up", NOTEBOOK_START_S, 0)]
    if nb == "01":
        s = profiles.settings(sweep.Settings, "full")
        for b in s.batch_sizes:
            parts.append(Part(f"batch {b}: {s.epochs} epochs",
                              IN_PROCESS_RUN_S + s.epochs * spec_epoch_seconds(1, b)))
    elif nb == "02":
        s = profiles.settings(scaling.Settings, "full")
        for n in s.devices:
            for b in s.batch_sizes:
                parts.append(Part(f"DDP {n} x {b}", LAUNCH_S + s.epochs * spec_epoch_seconds(n, b), n))
                parts.append(Part(f"DataParallel {n} x {b}",
                                  IN_PROCESS_RUN_S + s.epochs * dp_epoch_seconds(n, b), n))
    elif nb == "03":  # T(1) and DataParallel from notebook 02's store; DDP with comm probes runs again
        s = profiles.settings(scaling.Settings, "full")
        for n in s.comm_devices:
            for b in s.batch_sizes:
                parts.append(Part(f"DDP {n} x {b} with comm probes",
                                  LAUNCH_S + (s.epochs + 0.1) * spec_epoch_seconds(n, b), n))
    elif nb == "04":
        s = profiles.settings(comm.Settings, "full")
        for p in s.bench_ranks:
            parts.append(Part(f"all-reduce benchmark, {p} ranks, 8 B ... 1 GiB", LAUNCH_S + 30.0, p))
    elif nb == "05":
        s = profiles.settings(large_batch.Settings, "full")
        for run in large_batch.plan_runs(s, s.devices):
            n = run.devices
            parts.append(Part(f"{run.name}: {n} x {run.batch_per_device}, {s.epochs} epochs + tests",
                              LAUNCH_S + s.epochs * (spec_epoch_seconds(n, run.batch_per_device)
                                                     + test_pass_seconds(n)), n))
        parts.append(Part("communication accounting (a few steps on 2 and 4 ranks)", 2 * LAUNCH_S, s.devices))
    elif nb == "06":
        s = profiles.settings(gpt.Settings, "full")
        for n in s.scaling_devices:
            for b in s.scaling_batch_sizes:
                parts.append(Part(f"scaling {n} x {b}", LAUNCH_S + s.scaling_epochs * 1.1
                                  * gpt_epoch_seconds(s.size, s.stride, n, b), n))
        acc_devices = s.accumulation_devices or 4
        for mb in s.micro_batches:
            parts.append(Part(f"accumulation micro-batch {mb}", LAUNCH_S + s.accumulation_epochs * 1.1
                              * gpt_epoch_seconds(s.size, s.stride, acc_devices, mb), acc_devices))
        parts.append(Part("final model for notebook 07", LAUNCH_S + s.train_epochs * 1.1
                          * gpt_epoch_seconds(s.size, s.stride, 4, s.train_batch_size), 4))
    elif nb == "07":
        s = profiles.settings(quantize.Settings, "full")
        for device in ("cpu", "cuda"):
            per = 45.0 if device == "cpu" else 10.0  # evaluation tokens + timed generation, per variant
            parts.append(Part(f"{len(s.variants)} variants on {device}", len(s.variants) * per))
    elif nb == "08":
        s = profiles.settings(fastpath.Settings, "full")
        spec = spec_epoch_seconds(1, s.batch_size)
        fast = fast_epoch_seconds("bf16")
        parts.append(Part("loader alone (2 pipelines)", 2 * (IN_PROCESS_RUN_S + s.data_min_seconds)))
        for step in s.steps:
            fp32 = step in ("device_loader", "channels_last")  # before the bf16 step
            one = spec if step == "spec" else fast_epoch_seconds("tf32" if fp32 else "bf16")
            parts.append(Part(f"waterfall: {step}", IN_PROCESS_RUN_S + one
                              + (COMPILE_S if step == "compile" else 0.0)))
        parts.append(Part("profiler trace", IN_PROCESS_RUN_S + COMPILE_S))
        if s.accuracy_epochs:
            parts.append(Part(f"accuracy: spec, {s.accuracy_epochs} epochs + tests",
                              IN_PROCESS_RUN_S + s.accuracy_epochs * (spec + test_pass_seconds(1))))
            parts.append(Part(f"accuracy: fastest, {s.accuracy_epochs} epochs + tests",
                              IN_PROCESS_RUN_S + COMPILE_S + s.accuracy_epochs * 1.2 * fast))
    else:  # a notebook on the plan of runs (issue 34): its full plan on the budget node, a launch per group
        for exp in registry.for_notebook(nb):
            full = profiles.settings(exp.settings, "full")
            runs = [r for r in make_plan(exp, full, BUDGET_NODE) if not r.skip]
            for group in dict.fromkeys(r.group for r in runs):
                members = [r for r in runs if r.group == group]
                seconds = LAUNCH_S + sum(exp.cost(r) for r in members)
                parts.append(Part(f"{group}: {len(members)} runs", seconds, members[0].processes))
    return parts


def _check(notebook: str) -> str:
    nb = str(notebook).strip()
    nb = nb.zfill(2) if nb.isdigit() else nb
    if nb not in NOTEBOOKS:
        raise LabError(f"No notebook {notebook!r}; use one of: {', '.join(NOTEBOOKS)}.")
    return nb


def estimate_minutes(notebook: str) -> int:
    """Estimated full-profile wall time of one notebook, whole minutes rounded up."""
    return math.ceil(sum(p.seconds for p in notebook_parts(notebook)) / 60)


def _gpus(notebook: str) -> str:
    counts = sorted({p.gpus for p in notebook_parts(notebook) if p.gpus})
    if not counts:
        return "any"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _largest(notebook: str) -> str:
    parts = [p for p in notebook_parts(notebook) if p.what != "start-up"]
    if not parts:
        return "start-up"
    top = max(parts, key=lambda p: p.seconds)
    return f"{len(parts)} runs; longest: {top.what} (~{math.ceil(top.seconds / 60)} min)"


def budget_table():
    """One row per notebook (and a total): estimated full-profile minutes on a 4 x H100 SXM node."""
    import pandas as pd

    rows = [{"notebook": nb, "topic": topic, "answers": answers(nb), "GPUs": _gpus(nb),
             "estimated minutes": estimate_minutes(nb), "what takes the time": _largest(nb)}
            for nb, topic in NOTEBOOKS.items()]
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
    return (f"**Time budget (full profile, {NODE} node): ~{estimate_minutes(nb)} min** for notebook {nb} "
            f"({NOTEBOOKS[nb]}, GPUs: {_gpus(nb)}), {LABEL}; the quick profile on a CPU takes a few "
            "minutes. How it is estimated: README, *Time budget*.")
