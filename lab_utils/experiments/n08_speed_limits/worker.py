"""The fast path's worker (notebook 08): the loader benchmark, a waterfall row, the profiler trace and
the accuracy check, one configuration each (planned by
:mod:`lab_utils.experiments.n08_speed_limits.experiment`).

Launched like every GPU run (one process, no process group); on a CPU the plan runs it in the
notebook's process. The job's experiment says what a configuration measures:

- ``bench_data``: images/s of one loader alone, no model (:func:`time_loader`): the spec
  ``DataLoader`` (PIL transforms, ``num_workers`` processes) for one pass after an untimed batch;
  the device-resident loader for passes until ``data_min_seconds`` (one torch thread on a CPU).
- ``bench_train``: one waterfall row: ``warmup_steps`` untimed steps and one at the size of the
  epoch's last, partial batch (each shape the epoch meets: compilation, cuDNN's algorithm search with
  ``cudnn.benchmark`` and the allocator's first blocks happen there, for every row alike:
  ``warmup_seconds``), then one epoch timed with the device synchronized at its two ends only, so
  the host queues work ahead as in real training and the loader's waits are included
  (``epoch_seconds``); the FLOP rate and its percent of the device's peak (none when unknown). A
  row past ``row_timeout_s`` ends the process (:mod:`lab_utils.engine.watchdog`): its failure file
  says why, and the rows before it are kept.
- ``fastpath_trace``: ``trace_steps`` steps under ``torch.profiler`` after the warm-up: a
  Chrome/Perfetto trace (``data_loader`` and ``train_step`` ranges) and the top operators.
- ``fastpath_accuracy``: ``epochs`` epochs with a short schedule (lr warm-up over the first epoch
  from 0.01 to 0.1, then cosine to 0), timed by phase (``train_seconds``, loader waits excluded),
  then test loss and accuracy in fp32 on the eager model (the device loader's test pipeline).

``ratio_to_spec`` is a rate over the spec row's, measured in the same launch (a ``together`` group
whose spec row runs first). A ``torch.compile`` failure is an ``error`` row that says why.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from lab_utils.engine import watchdog
from lab_utils.engine.backends import pinned_threads
from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import device_name, peak_flops_per_s
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.memory import is_out_of_memory
from lab_utils.engine.records import Record, write_rank_failure
from lab_utils.experiments.n08_speed_limits.fast_train import (
    TrainOptions,
    build_trainer,
    compiled_graphs,
    peak_precision,
    resolved_sgd,
    to_device,
    warm_up,
)
from lab_utils.experiments.shared.data import ArraySplit, device_loader, load_split, spec_loader
from lab_utils.learn.devices import peak_memory, reset_peak_memory
from lab_utils.learn.errors import error_line
from lab_utils.learn.evaluation import evaluate
from lab_utils.learn.flops import mfu
from lab_utils.learn.models import flops_per_image
from lab_utils.learn.schedules import LRSchedule
from lab_utils.learn.timing import synchronize

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that records of the old meaning are measured again, not reused.
#: 2 (issue 26): images/s of a waterfall row is
#: ``epoch_images_per_s`` (over epoch_seconds), the loader's ``loader_images_per_s``; the accuracy
#: check's ``train_seconds`` excludes loader waits (its epochs are timed by phase). 3 (issue 32): the
#: loader benchmark's image count is ``loader_images`` (``images`` are always trained on). 4 (issue 49):
#: every waterfall row warms the epoch's last, partial batch shape too (before, only compiled rows did:
#: the others timed cuDNN's algorithm search for it inside their epoch).
METRICS_VERSION = 4

#: The ``record_function`` labels the lab puts around its own code in a trace.
TRACE_LABELS: tuple[str, ...] = ("data_loader", "train_step")


def prepare(job: Job, ctx: DistContext) -> dict[str, Any]:
    """The images the job's configurations read (one training split; the test split for accuracy)."""
    c, dataset = job.configs[0], job.options.get("dataset")
    return {"train": load_split(True, c["images"], dataset),
            "test": load_split(False, c["test_images"], dataset) if "test_images" in c else None}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> list[Record]:
    """One configuration of ``job.experiment`` (see the module docstring); its record."""
    measure = {"bench_data": _loader_row, "bench_train": _waterfall_row, "fastpath_trace": _trace,
               "fastpath_accuracy": _accuracy}[job.experiment]
    status, reason = "ok", None
    try:
        metrics = measure(config, job, ctx, state)
    except Exception as e:  # torch.compile can fail for reasons outside the lab (compiler, Triton)
        if not config.get("compile") or is_out_of_memory(e):
            raise
        metrics, status, reason = {}, "error", f"torch.compile failed: {error_line(e)}"
    split: ArraySplit = state["train"]
    return [Record(job.experiment, dict(config), metrics, status=status, reason=reason, profile=job.profile,
                   synthetic=split.synthetic, dataset=split.dataset_name, hardware=ctx.hardware())]


def _ratio_to_spec(state: dict[str, Any], spec: bool, rate: float) -> float | None:
    """``rate`` over the spec row's rate of this launch (the spec row runs first)."""
    if spec:
        state["spec_rate"] = rate
    return rate / state["spec_rate"] if state.get("spec_rate") else None


def _trainer_and_loader(opts: TrainOptions, c: dict[str, Any], job: Job, split: ArraySplit,
                        device: torch.device):
    """The row's trainer (seeded: every row starts from the same weights) and the loader it names."""
    seed = job.options.get("seed", 0)
    trainer = build_trainer(opts, c["width"], device, seed=seed)
    if opts.loader == "spec":
        return trainer, spec_loader(split, c["batch_size"], opts.num_workers, seed=seed)
    return trainer, device_loader(split, device, c["batch_size"], seed=seed, channels_last=opts.channels_last)


# --------------------------------------------------------------------------- the loader alone


def time_loader(loader, device: torch.device, min_seconds: float = 0.0) -> dict[str, float]:
    """Images/s of iterating ``loader`` (no model): full passes until ``min_seconds`` have elapsed.

    One batch is taken first and not timed (worker start-up). Each batch is touched on the
    device (nothing else), and the device is synchronized at the end.
    """
    next(iter(loader), None)
    images = passes = 0
    synchronize(device)
    t0 = time.perf_counter()
    while True:
        for _x, y in loader:
            images += int(y.shape[0])
        passes += 1
        synchronize(device)
        seconds = time.perf_counter() - t0
        if seconds >= min_seconds:
            break
    return {"loader_images": images, "passes": passes, "seconds": seconds,
            "loader_images_per_s": images / seconds}


def _loader_row(c: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    split, seed, dev = state["train"], job.options.get("seed", 0), ctx.device
    if c["pipeline"] == "spec":
        m = time_loader(spec_loader(split, c["batch_size"], c["num_workers"], seed=seed), dev)
    else:  # on a CPU one thread: its tensor operations are too small to gain from more
        with pinned_threads(c.get("cpu_threads")):
            m = time_loader(device_loader(split, dev, c["batch_size"], seed=seed), dev,
                            job.options.get("data_min_seconds", 0.0))
    m["ratio_to_spec"] = _ratio_to_spec(state, c["pipeline"] == "spec", m["loader_images_per_s"])
    return m


# --------------------------------------------------------------------------- a waterfall row


def _waterfall_row(c: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    def expired(message: str) -> None:  # the watchdog's thread, just before it ends the process
        write_rank_failure(job.folder, ctx.rank, "error", message.removeprefix("error: "),
                           job.configs.index(c))

    with watchdog.deadline(job.options.get("row_timeout_s"),
                           f"waterfall row '{c['step']}' (warm-up, compilation and timed epoch)",
                           "rows stored before it are kept; raise --row-timeout, or leave the step out with "
                           "--steps", on_expiry=expired):
        m = timed_epoch(TrainOptions.from_config(c), c, job, state["train"], ctx.device)
    m["ratio_to_spec"] = _ratio_to_spec(state, c["step"] == "spec", m["epoch_images_per_s"])
    return m


def timed_epoch(opts: TrainOptions, c: dict[str, Any], job: Job, split: ArraySplit,
                 device: torch.device) -> dict[str, Any]:
    """Warm up every batch shape of the epoch (the full one and the last, partial one: cuDNN's benchmark
    cache, the allocator and torch.compile are keyed by shape, dtype and layout, so a shape first met in
    the timed epoch would put its search there, in some rows and not in others), then one epoch
    synchronized at its ends only."""
    trainer, loader = _trainer_and_loader(opts, c, job, split, device)
    warm_s = warm_up(trainer, loader, c["warmup_steps"], len(split) % c["batch_size"])
    reset_peak_memory(device)
    before = compiled_graphs()
    ep = trainer.epoch(loader)
    after = compiled_graphs()
    name = device_name(str(device))
    flops = flops_per_image(c["width"]).train_flops
    rate = ep.images / ep.epoch_seconds if ep.epoch_seconds > 0 else math.nan
    precision = peak_precision(opts, name)
    frac = mfu(flops, rate, peak_flops_per_s(name, precision), 1)
    compiled = None if before is None or after is None else after - before
    return {"epoch_seconds": ep.epoch_seconds, "images": ep.images, "steps": ep.steps,
            "epoch_images_per_s": rate, "warmup_seconds": warm_s,
            "compile_seconds": warm_s if opts.compile else None,
            "train_flops_per_image": flops, "achieved_tflops_per_s": flops * rate / 1e12,
            "peak_precision": precision, "percent_of_peak": None if frac is None else 100 * frac,
            "loss": ep.loss, "sgd_resolved": resolved_sgd(opts.sgd, device),
            "graphs_compiled_in_epoch": compiled if opts.compile else None,
            "peak_memory_bytes": peak_memory(device), "onednn_workaround": trainer.onednn_workaround,
            "description": opts.describe()}


# --------------------------------------------------------------------------- the profiler trace


def _trace(c: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    dev, opts, path = ctx.device, TrainOptions.from_config(c), Path(job.options["trace_path"])
    if dev.type == "cpu":
        # Without a GPU, kineto (the profiler's C++ side) prints stage markers and an ERROR line,
        # "gpuGetDeviceCount failed", that only says there is no GPU: noise under the cell. Level 6
        # silences it; on a GPU its errors (e.g. no CUPTI permission) matter. A user's value wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    trainer, loader = _trainer_and_loader(opts, c, job, state["train"], dev)
    warm_s = warm_up(trainer, loader, max(job.options.get("warmup_steps", 1), 1),
                     len(state["train"]) % c["batch_size"])   # the traced steps may reach the last batch
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    done = 0
    with profile(activities=activities) as prof:
        while done < c["trace_steps"]:
            it = iter(loader)
            while done < c["trace_steps"]:
                with record_function("data_loader"):
                    batch = next(it, None)
                if batch is None:
                    break
                with record_function("train_step"):
                    trainer.step(*to_device(*batch, dev, opts.channels_last))
                done += 1
        synchronize(dev)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    prof.export_chrome_trace(str(tmp))
    tmp.replace(path)
    return {"trace_path": str(path), "trace_bytes": path.stat().st_size, "warmup_seconds": warm_s,
            "steps_traced": done, "top_ops": top_operators(prof, job.options.get("top_ops", 12), dev.type),
            "description": opts.describe()}


def is_annotation(event) -> bool:
    """Whether a profiler event (or ``key_averages`` row) is a user annotation, not an operator: a
    ``record_function`` range (``is_user_annotation``), the lab's :data:`TRACE_LABELS` (in case a torch
    version does not set that flag), or a profiler schedule's ``ProfilerStep#N``."""
    key = getattr(event, "key", None) or getattr(event, "name", "")
    return bool(getattr(event, "is_user_annotation", False)) or key in TRACE_LABELS \
        or key.startswith("ProfilerStep")


def top_operators(prof, n: int = 12, device_type: str = "cpu") -> list[dict[str, Any]]:
    """The ``n`` operators with the most self time, in ms over all traced steps: kernel time on a GPU,
    CPU time otherwise. Annotations (:func:`is_annotation`) are neither rows nor in the total: on a
    GPU a range's ``gpu_user_annotation`` copy spans every kernel it encloses (counted twice else).

    - CPU: ``percent`` is of the self CPU time of all operators (all of them add up to 100).
    - GPU: the rows are the host operators (``aten::...``), ``self_ms`` the time of the kernels each
      launched itself, the host's ``self_cpu_ms`` next to it; ``percent`` is of the GPU's total kernel
      time (the device events, as ``key_averages().table()`` sums them), so a kernel counts once.
      Kernels launched outside any operator are in the total without a row (percentages add up to at
      most 100). If no operator carries kernel time, the kernels themselves are the rows.
    """
    events = [e for e in prof.key_averages() if not is_annotation(e)]
    on_gpu = device_type == "cuda"

    def self_us(e) -> float:
        return float(e.self_device_time_total if on_gpu else e.self_cpu_time_total)

    if on_gpu:
        kernels = [e for e in events if _device_type_name(e) != "CPU"]
        total = sum(self_us(e) for e in kernels)
        ops = [e for e in events if _device_type_name(e) == "CPU"]
        if not any(self_us(e) > 0 for e in ops):
            ops = kernels
    else:
        ops = events
        total = sum(self_us(e) for e in ops)
    total = total or 1.0
    rows = []
    for e in sorted(ops, key=self_us, reverse=True)[:n]:
        row = {"operator": e.key, "calls": int(e.count), "self_ms": self_us(e) / 1e3,
               "percent": 100 * self_us(e) / total}
        if on_gpu:  # the host time the operator cost, next to its kernel time
            row["self_cpu_ms"] = e.self_cpu_time_total / 1e3
        rows.append(row)
    return rows


def _device_type_name(event) -> str:
    """``"CPU"``, ``"CUDA"``, ... of a profiler event (``DeviceType.CUDA`` -> ``"CUDA"``)."""
    return str(getattr(event, "device_type", "CPU")).rsplit(".", 1)[-1]


# --------------------------------------------------------------------------- the accuracy check


def _accuracy(c: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    dev, opts = ctx.device, TrainOptions.from_config(c)
    steps_per_epoch = math.ceil(c["images"] / c["batch_size"])
    total = steps_per_epoch * c["epochs"]
    sched = LRSchedule(peak_lr=0.1, total_steps=total, warmup_steps=min(steps_per_epoch, total),
                       warmup_start_lr=0.01, decay="cosine")
    trainer, loader = _trainer_and_loader(opts, c, job, state["train"], dev)
    eps = [trainer.epoch(loader, schedule=sched, first_step=e * steps_per_epoch, timed=True)
           for e in range(c["epochs"])]
    ev = evaluate(trainer.model, device_loader(state["test"], dev, c["batch_size"], augment=False,
                                               shuffle=False), dev)
    return {"train_seconds": sum(e.train_seconds for e in eps), "train_loss": eps[-1].loss,
            "test_loss": ev.loss, "test_accuracy": ev.accuracy, "description": opts.describe()}


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
