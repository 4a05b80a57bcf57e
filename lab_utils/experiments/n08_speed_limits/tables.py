"""Notebook 08's tables, figure and summaries from the records of
:mod:`lab_utils.experiments.n08_speed_limits.experiment` (``bench_data``, ``bench_train``, ``fastpath_trace``,
``fastpath_accuracy``), and the ``python -m lab_utils
bench data|train`` commands that measure and print them. Rates: ``loader_images_per_s`` (the loader alone),
``epoch_images_per_s`` (over the whole epoch, loader waits included); see :mod:`lab_utils.learn.metrics`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pandas as pd

from lab_utils.engine.hardware import mig_profile
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import measure
from lab_utils.engine.session import session_for
from lab_utils.engine.store import Record
from lab_utils.experiments.n08_speed_limits.experiment import (
    LOADER_EXPERIMENT,
    WATERFALL_EXPERIMENT,
    Settings,
)
from lab_utils.experiments.n08_speed_limits.fast_train import STEP_NAMES, WATERFALL
from lab_utils.experiments.shared import data
from lab_utils.experiments.shared.rows import blank
from lab_utils.learn.errors import LabError

__all__ = ["accuracy_gain_points", "accuracy_table", "bench_data_main", "bench_train_main", "data_table",
           "fastest_step", "loader_bound_summary", "status_text", "targets_summary", "top_ops_table",
           "trace_notes", "trace_title", "waterfall_figure", "waterfall_notes", "waterfall_table"]

#: What each waterfall step adds, in words.
ADDS = {name: what for name, what, _ in WATERFALL}


def data_table(records: Sequence[Record]):
    """The bench data table: pipeline, where it runs, images (all passes), seconds, images/s, ratio."""
    names = {"spec": "spec: DataLoader, PIL transforms", "device": "device-resident loader"}
    rows = []
    for r in records:
        c, m = r.config, r.metrics
        if c["pipeline"] == "spec":
            runs_in = (f"{c['num_workers']} worker processes" if c["num_workers"]
                       else "the main process (num_workers=0)")
        elif c["device"] == "cpu":
            runs_in = f"the main process, {c.get('cpu_threads') or 'all'} torch thread(s)"
        else:
            runs_in = f"the GPU ({c['device']})"
        rows.append({"pipeline": names.get(c["pipeline"], c["pipeline"]), "runs_in": runs_in,
                     "images": m.get("loader_images"), "seconds": m.get("seconds"),
                     "images_per_s": m.get("loader_images_per_s"), "ratio_to_spec": m.get("ratio_to_spec")})
    return pd.DataFrame(rows)


def status_text(r: Record) -> str:
    """``ok``, or the status with its reason ("skipped in quick profile (...)", "oom: OOM")."""
    if r.status == "ok":
        return "ok"
    reason = r.reason or ""
    return reason if reason.lower().startswith(r.status) else f"{r.status}: {reason}"


def waterfall_table(records: Sequence[Record]):
    """One row per step: what it adds, images/s, epoch seconds, TFLOP/s, % of peak, ratio to spec.
    A device without a known peak says why in ``percent_of_peak``; a row that did not run, its reason."""
    rows = []
    for r in sorted(records, key=lambda r: r.config.get("position", 0)):
        m = r.metrics if r.status == "ok" else {}
        pct = m.get("percent_of_peak")
        rows.append({
            "step": r.config["step"], "adds": ADDS.get(r.config["step"], ""),
            "images_per_s": blank(m.get("epoch_images_per_s")),
            **{k: blank(m.get(k)) for k in ("epoch_seconds", "warmup_seconds", "compile_seconds",
                                             "achieved_tflops_per_s")},
            "percent_of_peak": pct if pct is not None else (_no_peak(r) if m else ""),
            "ratio_to_spec": blank(m.get("ratio_to_spec")), "status": status_text(r)})
    return pd.DataFrame(rows)


def _no_peak(r: Record) -> str:
    """The percent-of-peak cell of a row whose device has no peak: why (a MIG slice, or unknown)."""
    return "none (MIG slice)" if mig_profile(r.hardware.get("device_name")) else "none (peak unknown)"


def waterfall_figure(records: Sequence[Record]):
    """Bars of epoch seconds per cumulative step, annotated with images/s and the speed-up."""
    import matplotlib.pyplot as plt

    recs = sorted(records, key=lambda r: r.config.get("position", 0))
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(recs) + 1.6))
    names = [r.config["step"] for r in recs]
    secs = [r.metrics.get("epoch_seconds") if r.status == "ok" else 0.0 for r in recs]
    ypos = list(range(len(recs)))[::-1]
    ax.barh(ypos, secs, color=["#999999" if n == "spec" else "#3b75af" for n in names])
    ax.set_yticks(ypos, names)
    top = max(secs) if any(secs) else 1.0
    for y, r, s in zip(ypos, recs, secs):
        ok = r.status == "ok"
        txt = (f"{r.metrics['epoch_images_per_s']:,.0f} img/s, x{r.metrics.get('ratio_to_spec') or 1:.2f}"
               if ok else status_text(r))
        ax.text(s, y, f" {txt}", va="center", fontsize=8)
    ax.set_xlim(0, top * 1.6)
    images = recs[0].config.get("images") if recs else "?"
    ax.set_xlabel(f"seconds per epoch of {images} images (lower is better)")
    ax.set_title("From the spec configuration to the fast path, one step at a time")
    fig.tight_layout()
    return fig


def fastest_step(records: Sequence[Record]) -> str:
    """The waterfall step with the most images/s among the rows that ran."""
    ok = [r for r in records if r.status == "ok"]
    if not ok:
        raise LabError("No waterfall row ran; run bench_train first (or fix the errors it recorded).")
    return max(ok, key=lambda r: r.metrics["epoch_images_per_s"]).config["step"]


def waterfall_notes(settings: Settings, records: Sequence[Record]) -> list[str]:
    """What the waterfall's numbers mean, for the saved table."""
    images = records[0].config.get("images") if records else settings.train_images
    return [
        f"Each row: one epoch of {images} images, ResNet-18 width {settings.width}, "
        f"batch {settings.batch_size}, same initial weights; each step keeps the changes of the rows "
        "above it.",
        "epoch_seconds: wall time of the pass, device synchronized at both ends only; waiting on the loader "
        f"is included. warmup_seconds: the {settings.warmup_steps} untimed step(s) before it and one at the "
        "epoch's last, partial batch size, in every row (cuDNN's algorithm search, the allocator's growth; "
        "compile_seconds: the same, torch.compile's compilation included); never part of an epoch.",
        "achieved TFLOP/s = FLOPs per image (FlopCounterMode: convolutions and matmuls, forward + backward) "
        "x images/s. percent_of_peak divides by the device's dense peak for the row's precision "
        "(bf16 rows: bf16; fp32 rows: TF32 where cuDNN uses it); none when the peak is unknown (CPUs).",
        "images_per_s: training images / epoch_seconds (the record's epoch_images_per_s: loader waits "
        "included, unlike images_per_s of notebooks 01-02, which divides by train_seconds).",
        "ratio_to_spec: images/s over the spec row's, measured in the same run.",
    ] + [f"'{r.config['step']}': {r.metrics['graphs_compiled_in_epoch']} graph(s) compiled inside the timed "
         "epoch (0: all compilation happened in the warm-up)."
         for r in records if r.status == "ok" and r.metrics.get("graphs_compiled_in_epoch") is not None
         ] + [f"'{r.config['step']}': {r.metrics['onednn_workaround']}."
              for r in records if r.status == "ok" and r.metrics.get("onednn_workaround")]


def loader_bound_summary(data_records: Sequence[Record], train_records: Sequence[Record]) -> str:
    """One paragraph, from the measurements: is the spec configuration limited by its loader here?"""
    spec_loader_ips = next((r.metrics["loader_images_per_s"] for r in data_records
                            if r.config.get("pipeline") == "spec" and r.status == "ok"), None)
    rows = {r.config["step"]: r for r in train_records if r.status == "ok"}
    if spec_loader_ips is None or "spec" not in rows or "device_loader" not in rows:
        return "Not enough rows were measured to say whether the loader is the bottleneck here."
    spec_ips = rows["spec"].metrics["epoch_images_per_s"]
    model_ips = rows["device_loader"].metrics["epoch_images_per_s"]
    fastest = max(rows.values(), key=lambda r: r.metrics["epoch_images_per_s"])
    fast_ips = fastest.metrics["epoch_images_per_s"]
    head = (f"The spec loader alone delivers {spec_loader_ips:,.0f} images/s; the spec training runs at "
            f"{spec_ips:,.0f} images/s; the same model with the data already on the device at "
            f"{model_ips:,.0f}, and the fastest path ('{fastest.config['step']}') at {fast_ips:,.0f}. ")
    if spec_loader_ips < fast_ips:
        return head + (
            "The loader is slower than the model can train, so on this device the spec configuration "
            "measures the loader: a larger batch or more GPUs cannot push it past "
            f"{spec_loader_ips:,.0f} images/s. Batch-size sweeps and scaling curves taken with this "
            "loader (notebooks 01-03) then describe the CPU workers feeding the GPU, not the GPU or the "
            "interconnect.")
    return head + (
        "Here the model is the slower part (the loader could deliver more), so the spec numbers measure "
        "compute, and moving the data to the device changes little. On a GPU the model is far faster "
        "and the order can flip: check this table on the GPU before trusting batch-size or scaling numbers.")


def targets_summary(data_records: Sequence[Record], train_records: Sequence[Record],
                    accuracy_records: Sequence[Record] = ()) -> list[str]:
    """The issue's targets next to what was measured here (nothing claimed that was not measured)."""
    lines = []
    dev = next((r for r in data_records if r.config.get("pipeline") == "device" and r.status == "ok"), None)
    if dev is not None:
        lines.append(f"device-resident loader / spec loader: {dev.metrics['ratio_to_spec']:.1f}x on "
                     f"{dev.hardware.get('device_name')} (target on a CPU: at least 10x)")
    ok = [r for r in train_records if r.status == "ok"]
    if ok:
        best = max(ok, key=lambda r: r.metrics["epoch_images_per_s"])
        full = best.config.get("images") == data.CIFAR10_TRAIN_SIZE and best.config.get("width") == 64
        lines.append(f"fastest step '{best.config['step']}': {best.metrics['epoch_seconds']:.2f} s for "
                     f"{best.config['images']} images on {best.hardware.get('device_name')} "
                     "(target on one H100, full profile: under 2.5 s for 50,000 images"
                     + ("" if full else "; not comparable: not the full epoch of the spec model") + ")")
    d = accuracy_gain_points(accuracy_records)
    if d is not None:
        acc = accuracy_records
        full = acc[0].config.get("images") == data.CIFAR10_TRAIN_SIZE and acc[0].config.get("width") == 64
        lines.append(f"test accuracy, fast path minus spec after {acc[0].config['epochs']} epochs: {d:+.1f} "
                     "points (target on one H100, full profile: within 1 point"
                     + ("" if full else "; not comparable: too few images and a narrow model") + ")")
    return lines


def accuracy_gain_points(records: Sequence[Record]) -> float | None:
    """Test accuracy of the fast run minus the spec run's, in percentage points (None unless both ran)."""
    if len(records) != 2 or any(r.status != "ok" for r in records):
        return None
    return 100 * (records[1].metrics["test_accuracy"] - records[0].metrics["test_accuracy"])


def accuracy_table(records: Sequence[Record]):
    """One row per run of the accuracy check (the fast run's row: its gain over the spec run)."""
    df = pd.DataFrame([{"run": r.config.get("run"), "description": r.metrics.get("description"),
                        "epochs": r.config.get("epochs"), "train_seconds": r.metrics.get("train_seconds"),
                        "test_loss": r.metrics.get("test_loss"), "test_accuracy_percent":
                        None if (a := r.metrics.get("test_accuracy")) is None else 100 * a,
                        "status": status_text(r)} for r in records])
    gain = accuracy_gain_points(records)
    # the column is there however the check ended (a skipped check is one row saying why), so the
    # table keeps its columns whichever step was fastest on the day
    df["difference_points"] = ["", gain] if gain is not None else [""] * len(df)
    return df


def top_ops_table(records: Sequence[Record]):
    """The trace's top operators, in :func:`lab_utils.experiments.n08_speed_limits.worker.top_operators`'
    column order."""
    top = pd.DataFrame(records[0].metrics.get("top_ops") or [])
    return top[[c for c in ("operator", "calls", "self_ms", "percent", "self_cpu_ms") if c in top]]


def trace_title(records: Sequence[Record]) -> str:
    c = records[0].config
    return f"Top operators by self time: {c['trace_steps']} training steps of '{c['step']}' (torch.profiler)"


def trace_notes(records: Sequence[Record]) -> list[str]:
    """What the top-operator table's numbers are, and where the trace file is."""
    r = records[0]
    on_gpu = r.config.get("device") == "cuda"
    return [r.metrics.get("description", ""),
            f"self time = {'GPU kernel' if on_gpu else 'CPU'} time spent in the operator itself (ms, "
            "all traced steps); percent of the "
            f"{'GPU total kernel time' if on_gpu else 'self CPU time of all operators'}. "
            "The lab's record_function ranges (data_loader, train_step) are annotations, not operators: "
            "they are neither rows nor part of the total.",
            f"trace: results/{r.profile}/traces/{Path(r.metrics.get('trace_path', '')).name} "
            "(Chrome trace JSON: open in https://ui.perfetto.dev)"]


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--num-workers", type=int, default=None, help="spec DataLoader workers (default 2)")
    p.add_argument("--dataset", default=None, help="auto | cifar10 | synthetic")


def _machine(device: str | None) -> Machine:
    """This machine, or with ``--device cpu`` its CPU alone (one sentence for cuda without a GPU)."""
    here = Machine.here()
    if device == "cuda" and not here.gpus:
        raise LabError("device='cuda' was asked for but torch sees no GPU; use device='cpu'.")
    return replace(here, gpus=0, gpu_name=None, bf16=False) if device == "cpu" else here


def bench_data_main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils bench data``: spec DataLoader vs device-resident loader, images/s."""
    p = argparse.ArgumentParser(prog="python -m lab_utils bench data",
                                description="images/s of the spec DataLoader (PIL transforms) vs the "
                                            "device-resident loader, no model; prints the ratio.")
    _common_args(p)
    p.add_argument("--images", type=int, default=None, help="images per pass (quick: 2048, full: 50000)")
    p.add_argument("--min-seconds", type=float, default=None,
                   help="the device loader repeats passes until this long (quick 0.5, full 2)")
    a = p.parse_args(argv)
    lab = session_for(a.profile)
    store = lab.store
    s = lab.settings(Settings, data_images=a.images, batch_size=a.batch_size, num_workers=a.num_workers,
                     data_min_seconds=a.min_seconds, dataset=a.dataset)
    recs = measure(lab, LOADER_EXPERIMENT, s, force=True, machine=_machine(a.device))
    dev = recs[0].config["device"]
    print(f"profile {store.profile}, device {dev}, {recs[0].dataset}, batch {s.batch_size}, "
          f"cpu cores {recs[0].hardware.get('cpu_cores')}")
    print(data_table(recs).to_markdown(index=False, floatfmt=".4g"))
    print(f"ratio device / spec: {recs[1].metrics['ratio_to_spec']:.1f}x  "
          f"(recorded in {store.path('bench_data')})")
    return 0


def bench_train_main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils bench train``: the spec configuration vs each fast-path step added."""
    p = argparse.ArgumentParser(prog="python -m lab_utils bench train",
                                description="epoch time of the spec configuration vs each fast-path step "
                                            "added one at a time; images/s, TFLOP/s, %% of peak, ratio.")
    _common_args(p)
    p.add_argument("--images", type=int, default=None, help="images per timed epoch (quick 1024, full 50000)")
    p.add_argument("--width", type=int, default=None, help="ResNet-18 width (quick 8, full 64 = spec)")
    p.add_argument("--warmup-steps", type=int, default=None)
    p.add_argument("--steps", default=None, help=f"comma-separated subset of: {','.join(STEP_NAMES)}")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="run the torch.compile step (default: the profile's; quick: no)")
    p.add_argument("--row-timeout", type=float, default=None,
                   help="seconds one row may take before it is recorded as an error and the process "
                        "stops (quick 900, full 1800)")
    a = p.parse_args(argv)
    lab = session_for(a.profile)
    store = lab.store
    steps = tuple(s.strip() for s in a.steps.split(",") if s.strip()) if a.steps else None
    s = lab.settings(Settings, train_images=a.images, width=a.width, batch_size=a.batch_size,
                     num_workers=a.num_workers, warmup_steps=a.warmup_steps, steps=steps, compile=a.compile,
                     dataset=a.dataset, row_timeout_s=a.row_timeout)
    machine = _machine(a.device)
    print(f"profile {store.profile}, device {machine.device}, ResNet-18 width {s.width}, "
          f"batch {s.batch_size}, {s.train_images or data.CIFAR10_TRAIN_SIZE} images per epoch, "
          f"{s.warmup_steps} warm-up steps")
    recs = measure(lab, WATERFALL_EXPERIMENT, s, force=True, machine=machine)
    print(f"data: {recs[0].dataset}")
    print(waterfall_table(recs).drop(columns=["adds"]).to_markdown(index=False, floatfmt=".4g"))
    print(f"recorded in {store.path('bench_train')}")
    return 0
