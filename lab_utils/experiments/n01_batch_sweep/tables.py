"""Notebook 01's tables and figure: the batch-size sweep, where its time goes, its FLOP rate, the anchors,
from :data:`~lab_utils.experiments.n01_batch_sweep.experiment.SWEEP_EXPERIMENT`'s records (one per batch size,
final).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from lab_utils.engine.config import CIFAR10_TRAIN_SIZE
from lab_utils.engine.hardware import peak_flops_per_s
from lab_utils.engine.store import Record, ResultStore
from lab_utils.experiments.n01_batch_sweep.experiment import EXPERIMENT, SPEC_LR, Settings, memory_line
from lab_utils.experiments.shared.anchors import (
    FIRST_COHORT_Q1_SECONDS,
    FIRST_COHORT_TABLE1_SECONDS,
    first_cohort_q1_over_q2,
)
from lab_utils.experiments.shared.repeats import merge_repeats
from lab_utils.experiments.shared.rows import blank
from lab_utils.learn.metrics import note
from lab_utils.learn.models import flops_per_image
from lab_utils.learn.spread import TIME_MEDIAN

__all__ = ["anchor_table", "flop_table", "largest_batch_text", "largest_fitting_batch", "measured_peak_bytes",
           "memory_cases", "memory_inputs", "peak_of", "phase_table", "plot_sweep", "save_flop_table",
           "save_memory_table", "save_tables", "sweep_table"]


def largest_fitting_batch(records: Sequence[Record]) -> int | None:
    """The largest batch size measured ``ok`` (None when none fitted)."""
    sizes = [r.config["batch_size"] for r in records if r.status == "ok"]
    return max(sizes) if sizes else None


def _device(records: Sequence[Record]) -> str:
    """The device the records were measured on (their hardware's name; one sweep, one device)."""
    return next((r.hardware.get("device_name") for r in records if r.hardware.get("device_name")), "unknown")


def _ok(records: Sequence[Record]) -> list[Record]:
    """The measured batch sizes, one record each (repeats merged by
    :func:`~lab_utils.experiments.shared.repeats.merge_repeats`)."""
    return [r for r in merge_repeats(records) if r.status == "ok"]


def sweep_table(records: Sequence[Record]):
    """The paste-able table: one row per batch size (with repeats: the median training time), the rows
    not measured with their status and reason; peak memory in GiB, or "not tracked on CPU"."""
    rows = []
    for r in merge_repeats(records):
        m = r.metrics if r.status == "ok" else {}
        on_cpu = (r.hardware or {}).get("device_type") == "cpu"
        if r.status != "ok":
            peak: Any = ""
        elif m.get("peak_memory_bytes") is None:
            peak = "not tracked on CPU" if on_cpu else "unknown"
        else:
            peak = f"{m['peak_memory_bytes'] / 2**30:.2f}"
        rows.append({
            "batch size": r.config["batch_size"], "epoch-2 training (s)": blank(m.get(TIME_MEDIAN)),
            "spread_pct": blank(m.get("spread_pct")), "spread_of": m.get("spread_of") or "",
            "data loading (s)": blank(m.get("data_loading_seconds")),
            "images/s": blank(m.get("images_per_s")), "peak memory (GiB)": peak,
            "train loss": blank(m.get("loss")),
            "test accuracy": blank(m.get("test_accuracy")), "status": r.status, "reason": r.reason or ""})
    return pd.DataFrame(rows, dtype=object)


def phase_table(records: Sequence[Record]):
    """Where the reported epoch's time went, per measured batch size (seconds)."""
    columns = {"steps": "steps", "warm-up epoch training (s)": "warmup_train_seconds",
               "data loading (s)": "data_loading_seconds", "host-to-device (s)": "data_movement_seconds",
               "compute: fwd+bwd+step (s)": "compute_seconds", "reported training (s)": "train_seconds",
               "whole epoch wall (s)": "epoch_seconds", "ms per step": "ms_per_step"}
    return pd.DataFrame([{"batch size": r.config["batch_size"],
                          **{c: r.metrics.get(k) for c, k in columns.items()}}
                         for r in _ok(records)])


def save_tables(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save ``batch_sweep`` and ``batch_sweep_phases`` (md + csv); return the main table."""
    table = sweep_table(records)
    ep = settings.reported_epoch
    notes = [
        f"{settings.label}.",
        f"Training (s): epoch {ep} of {settings.epochs} (epoch 1 is warm-up); host-to-device copies, "
        "forward, backward and optimizer step, synchronized; excludes waiting on the data loader "
        "(data loading column) and evaluation.",
        "spread_pct: the spread of the training time in % of it; spread_of says which: 'p10-p90 of S steps' "
        "(the reported epoch's per-step training times) or 'min-max of R repeats' (REPEATS > 1: the "
        "training time is then the median of the repeats). A difference between rows smaller than their "
        "spread is not a result.",
        "Definitions (lab_utils.learn.metrics): " + note("train_seconds") + "; " + note(TIME_MEDIAN) + "; "
        + note("images_per_s") + ".",
        "Peak memory: torch.cuda.max_memory_allocated during the reported epoch; not tracked on CPU.",
        "oom: the batch did not fit and larger ones were not tried; skipped rows say why.",
        f"Learning rate {SPEC_LR} at every batch size (the spec's; not scaled), so accuracy at large "
        "batch is expected to drop: see notebook 05.",
    ]
    store.save_table(table, EXPERIMENT, records, title="Batch-size sweep on one device", notes=notes)
    phases = phase_table(records)
    if len(phases):
        store.save_table(phases, f"{EXPERIMENT}_phases", _ok(records),
                         title=f"Batch-size sweep: where epoch {ep}'s time goes",
                         notes=["Phases are synchronized with the device, so they do not overlap; "
                                "reported training = host-to-device + compute."])
    return table


def plot_sweep(records: Sequence[Record], settings: Settings):
    """Epoch training time and throughput against batch size (log x); OOM marked."""
    import matplotlib.pyplot as plt

    ok = _ok(records)
    xs = [r.config["batch_size"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ep = settings.reported_epoch
    ax1.plot(xs, [r.metrics[TIME_MEDIAN] for r in ok], "o-", label="training (reported)")
    ax1.plot(xs, [r.metrics["data_loading_seconds"] for r in ok], "s--", label="loader wait (excluded)")
    ax1.set_ylabel(f"epoch {ep} time (s)")
    ax1.legend(fontsize=8)
    ax2.plot(xs, [r.metrics["images_per_s"] for r in ok], "o-", color="tab:green")
    ax2.set_ylabel("training images/s")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)  # a zero baseline: small differences are not blown up
        for r in records:
            if r.status == "oom":
                ax.axvline(r.config["batch_size"], color="tab:red", ls=":")
                ax.text(r.config["batch_size"], ax.get_ylim()[1], " OOM", color="tab:red",
                        va="top", ha="left", fontsize=8)
        if xs or any(r.status == "oom" for r in records):
            ticks = sorted({r.config["batch_size"] for r in records if r.status != "skipped"})
            ax.set_xticks(ticks)
            ax.set_xticklabels([str(t) for t in ticks])
    fig.suptitle(f"Batch-size sweep, {_device(records)}")
    fig.tight_layout()
    return fig


def _precision(records: Sequence[Record]) -> str:
    """The precision the sweep's peak is taken at (the records': TF32 where cuDNN may use it)."""
    return next((m["peak_precision"] for m in (r.metrics for r in _ok(records)) if m.get("peak_precision")),
                "fp32")


def flop_table(records: Sequence[Record]):
    """Achieved training FLOP/s per measured batch size and, on a known GPU, the percent of its peak:
    the records' ``train_tflops_per_s`` (training FLOPs per image x images/s) and ``percent_of_peak``."""
    precision = _precision(records)
    peak = peak_flops_per_s(_device(records), precision)
    return pd.DataFrame([{
        "batch size": r.config["batch_size"], "images/s": r.metrics["images_per_s"],
        "train GFLOP/image": None if (f := r.metrics.get("train_flops_per_image")) is None else f / 1e9,
        "achieved TFLOP/s": blank(r.metrics.get("train_tflops_per_s")),
        f"peak TFLOP/s ({precision})": None if peak is None else peak / 1e12,
        "% of peak": blank(r.metrics.get("percent_of_peak"))} for r in _ok(records)], dtype=object)


def save_flop_table(store: ResultStore, records: Sequence[Record], settings: Settings):
    """Save ``batch_sweep_flops`` (md + csv) and return ``(table, explanation)``."""
    table = flop_table(records)
    device, precision = _device(records), _precision(records)
    peak = peak_flops_per_s(device, precision)
    why = (f"No % of peak: {device} is not in the peak-FLOP/s table of lab_utils.engine.hardware (CPUs never "
           "are), and a guessed peak would be a made-up number." if peak is None else
           f"Peak {peak / 1e12:.0f} TFLOP/s is the data-sheet dense {precision} figure for {device}.")
    flops = flops_per_image(settings.width)
    notes = [f"FLOPs counted by torch.utils.flop_counter on ResNet-18 width {flops.width}: forward "
             f"{flops.forward_flops / 1e9:.4g} GFLOP/image, forward+backward {flops.train_flops / 1e9:.4g} "
             "GFLOP/image (matmuls and convolutions only; BatchNorm, ReLU and the optimizer are not "
             "counted).",
             why]
    store.save_table(table, f"{EXPERIMENT}_flops", _ok(records),
                     title="Batch-size sweep against the FLOP limit", notes=notes)
    return table, why


def anchor_table(records: Sequence[Record], settings: Settings):
    """This run's epoch-1 (warm-up) and epoch-2 training seconds next to the first cohort's two single-GPU
    sets (:mod:`lab_utils.experiments.shared.anchors`): its Q1 answer (epoch 1 and epoch 2) and the 1-GPU row
    of its Table 1, with how far its two epoch-2 times differ (``Q1 over Q2 (%)``). ``cohort / this run``
    (> 1: faster here) is the range over the two sets, only when this run is the spec configuration
    (width 64, all 50,000 images); otherwise the column says why not."""
    s = settings
    comparable = s.width == 64 and (s.train_images is None or s.train_images >= CIFAR10_TRAIN_SIZE)
    by_bs = {r.config["batch_size"]: r for r in merge_repeats(records)}
    rows = []
    for bs, (q1_warm, q1) in FIRST_COHORT_Q1_SECONDS.items():
        q2 = FIRST_COHORT_TABLE1_SECONDS[(1, bs)]
        r = by_bs.get(bs)
        ok = r is not None and r.status == "ok"
        mine = r.metrics[TIME_MEDIAN] if ok else None
        if not comparable:
            ratio: Any = "not comparable: reduced model/data"
        elif mine is None:
            ratio = f"not measured ({r.status if r is not None else 'not in this sweep'})"
        else:
            ratio = f"{min(q1, q2) / mine:.2f}-{max(q1, q2) / mine:.2f}"
        rows.append({"batch size": bs, "cohort Q1: epoch 1 (s)": q1_warm, "cohort Q1: epoch 2 (s)": q1,
                     "cohort Table 1 (s)": q2, "Q1 over Table 1 (%)": round(first_cohort_q1_over_q2(bs), 1),
                     "this run: epoch 1 (s)": blank(r.metrics.get("warmup_train_seconds")) if ok else None,
                     "this run: epoch 2 (s)": mine, "cohort / this run": ratio})
    return pd.DataFrame(rows, dtype=object)


# --------------------------------------------------------------------------- Exercise 01-c: peak memory

#: The inputs of Exercise 01-c's function, in its order (the prediction table calls it with them).
_MEMORY_INPUTS = ("batch_a", "peak_a_bytes", "batch_b", "peak_b_bytes", "batch", "limit_bytes")
_GPU_PEAK = "GPU: max_memory_allocated"   # torch.cuda's high-water mark over the reported epoch
_MEMORY_TITLE = "Peak memory: predicted before, measured after (Exercise 01-c)"
_CPU_PEAK = "CPU: counted under the cap"   # the largest step's bytes, counted by CpuMemoryCap


def measured_peak_bytes(record: Record) -> tuple[int | None, str]:
    """(peak memory of a training step in bytes, how it was measured) of an ``ok`` sweep record: on a GPU
    ``peak_memory_bytes``; on a CPU with a memory cap, ``cpu_cap_peak_step_bytes``; else (None, why)."""
    m = record.metrics if record.status == "ok" else {}
    if m.get("peak_memory_bytes") is not None:
        return int(m["peak_memory_bytes"]), _GPU_PEAK
    if m.get("cpu_cap_peak_step_bytes") is not None:
        return int(m["cpu_cap_peak_step_bytes"]), _CPU_PEAK
    return None, "not measured" if record.status == "ok" else record.status


def _fit_points(records: Sequence[Record]) -> list[tuple[int, int | None]]:
    """(batch, peak bytes) of the two smallest batch sizes that fitted, which the prediction is fitted to."""
    return sorted((r.config["batch_size"], measured_peak_bytes(r)[0]) for r in merge_repeats(records)
                  if r.status == "ok")[:2]


def _memory_why_not(records: Sequence[Record]) -> str | None:
    """Why Exercise 01-c cannot be compared with this sweep (one sentence), or None when it can."""
    points = _fit_points(records)
    if len(points) < 2 or any(peak is None for _, peak in points):
        return ("No prediction table: it needs the peak memory of two batch sizes that fitted, measured on a "
                "GPU or under a CPU memory cap (MEMORY_CAP_BYTES > 0); this sweep has "
                f"{', '.join(f'batch {b}: {peak}' for b, peak in points) or 'none'}.")
    return None


def _limit_bytes(records: Sequence[Record]) -> int | None:
    return next((r.metrics.get("memory_limit_bytes") for r in records
                 if r.status == "ok" and r.metrics.get("memory_limit_bytes")), None)


def memory_inputs(records: Sequence[Record]):
    """The measurements Exercise 01-c predicts from: batch size, peak bytes and how measured, the limit."""
    limit = _limit_bytes(records)
    return pd.DataFrame([{"batch size": r.config["batch_size"], "peak_bytes": measured_peak_bytes(r)[0],
                          "limit_bytes": limit, "measured as": measured_peak_bytes(r)[1]}
                         for r in merge_repeats(records)], dtype=object)


def memory_cases(records: Sequence[Record]) -> tuple[list[dict], list[int | None]]:
    """Exercise 01-c's inputs for every batch size of the sweep above the two it is fitted to, with each
    one's status, and the peak measured there (None where it did not fit or was not run): the
    ``cases`` and ``measured`` of :func:`lab_utils.app.grading.predict.prediction_table`."""
    if _memory_why_not(records):
        return [], []
    (batch_a, peak_a), (batch_b, peak_b) = _fit_points(records)
    limit = _limit_bytes(records)
    cases, measured = [], []
    for r in sorted(merge_repeats(records), key=lambda r: r.config["batch_size"]):
        if r.config["batch_size"] <= batch_b:
            continue
        cases.append({"batch_a": batch_a, "peak_a_bytes": peak_a, "batch_b": batch_b, "peak_b_bytes": peak_b,
                      "batch": r.config["batch_size"], "limit_bytes": limit, "status": r.status})
        measured.append(measured_peak_bytes(r)[0])
    return cases, measured


def peak_of(predict):
    """``predict`` (Exercise 01-c's function, or the lab's) as a prediction table calls it: the case's
    inputs, in :data:`_MEMORY_INPUTS` order (whatever the parameters are named), and its first output,
    the peak (None when the function returns None: not done yet)."""
    def peak(**case):
        out = predict(*(case[k] for k in _MEMORY_INPUTS))
        return None if out is None else out[0]
    return peak


def save_memory_table(store: ResultStore, table, records: Sequence[Record]):
    """Save the prediction table as ``batch_sweep_memory`` (md + csv) with bytes shown as decimal MB;
    return the table saved (one row saying why, when the sweep cannot be predicted)."""
    why = _memory_why_not(records)
    if why or not len(table):
        out = pd.DataFrame([{"batch": "", "status": why or "no batch size above the two fitted"}])
        store.save_table(out, f"{EXPERIMENT}_memory", records, title=_MEMORY_TITLE)
        return out
    out = table.copy()
    for col in [c for c in out.columns if c.endswith("_bytes")]:
        out[col.removesuffix("_bytes") + "_mb"] = [v / 1e6 if isinstance(v, (int, float)) and v == v else v
                                                   for v in out.pop(col)]
    cols = [c for c in out.columns if c not in ("lab_model_error_pct", "your_error_pct")]
    cols.insert(cols.index("lab_model_mb") + 1, "lab_model_error_pct")
    out = out[cols + ["your_error_pct"]]
    (batch_a, _), (batch_b, _) = _fit_points(records)
    measured_as = {measured_peak_bytes(r)[1] for r in records if measured_peak_bytes(r)[0] is not None}
    limit = _limit_bytes(records)
    notes = [f"Fitted to the peaks measured at batch {batch_a} and {batch_b}; lab model: the line through "
             "them (lab_utils.experiments.n01_batch_sweep.experiment.predict_peak_memory); yours: "
             "Exercise 01-c.",
             f"Measured ({'; '.join(sorted(measured_as))}): on a GPU torch.cuda.max_memory_allocated over "
             "the reported epoch, on a CPU the bytes of the largest step counted under MEMORY_CAP_BYTES. "
             "MB = 1e6 bytes. A row that did not fit (oom) or was not run has no measurement.",
             f"Limit: {'none' if limit is None else f'{limit / 1e6:,.0f} MB'} (memory_limit_bytes)."]
    store.save_table(out, f"{EXPERIMENT}_memory", records, title=_MEMORY_TITLE, notes=notes)
    return out


def largest_batch_text(predict, records: Sequence[Record]) -> str:
    """One line: the largest batch within the limit by the lab's line and by ``predict`` (Exercise 01-c),
    beside what the sweep found (the largest batch that fitted, the first that did not)."""
    why = _memory_why_not(records)
    if why:
        return why
    (batch_a, peak_a), (batch_b, peak_b) = _fit_points(records)
    limit = _limit_bytes(records)
    if limit is None:
        return "No memory limit recorded (a CPU run without MEMORY_CAP_BYTES): no largest batch to predict."
    lab = memory_line(batch_a, peak_a, batch_b, peak_b).largest_batch(limit)
    try:
        out = predict(batch_a, peak_a, batch_b, peak_b, batch_b, limit)
        yours = "not done yet" if out is None else out[1]
    except Exception as e:  # the student's function failing is a sentence, not a traceback
        yours = f"raised {type(e).__name__}"
    first_oom = next((r.config["batch_size"] for r in sorted(records, key=lambda r: r.config["batch_size"])
                      if r.status == "oom"), None)
    found = f"{largest_fitting_batch(records)} fitted" + (f", {first_oom} did not" if first_oom else
                                                          ", none ran out of memory")
    return (f"**Largest batch within {limit / 1e6:,.0f} MB:** lab model {lab:,}, yours {yours}; "
            f"the sweep: {found}.")
