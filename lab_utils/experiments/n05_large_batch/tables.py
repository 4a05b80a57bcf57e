"""Notebook 05's tables and figures for Q4.1, Q4.2 and Q5 from the records of
:data:`lab_utils.experiments.n05_large_batch.experiment.LARGE_BATCH_EXPERIMENT` (each run's aggregate in plan
order, its per-rank records beside it; a run's layout and lr rule read back from its
:class:`~lab_utils.experiments.n02_scaling.ddp_worker.RunConfig`, its name the ``tag``), and the ``set_epoch``
demonstration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from lab_utils.engine.machine import Machine
from lab_utils.engine.records import aggregates, ranks_of
from lab_utils.engine.store import Record, ResultStore
from lab_utils.engine.table_view import with_view
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.n05_large_batch.experiment import (
    EXPERIMENT,
    DevicePlan,
    Settings,
    plan_devices,
    sampler_epoch_orders,
)
from lab_utils.experiments.shared.anchors import FIRST_COHORT_LARGE_BATCH
from lab_utils.learn.errors import LabError
from lab_utils.learn.schedules import make_schedule

#: The columns a notebook shows when the whole table is too wide (lab_utils.engine.table_view).
LARGE_BATCH_VIEW = ("configuration", "devices", "global batch", "lr rule", "peak lr", "epoch-5 train loss",
                    "epoch-5 test accuracy %", "epoch-5 train accuracy %", "epoch time s", "status")

# ANCHOR_ROWS, ASKED_SMALL and plot_lr are used here only (at most 15 public names: test_architecture).
__all__ = ["ANCHORS", "ASKED_LARGE", "RECIPE_OUTPUTS", "anchor_frame", "large_batch_table", "layout_flag",
           "lr_curves", "plot_accuracy", "recipe_cases", "rule_text", "save_figures",
           "save_large_batch_table", "set_epoch_table", "worker_sample_orders"]

# The earlier cohort's Q4.1 (lab_utils.experiments.shared.anchors): loss and "Accuracy" after 5 epochs, as
# printed.
# Its report does not say whether they are training or test figures: the lab does not say either.
_SMALL, _LARGE = FIRST_COHORT_LARGE_BATCH["small"], FIRST_COHORT_LARGE_BATCH["large"]
ANCHORS = (f"earlier cohort (V100/RTX8000 class, real CIFAR-10), after {_LARGE.epochs} epochs, as "
           f"printed: {_SMALL.per_gpu_batch} x {_SMALL.gpus} GPU: loss {_SMALL.loss}, 'Accuracy' "
           f"{_SMALL.accuracy_pct}%; {_LARGE.per_gpu_batch} x {_LARGE.gpus} GPUs, lr {_LARGE.lr}: loss "
           f"{_LARGE.loss}, 'Accuracy' "
           f"{_LARGE.accuracy_pct}%. The report does not say whether these are training or test figures")
ANCHOR_ROWS = tuple(
    {"configuration": f"earlier cohort: {what}", "devices": f"{a.gpus} x GPU",
     "batch per device": a.per_gpu_batch, "global batch": a.global_batch, "loss (as reported)": a.loss,
     "'Accuracy' % (as reported)": a.accuracy_pct}
    for what, a in (("small batch (reference)", _SMALL), ("large batch, same lr", _LARGE)))


# The assignment's layouts: the reference 128 on 1 GPU, the large runs 512 per GPU on 4 GPUs.
ASKED_SMALL = (1, 128)
ASKED_LARGE = (4, 512)


def _runs(records: Sequence[Record]) -> list[tuple[RunConfig, Record]]:
    return [(RunConfig.from_config(rec.config), rec) for rec in aggregates(records)]


def _shape(run: RunConfig) -> str:
    """``2x512`` or, with accumulation, ``2x512 x 2 acc``."""
    acc = f" x {run.accumulation_steps} acc" if run.accumulation_steps > 1 else ""
    return f"{run.devices}x{run.batch_size}{acc}"


def rule_text(run: RunConfig) -> str:
    """The learning-rate rule in words, e.g. ``linear 0.1 x 2048/128, warm-up 2 ep from 0.1, cosine decay``"""
    parts = [f"fixed {run.lr:g}" if run.lr_rule == "fixed" else
             f"linear {run.lr:g} x {run.global_batch}/{run.base_batch}"]
    if run.warmup_epochs:
        parts.append(f"warm-up {run.warmup_epochs:g} ep from {run.lr:g}")
    if run.decay != "constant":
        parts.append(f"{run.decay} decay")
    return ", ".join(parts)


def large_batch_table(records: Sequence[Record], settings: Settings):
    """The ``large_batch`` table: one row per run (failed runs say why); every number the record's."""
    e = settings.epochs
    rows = []
    for run, rec in _runs(records):
        m = rec.metrics
        row: dict[str, Any] = {
            "configuration": run.tag,
            "devices": f"{run.devices} x {'GPU' if rec.config.get('backend') == 'nccl' else 'CPU process'}",
            "batch per device": run.batch_size, "global batch": run.global_batch,
            "accumulation steps": run.accumulation_steps, "lr rule": rule_text(run),
            "peak lr": m.get("peak_lr")}
        if rec.status == "ok":
            row.update({
                "optimizer steps": m["steps_per_epoch"] * e, f"epoch-{e} train loss": m.get("train_loss"),
                f"epoch-{e} test loss": m.get("test_loss"),
                f"epoch-{e} test accuracy %": 100 * m["test_accuracy"] if "test_accuracy" in m else None,
                f"epoch-{e} train accuracy %": (100 * m["train_accuracy"]
                                                if m.get("train_accuracy") is not None else None),
                "epoch time s": m.get("epoch_seconds"), "wall time s": m.get("elapsed_seconds"),
                "status": "ok"})
        else:
            row["status"] = f"{rec.status}: {rec.reason}"
        row["vs assignment"] = layout_flag(run, rec.config.get("backend") == "nccl") or "as asked"
        rows.append(row)
    return with_view(pd.DataFrame(rows), LARGE_BATCH_VIEW)


def layout_flag(run: RunConfig, on_gpus: bool) -> str:
    """How a run's layout differs from the assignment's (4 GPUs x 512, or 1 GPU x 128 for the
    reference): "" when it is the asked one, else every difference, so that no number from
    another global batch or an accumulation emulation passes for the assignment's."""
    want_n, want_b = ASKED_SMALL if run.tag.startswith("small batch") else ASKED_LARGE
    diffs = []
    if run.global_batch != want_n * want_b:
        diffs.append(f"global batch {run.global_batch}, not {want_n * want_b}")
    if run.batch_size != want_b:
        diffs.append(f"{run.batch_size} per device, not {want_b}")
    if run.accumulation_steps > 1:
        diffs.append(f"{run.devices} device(s) x {run.accumulation_steps} accumulation steps EMULATE "
                     f"{run.devices * run.accumulation_steps} devices")
    elif run.devices != want_n:
        diffs.append(f"{run.devices} device(s), not {want_n}")
    if not on_gpus:
        diffs.append("CPU processes, not GPUs")
    return ("NOT " + f"{want_n} x {want_b}: " + "; ".join(diffs)) if diffs else ""


def anchor_frame():
    """The earlier cohort's Q4.1 numbers as reported: a loss and an "Accuracy" after 5 epochs. Its
    report does not say whether they were measured on the training or the test set, so the frame
    does not either: set them beside both of this table's columns, and say which you compare."""
    return pd.DataFrame([{**r, "which set": "not stated in the report ('Accuracy')"} for r in ANCHOR_ROWS])


def _notes(records: Sequence[Record], s: Settings, profile: str, plan: DevicePlan) -> list[str]:
    notes = [f"{s.label}." if s.label else f"profile {profile}.",
             f"Every run: {s.epochs} epochs (the same images seen), SGD momentum 0.9, weight decay 5e-4; "
             f"test loss/accuracy after epoch {s.epochs} on the test split; train loss and train "
             f"accuracy = mean over epoch {s.epochs}'s training images as they were trained on.",
             "vs assignment: every run that is not the assignment's layout (4 GPUs x 512 = 2048, reference "
             "1 GPU x 128) says how it differs: another global batch, gradient-accumulation emulation of "
             "missing devices, CPU processes instead of GPUs.",
             "lr rule: linear = lr x global batch / reference batch (Goyal et al. 2017); warm-up ramps the "
             "lr linearly per step from the reference lr to that peak; decay starts after warm-up.",
             f"epoch time: wall time of epoch {s.epochs} (slowest rank; loader waits included, evaluation "
             "excluded); wall time: from the start of epoch 1 to the end of the last, evaluations included.",
             ANCHORS + "."]
    if any(run.accumulation_steps > 1 for run, _ in _runs(records)):
        notes.insert(1, "accumulation steps: micro-batches per optimizer step on each device (the first ones "
                        "under DDP's no_sync, each loss divided by their number): global batch = devices x "
                        "batch per device x accumulation steps, the same gradient as that many devices "
                        "(BatchNorm running statistics aside).")
    if plan.note:
        notes.insert(1, plan.note + ".")
    return notes


def save_large_batch_table(store: ResultStore, records: Sequence[Record], settings: Settings,
                           plan: DevicePlan | None = None):
    """Save ``tables/large_batch.md`` and ``.csv``; return the DataFrame. ``plan``: the device plan the
    runs were made with (None: this machine's,
    :func:`~lab_utils.experiments.n05_large_batch.experiment.plan_devices`)."""
    plan = plan or plan_devices(settings, Machine.here())
    table = large_batch_table(records, settings)
    store.save_table(table, EXPERIMENT, list(records),
                     title=f"Large-batch training: {settings.epochs} epochs, same budget",
                     notes=_notes(records, settings, store.profile, plan) + [store.here_note(EXPERIMENT)])
    return table


def plot_accuracy(records: Sequence[Record], settings: Settings, against: str = "epoch",
                  plan: DevicePlan | None = None):
    """Test accuracy (left) and training loss (right) of every run, against ``epoch`` or wall-clock ``time``.
    The loss is the cleaner signal of how far optimization got (test accuracy after few steps also
    depends on how far the BatchNorm running statistics have caught up with the weights)."""
    import matplotlib.pyplot as plt

    if against not in ("epoch", "time"):
        raise LabError(f"against must be 'epoch' or 'time', got {against!r}.")
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.0))
    for run, rec in _runs(records):
        eps = [e for e in rec.metrics.get("epochs") or [] if e.get("test_accuracy") is not None]
        if rec.status != "ok" or not eps:
            continue
        xs = [e["epoch"] for e in eps] if against == "epoch" else [e["elapsed_seconds"] for e in eps]
        style = "o--" if run.devices == 1 else "o-"
        label = f"{run.tag} ({_shape(run)})"
        ax_acc.plot(xs, [100 * e["test_accuracy"] for e in eps], style, label=label)
        ax_loss.plot(xs, [e.get("train_loss") for e in eps], style, label=label)
    xlabel = "epoch" if against == "epoch" else "wall-clock time since the start of training (s)"
    for ax in (ax_acc, ax_loss):
        ax.set_xlabel(xlabel)
        if against == "epoch":
            ax.set_xticks(range(1, settings.epochs + 1))
        ax.grid(True, alpha=0.3)
    ax_acc.set_ylabel("test accuracy (%)")
    ax_loss.set_ylabel("training loss (mean over the epoch)")
    ax_loss.set_yscale("log")
    ax_acc.legend(fontsize=8)
    title = "per epoch" if against == "epoch" else "against wall-clock time"
    plan = plan or plan_devices(settings, Machine.here())
    note = f" ({plan.note.split(':')[0]})" if plan.note else ""
    fig.suptitle(f"Large-batch runs, {title}{note}", fontsize=11)
    fig.tight_layout()
    return fig


def lr_curves(records: Sequence[Record], settings: Settings) -> dict[str, list[float]]:
    """The lr of every optimizer step of every run that trained, from its config and its steps per epoch
    through the schedule the worker uses (:func:`lab_utils.learn.schedules.make_schedule`)."""
    scheds = {run.tag: make_schedule(run.lr, run.lr_rule, run.global_batch, run.base_batch,
                                     rec.metrics["steps_per_epoch"], run.epochs, run.warmup_epochs, run.decay)
              for run, rec in _runs(records) if rec.status == "ok"}
    return {tag: [s.lr_at(i) for i in range(s.total_steps)] for tag, s in scheds.items()}


def plot_lr(records: Sequence[Record], settings: Settings):
    """The learning rate against the fraction of the run, for every configuration."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    curves = lr_curves(records, settings)
    styles = ["-", "--", "-", "--", "-"]
    for k, (name, lrs) in enumerate(curves.items()):
        n = len(lrs)
        # identical stretches overlap: thinner lines drawn on top keep each one visible
        ax.plot([(i + 1) * settings.epochs / n for i in range(n)], lrs, styles[k % len(styles)],
                drawstyle="steps-pre", lw=1.5 + 1.2 * (len(curves) - 1 - k), alpha=0.85,
                label=f"{name} ({n} steps)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("learning rate")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Learning rate per optimizer step", fontsize=10)
    fig.tight_layout()
    return fig


def save_figures(store: ResultStore, records: Sequence[Record], settings: Settings,
                 plan: DevicePlan | None = None) -> list:
    """Save the accuracy-vs-epoch, accuracy-vs-time and lr figures as PNG and close them; return their
    paths (a notebook shows the PNGs, the same interactively and headless)."""
    import matplotlib.pyplot as plt

    paths = []
    for name, make in (("large_batch_accuracy_epoch", lambda: plot_accuracy(records, settings, "epoch",
                                                                            plan)),
                       ("large_batch_accuracy_time", lambda: plot_accuracy(records, settings, "time", plan)),
                       ("large_batch_lr", lambda: plot_lr(records, settings))):
        fig = make()
        paths.append(store.save_figure(fig, name, list(records)))
        plt.close(fig)
    return paths


def set_epoch_table(dataset_size: int = 16, num_replicas: int = 2, epochs: int = 2, seed: int = 0):
    """Each rank's index order per epoch, with and without ``set_epoch`` (a DataFrame)."""
    orders = {(call, r): sampler_epoch_orders(dataset_size, num_replicas, r, epochs, call, seed)
              for call in (True, False) for r in range(num_replicas)}
    return pd.DataFrame([{"set_epoch called": "yes" if call else "no", "epoch": epoch,
                          **{f"rank {r} indices": " ".join(str(i) for i in orders[call, r][epoch])
                             for r in range(num_replicas)}}
                         for call in (True, False) for epoch in range(epochs)])


def worker_sample_orders(records: Sequence[Record], rec: Record) -> list[dict[str, Any]]:
    """The first sampler indices each rank drew per epoch in ``rec``'s run, from its per-rank records among
    ``records`` (the worker calls set_epoch)."""
    ranks = ranks_of(rec, records)
    return [{"rank": r.config.get("rank"), "epoch": e.get("epoch"),
             "first indices": " ".join(str(i) for i in e.get("sample_order_head", []))}
            for r in ranks for e in r.metrics.get("epochs", [])]


RECIPE_OUTPUTS = ("peak_lr", "warmup_steps")


def recipe_cases(records: Sequence[Record]):
    """Exercise 05-b's predict-then-measure: per run that trained with the linear scaling rule, the case
    ``{base_lr, base_batch, per_device_batch, devices, dataset_size, warmup_epochs}`` (``devices``: the
    layout asked, accumulation steps included), what its schedule used (its record's ``peak_lr`` and
    ``warmup_steps``) and its name. Returns (cases, used, labels); ``used[i]`` follows
    :data:`RECIPE_OUTPUTS`."""
    cases, used, labels = [], [], []
    for run, rec in _runs(records):
        if run.lr_rule != "linear" or rec.status != "ok":
            continue
        cases.append({"base_lr": run.lr, "base_batch": run.base_batch, "per_device_batch": run.batch_size,
                      "devices": run.devices * run.accumulation_steps, "dataset_size": run.train_images,
                      "warmup_epochs": run.warmup_epochs})
        used.append(tuple(rec.metrics.get(k) for k in RECIPE_OUTPUTS))
        labels.append(run.tag)
    return cases, used, labels
