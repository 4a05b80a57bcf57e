"""The fast path: CIFAR-10 resident on the device, and switchable training options.

Notebooks 01-03 train with the assignment's pipeline: a ``DataLoader`` whose worker
processes decode every image into PIL, pad, crop, flip, convert and normalize it one
image at a time. This module keeps the whole uint8 data set on the device instead
(moved there once) and does the same augmentation for a whole batch in a few tensor
operations, so that the loader stops being the bottleneck. It then adds the usual
training speed-ups one at a time, each switchable and recorded in the results:

- ``loader="device"``: :class:`~lab_utils.core.data.DeviceLoader` instead of the spec ``DataLoader``;
- ``channels_last``: NHWC memory layout for the model and its input;
- ``bf16``: ``torch.autocast`` with bfloat16 (the loss and optimizer stay fp32);
- ``sgd="fused"`` (or ``"foreach"``): the multi-tensor / fused SGD kernels;
- ``compile``: ``torch.compile`` of the model. Compilation happens in the warm-up
  steps, whose time is reported separately (``warmup_seconds``), never inside an epoch.

Everything runs on the CPU too (the "device" is then the CPU).

Same augmentation as the spec
-----------------------------
``RandomCrop(32, padding=4)`` pads with zeros and picks the top-left corner uniformly
in 0..8 for rows and columns; ``RandomHorizontalFlip(0.5)`` flips with probability
1/2; ``ToTensor`` divides by 255; ``Normalize`` subtracts the mean and divides by the
std per channel. :class:`~lab_utils.core.data.DeviceLoader` draws the same offsets and flips (uniform over
0..8, probability 1/2, independent per image), gathers the crop (and flip) as one
index operation on the zero-padded uint8 images, and applies
``(x / 255 - mean) / std`` in float32. For a given offset and flip the result equals
torchvision's to float rounding (tested), and the distributions are compared
statistically in the tests.

Benchmarks (``python -m lab_utils bench data|train``)
-----------------------------------------------------
- :func:`measure_data`: images/s of the spec pipeline (``DataLoader`` with PIL
  transforms, ``num_workers=2``) and of :class:`~lab_utils.core.data.DeviceLoader`, no model, measured
  side by side in one run; the ratio is device / spec.
- :func:`measure`: the waterfall. One epoch of the same model on the same number
  of images for the spec configuration and for each fast-path step added on top of
  the previous ones; images/s, epoch seconds, achieved TFLOP/s (FLOPs counted with
  :mod:`lab_utils.core.flops`), percent of the device's peak (:mod:`lab_utils.core.hardware`;
  none when the peak is unknown, e.g. on a CPU) and the speed-up over the spec row.

What an epoch time includes: the wall time from the first batch request to the last
optimizer step of one pass over the images, the device synchronized at both ends and
nowhere in between (so the host can queue work ahead, as in real training). Waiting on
the loader is included, which is the point. Warm-up steps (and compilation) are not.
Records go to the experiments ``bench_data`` and ``bench_train``; the profiler trace
(:func:`measure_trace`) and the accuracy check (:func:`measure_accuracy`) to ``fastpath_trace`` and
``fastpath_accuracy``. This module measures; the options and the trainer are in
:mod:`lab_utils.experiments.fast_train`, the tables, figure, summaries and the ``bench`` commands in
:mod:`lab_utils.experiments.fastpath_tables`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab_utils.core import data, profiles, watchdog
from lab_utils.core.backends import pinned_threads
from lab_utils.core.config import check_batch_size, check_positive_int
from lab_utils.core.data import (  # the fast path's loaders live with the other loaders
    ArraySplit,
    check_num_workers,
    device_loader,
    load_split,
    spec_loader,
)
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import (
    device_name,
    fraction_of_peak,
    hardware_summary,
)
from lab_utils.core.loop import (
    evaluate,
    peak_memory,
    reset_peak_memory,
)
from lab_utils.core.memory import catch_oom, free_device_memory
from lab_utils.core.schedules import LRSchedule
from lab_utils.core.timing import synchronize
from lab_utils.experiments.fast_train import (
    STEP_NAMES,
    WATERFALL,
    TrainOptions,
    bf16_supported,
    build_trainer,
    compiled_graphs,
    peak_precision,
    resolved_sgd,
    to_device,
    train_flops_per_image,
    warm_up,
    waterfall_steps,
)
from lab_utils.session import session_for
from lab_utils.store import Record, ResultStore

__all__ = ["METRICS_VERSION", "Settings", "TraceResult", "evaluate_arrays", "is_annotation", "measure",
           "measure_accuracy", "measure_config", "measure_data", "measure_trace", "plan_waterfall",
           "time_loader", "top_operators", "trace_dir"]

#: In every resume key of this module: bumped when a metric changes meaning, so that records of the
#: old meaning are measured again, not reused. 2 (issue 26): images/s of a waterfall row is
#: ``epoch_images_per_s`` (over epoch_seconds), the loader's ``loader_images_per_s``; the accuracy
#: check's ``train_seconds`` excludes loader waits (its epochs are timed by phase). 3 (issue 32): the
#: loader benchmark's image count is ``loader_images`` (``images`` are always trained on).
METRICS_VERSION = 3

# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class Settings:
    """Per-profile knobs of notebook 08 and the two benchmarks.

    ``train_images`` / ``data_images`` of None mean the whole training split.
    """

    width: int                      # ResNet-18 width (64: the spec model)
    train_images: int | None        # images per timed epoch in bench train
    data_images: int | None         # images per pass in bench data
    batch_size: int = 128
    num_workers: int = 2            # the spec pipeline's DataLoader workers
    warmup_steps: int = 2           # untimed steps before each timed epoch (compilation happens here)
    data_min_seconds: float = 1.0   # the device loader repeats passes until at least this long
    compile: bool = True            # run the torch.compile step (else a row "skipped in quick profile")
    trace_steps: int = 3            # profiler: steps traced
    top_ops: int = 12               # rows of the top-operator table
    accuracy_epochs: int = 0        # short-schedule accuracy check (0: not run)
    test_images: int | None = None
    steps: tuple[str, ...] = STEP_NAMES
    dataset: str | None = None      # "auto" | "cifar10" | "synthetic" (None: $LAB_DATASET or auto)
    seed: int = 0
    # The longest one waterfall row (warm-up, compilation, timed epoch) may take, in seconds;
    # past it the row is stored as an error and the process stops (lab_utils.core.watchdog).
    row_timeout_s: float | None = 1800.0

    def validate(self) -> Settings:
        check_positive_int(self.width, "width")
        check_batch_size(self.batch_size)
        for name in ("train_images", "data_images", "test_images"):
            v = getattr(self, name)
            if v is not None:
                check_positive_int(v, name)
        check_num_workers(self.num_workers)
        for name in ("warmup_steps", "accuracy_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise LabError(f"{name} must be a whole number >= 0, got {v!r}.")
        check_positive_int(self.trace_steps, "trace_steps")
        check_positive_int(self.top_ops, "top_ops")
        if not self.data_min_seconds >= 0:
            raise LabError(f"data_min_seconds must be >= 0, got {self.data_min_seconds!r}.")
        if self.row_timeout_s is not None and not self.row_timeout_s > 0:
            raise LabError(f"row_timeout_s must be a positive number of seconds (or None), "
                           f"got {self.row_timeout_s!r}.")
        waterfall_steps(self.num_workers, self.steps)  # validates step names
        return self


profiles.register(Settings, profiles.FAST, "fast-path")


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LabError("device='cuda' was asked for but torch sees no GPU; use device='cpu'.")
    return dev


def _store_device(lab: Any, settings: Settings, device: torch.device | str | None
                  ) -> tuple[ResultStore, torch.device]:
    """The session's store and the device to measure on (``device``, else the session's), checked."""
    settings.validate()
    lab = session_for(lab)
    return lab.store, _device(device if device is not None else getattr(lab, "device", None))


def _hardware(device: torch.device) -> dict:
    return hardware_summary(str(device), 1)


# --------------------------------------------------------------------------- bench data


def time_loader(loader, device: torch.device, min_seconds: float = 0.0, warmup_batches: int = 1
                ) -> dict[str, float]:
    """Images/s of iterating ``loader`` (no model): full passes until ``min_seconds`` have elapsed.

    ``warmup_batches`` are taken first and not timed (worker start-up). Each batch is
    touched on the device (nothing else), and the device is synchronized at the end.
    """
    it = iter(loader)
    for _ in range(warmup_batches):
        next(it, None)
    del it
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


def measure_data(lab: Any, settings: Settings, force: bool = False,
                 device: torch.device | str | None = None) -> list[Record]:
    """Spec pipeline vs device-resident loader, images/s, measured side by side; two records.

    Both read the same images (``settings.data_images``) with batch ``settings.batch_size``.
    The spec row iterates one pass of the ``DataLoader`` (``num_workers`` processes,
    PIL transforms) after one untimed batch that starts the workers; the device row
    repeats passes until ``data_min_seconds``. On a CPU the device loader runs with one
    torch thread (one core, against the spec loader's ``num_workers`` processes, so the
    ratio is conservative; its tensor operations are too small to gain from threads,
    and threads of a busy machine stall each other). Stored records are reused only
    when both come from the same run (``force=True`` always measures).
    """
    store, dev = _store_device(lab, settings, device)
    common = {"images": settings.data_images or data.CIFAR10_TRAIN_SIZE, "batch_size": settings.batch_size,
              "device": dev.type, "metrics_version": METRICS_VERSION}
    threads = 1 if dev.type == "cpu" else None
    cfgs = [{"pipeline": "spec", "num_workers": settings.num_workers, **common},
            {"pipeline": "device", "num_workers": 0, "cpu_threads": threads, **common}]

    def loaders(todo):
        split = load_split(True, settings.data_images, settings.dataset)
        spec = spec_loader(split, settings.batch_size, settings.num_workers, seed=settings.seed)
        m_spec = time_loader(spec, dev, min_seconds=0.0, warmup_batches=1)
        del spec
        dl = device_loader(split, dev, settings.batch_size, seed=settings.seed)
        with pinned_threads(threads):
            m_dev = time_loader(dl, dev, min_seconds=settings.data_min_seconds, warmup_batches=1)
        m_dev["ratio_to_spec"] = m_dev["loader_images_per_s"] / m_spec["loader_images_per_s"]
        m_spec["ratio_to_spec"] = 1.0
        for cfg, m in zip(cfgs, (m_spec, m_dev)):
            yield Record("bench_data", cfg, m, synthetic=split.synthetic, dataset=split.dataset_name,
                         hardware=_hardware(dev))

    return store.run_many("bench_data", cfgs, loaders, force=force, hardware=_hardware(dev), together=True)


# --------------------------------------------------------------------------- bench train


def _train_cfg(step: str, position: int, options: TrainOptions, settings: Settings, images: int,
               device: torch.device) -> dict[str, Any]:
    return {"step": step, "position": position, **options.as_config(), "width": settings.width,
            "images": images, "batch_size": settings.batch_size, "warmup_steps": settings.warmup_steps,
            "device": device.type, "metrics_version": METRICS_VERSION}


def _skip_reason(step: str, options: TrainOptions, settings: Settings, device: torch.device,
                 profile: str) -> str | None:
    if options.bf16 and not bf16_supported(device):
        return "this GPU has no bf16 (needs Ampere or newer)"
    if step == "compile" and not settings.compile:
        return f"skipped in {profile} profile (torch.compile of ResNet-18 takes minutes on a CPU)"
    return None


def _trainer_and_loader(options: TrainOptions, settings: Settings, split: ArraySplit, device: torch.device):
    """The fast path's trainer for ``options`` and the loader it names (the spec's, or on the device)."""
    trainer = build_trainer(options, settings.width, device, seed=settings.seed)
    if options.loader == "spec":
        return trainer, spec_loader(split, settings.batch_size, options.num_workers, seed=settings.seed)
    return trainer, device_loader(split, device, settings.batch_size, seed=settings.seed,
                                  channels_last=options.channels_last)


def measure_config(options: TrainOptions, settings: Settings, split: ArraySplit,
                   device: torch.device) -> dict[str, Any]:
    """Warm up, then time one epoch of ``split`` with ``options``; the metrics of one waterfall row."""
    trainer, loader = _trainer_and_loader(options, settings, split, device)
    remainder = len(split) % settings.batch_size if options.compile else 0
    warm_s = warm_up(trainer, loader, settings.warmup_steps, remainder)
    reset_peak_memory(device)
    graphs_before = compiled_graphs()
    ep = trainer.epoch(loader)
    graphs_after = compiled_graphs()
    in_epoch = None if graphs_before is None or graphs_after is None else graphs_after - graphs_before
    name = device_name(str(device))
    flops = train_flops_per_image(settings.width)
    rate = ep.images / ep.epoch_seconds if ep.epoch_seconds > 0 else math.nan
    achieved = flops * rate
    precision = peak_precision(options, name)
    frac = fraction_of_peak(achieved, name, precision)
    return {"epoch_seconds": ep.epoch_seconds, "images": ep.images, "steps": ep.steps,
            "epoch_images_per_s": rate, "warmup_seconds": warm_s,
            "compile_seconds": warm_s if options.compile else None,
            "train_flops_per_image": flops, "achieved_tflops_per_s": achieved / 1e12,
            "peak_precision": precision, "percent_of_peak": None if frac is None else 100 * frac,
            "loss": ep.loss, "sgd_resolved": resolved_sgd(options.sgd, device),
            "graphs_compiled_in_epoch": in_epoch if options.compile else None,
            "peak_memory_bytes": peak_memory(device), "onednn_workaround": trainer.onednn_workaround}


def measure(lab: Any, settings: Settings, force: bool = False, verbose: bool = False,
            device: torch.device | str | None = None) -> list[Record]:
    """The waterfall: spec configuration, then each fast-path step added on top; one record per row.

    Every row trains the same ResNet-18 (same initial weights) for one timed epoch on
    the same ``train_images`` images after ``warmup_steps`` untimed steps. A row that
    cannot run says why (status ``skipped``/``oom``/``error``). ``ratio_to_spec`` is
    images/s over the spec row's, measured in the same run. Stored rows are reused
    only when all come from one run (``force=True`` always measures).
    """
    store, dev = _store_device(lab, settings, device)
    images = min(settings.train_images or data.CIFAR10_TRAIN_SIZE, data.CIFAR10_TRAIN_SIZE)
    plan = plan_waterfall(settings, dev, store.profile)
    cfgs = [_train_cfg(name, i, opts, settings, images, dev) for i, (name, _, opts, _) in enumerate(plan)]
    hw = _hardware(dev)

    def rows(todo):
        split = load_split(True, images, settings.dataset)
        common = {"synthetic": split.synthetic, "dataset": split.dataset_name, "hardware": hw}
        spec_ips = None
        for (name, what, opts, reason), cfg in zip(plan, cfgs):
            metrics: dict[str, Any] = {"adds": what, "description": opts.describe()}
            if reason is not None:
                if verbose:
                    print(f"{name:<14} skipped: {reason}")
                yield Record("bench_train", cfg, metrics, status="skipped", reason=reason, **common)
                continue
            failure: str | None = None

            def record_expiry(message: str, cfg=cfg, metrics=metrics, common=common) -> None:
                # from the watchdog's thread, just before it ends the process: a row saying why
                why = message.removeprefix("error: ")
                store.run("bench_train", cfg, lambda: Record("bench_train", cfg, metrics, status="error",
                                                             reason=why, **common), force=True, hardware=hw)

            try:
                # catch_oom swallows out-of-memory (and keeps only its reason), so the memory
                # the failed step held is freed below, outside any except block. The deadline
                # ends the process if the row hangs in native code (see lab_utils.core.watchdog).
                with catch_oom() as oom, watchdog.deadline(
                        settings.row_timeout_s,
                        f"waterfall row '{name}' (warm-up, compilation and timed epoch)",
                        "rows stored before it are kept; raise --row-timeout, or leave the step out with "
                        "--steps", on_expiry=record_expiry):
                    metrics.update(measure_config(opts, settings, split, dev))
            except Exception as e:  # torch.compile can fail for reasons outside the lab (compiler, triton)
                if not opts.compile:
                    raise
                msg = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
                failure = f"torch.compile failed: {type(e).__name__}: {msg}"
            if oom or failure is not None:
                free_device_memory(dev)
                status, why = ("oom", oom.reason) if oom else ("error", failure)
                if verbose:
                    print(f"{name:<14} {status}: {why}")
                yield Record("bench_train", cfg, metrics, status=status, reason=why, **common)
                continue
            if name == "spec":
                spec_ips = metrics["epoch_images_per_s"]
            metrics["ratio_to_spec"] = metrics["epoch_images_per_s"] / spec_ips if spec_ips else None
            if verbose:
                print(f"{name:<14} {metrics['epoch_images_per_s']:>10.0f} images/s  "
                      f"{metrics['epoch_seconds']:.3f} s  x{metrics['ratio_to_spec'] or math.nan:.2f}")
            yield Record("bench_train", cfg, metrics, **common)

    return store.run_many("bench_train", cfgs, rows, force=force, hardware=hw, together=True)


def plan_waterfall(settings: Settings, device: torch.device, profile: str
                   ) -> list[tuple[str, str, TrainOptions, str | None]]:
    """(step, what it adds, options, skip reason or None) for each row, cumulative.

    A step that cannot run here (bf16 on a GPU without it, compile where the profile
    skips it) is a row with its reason, and later steps build on the last step that runs.
    """
    chosen = [name for name, _, _ in waterfall_steps(settings.num_workers, settings.steps)]
    opts = TrainOptions(num_workers=settings.num_workers)
    plan = []
    for name, what, change in WATERFALL:
        if name not in chosen:
            continue
        candidate = replace(opts, **change)
        reason = _skip_reason(name, candidate, settings, device, profile)
        plan.append((name, what, candidate, reason))
        if reason is None:
            opts = candidate
    return plan


# --------------------------------------------------------------------------- profiler trace


@dataclass
class TraceResult:
    """A saved profiler trace and its top operators (a pandas DataFrame)."""

    record: Record
    path: Path
    top_ops: Any

    @property
    def title(self) -> str:
        c = self.record.config
        return (f"Top operators by self time: {c['trace_steps']} training steps of '{c['step']}' "
                "(torch.profiler)")

    @property
    def notes(self) -> list[str]:
        on_gpu = self.record.config.get("device") == "cuda"
        return [self.record.metrics.get("description", ""),
                f"self time = {'GPU kernel' if on_gpu else 'CPU'} time spent in the operator itself (ms, "
                "all traced steps); percent of the "
                f"{'GPU total kernel time' if on_gpu else 'self CPU time of all operators'}. "
                "The lab's record_function ranges (data_loader, train_step) are annotations, not operators: "
                "they are neither rows nor part of the total.",
                f"trace: results/{self.record.profile}/traces/{self.path.name} "
                "(Chrome trace JSON: open in https://ui.perfetto.dev)"]


def trace_dir(store: ResultStore) -> Path:
    """``results/<profile>/traces``."""
    return store.root / "traces"


#: The ``record_function`` labels the lab puts around its own code in a trace.
TRACE_LABELS: tuple[str, ...] = ("data_loader", "train_step")


def is_annotation(event) -> bool:
    """Whether a profiler event (or its ``key_averages`` row) is a user annotation, not an operator.

    True for ``record_function`` ranges (``FunctionEvent.is_user_annotation``, set by
    torch's profiler for CPU ranges and their ``gpu_user_annotation`` copies), for the
    lab's own :data:`TRACE_LABELS` (in case a torch version does not set that flag) and
    for the ``ProfilerStep#N`` ranges of a profiler schedule.
    """
    key = getattr(event, "key", None) or getattr(event, "name", "")
    return bool(getattr(event, "is_user_annotation", False)) or key in TRACE_LABELS \
        or key.startswith("ProfilerStep")


def top_operators(prof, n: int = 12, device_type: str = "cpu") -> list[dict[str, Any]]:
    """The ``n`` operators with the most self time (kernel time on a GPU, CPU time otherwise).

    Times in milliseconds over all traced steps. User annotations are not operators and
    are left out of the rows *and* of the total (:func:`is_annotation`): the lab's own
    ``record_function`` ranges (``data_loader``, ``train_step``; on a GPU their
    ``gpu_user_annotation`` copies span every kernel they enclose, so counting them would
    count that time twice) and ``ProfilerStep#N``.

    - CPU: ``self_ms`` is an operator's self CPU time; ``percent`` is of the self CPU
      time of all operators, so the percentages of all operators (shown or not) add up
      to 100.
    - GPU: the rows are the host-side operators (``aten::...``), ``self_ms`` the time of
      the kernels each launched itself, with the host's ``self_cpu_ms`` next to it;
      ``percent`` is of the GPU's total kernel time (the device events, as torch's own
      ``key_averages().table()`` sums them), so a kernel is counted once, not once for
      its operator and again for itself. Kernels launched outside any operator are in
      the total without a row, so the percentages add up to at most 100. (If no
      operator carries kernel time, the kernels themselves are the rows.)
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


def measure_trace(lab: Any, settings: Settings, options: TrainOptions, step: str = "", force: bool = False,
                  device: torch.device | str | None = None) -> TraceResult:
    """Profile ``settings.trace_steps`` training steps with ``options`` and save a Chrome/Perfetto trace.

    ``self_ms`` is GPU kernel time on a GPU (with the host's ``self_cpu_ms`` next to
    it) and CPU time on a CPU. The steps run after ``warmup_steps`` untimed ones (compilation included), under
    ``torch.profiler`` (CPU, plus CUDA when on a GPU). The trace is written to
    ``results/<profile>/traces/fastpath_<step>.json`` (open it at https://ui.perfetto.dev).
    The loader's work shows up as ``data_loader`` ranges and each step as ``train_step``.
    """
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile, record_function

    store, dev = _store_device(lab, settings, device)
    if dev.type == "cpu":
        # Without a GPU, kineto (the profiler's C++ side) prints its stage markers and an ERROR
        # line, "gpuGetDeviceCount failed", that only says there is no GPU: noise under the
        # cell. Level 6 silences it (5 would still print the USDT start/stop markers). On a
        # GPU its errors (e.g. no CUPTI permission) matter, so they stay. A user's value wins.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    images = min(settings.train_images or data.CIFAR10_TRAIN_SIZE, data.CIFAR10_TRAIN_SIZE)
    name = step or ("fast" if options.loader == "device" else "spec")
    path = trace_dir(store) / f"fastpath_{name}.json"
    cfg = {"step": name, **options.as_config(), "width": settings.width, "images": images,
           "batch_size": settings.batch_size, "trace_steps": settings.trace_steps, "device": dev.type}
    def profile_steps() -> Record:
        split = load_split(True, images, settings.dataset)
        trainer, loader = _trainer_and_loader(options, settings, split, dev)
        warm_s = warm_up(trainer, loader, max(settings.warmup_steps, 1))
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        done = 0
        with profile(activities=activities) as prof:
            while done < settings.trace_steps:
                it = iter(loader)
                while done < settings.trace_steps:
                    with record_function("data_loader"):
                        batch = next(it, None)
                    if batch is None:
                        break
                    with record_function("train_step"):
                        x, y = to_device(*batch, dev, options.channels_last)
                        trainer.step(x, y)
                    done += 1
            synchronize(dev)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        prof.export_chrome_trace(str(tmp))
        tmp.replace(path)
        ops = top_operators(prof, settings.top_ops, dev.type)
        metrics = {"trace_path": str(path), "trace_bytes": path.stat().st_size, "warmup_seconds": warm_s,
                   "steps_traced": done, "top_ops": ops, "description": options.describe()}
        return Record("fastpath_trace", cfg, metrics, synthetic=split.synthetic, dataset=split.dataset_name,
                      hardware=_hardware(dev))

    # a stored record is reused only while its trace file is still there
    rec = store.run("fastpath_trace", cfg, profile_steps, force=force or not path.exists(),
                    hardware=_hardware(dev))
    # the columns in top_operators' order (a stored record's dicts come back with sorted keys)
    top = pd.DataFrame(rec.metrics["top_ops"])
    order = ["operator", "calls", "self_ms", "percent", "self_cpu_ms"]
    return TraceResult(rec, path, top[[c for c in order if c in top]])


# --------------------------------------------------------------------------- accuracy check


def measure_accuracy(lab: Any, settings: Settings, fast: TrainOptions, fast_step: str = "fast",
                     force: bool = False, device: torch.device | str | None = None) -> list[Record]:
    """Train the spec configuration and ``fast`` for ``accuracy_epochs`` with the same short schedule.

    Same initial weights, same images, batch ``batch_size``, lr warm-up over the first
    epoch from 0.01 to 0.1 then cosine decay to 0 (a schedule that ends converged, so
    the comparison is not dominated by the noise of a constant lr). Test accuracy is
    measured in fp32 on the eager model with the device loader's test pipeline
    (ToTensor + Normalize, numerically the spec's) for both. Returns two records; a
    single ``skipped`` record when ``accuracy_epochs`` is 0.
    """
    store, dev = _store_device(lab, settings, device)
    images = min(settings.train_images or data.CIFAR10_TRAIN_SIZE, data.CIFAR10_TRAIN_SIZE)
    test_images = min(settings.test_images or data.CIFAR10_TEST_SIZE, data.CIFAR10_TEST_SIZE)
    spec = TrainOptions(num_workers=settings.num_workers)
    runs = [("spec", spec), (fast_step, fast)]
    base = {"width": settings.width, "images": images, "test_images": test_images,
            "batch_size": settings.batch_size, "epochs": settings.accuracy_epochs, "device": dev.type,
            "schedule": "warm-up 1 epoch 0.01->0.1, cosine to 0", "metrics_version": METRICS_VERSION}
    cfgs = [{"run": name, **opts.as_config(), **base} for name, opts in runs]
    if settings.accuracy_epochs == 0 or fast == spec:
        why = ("accuracy_epochs is 0 in this profile" if settings.accuracy_epochs == 0
               else "the fastest configuration here is the spec one: nothing to compare")
        both = {"run": "both", **base}
        skipped = Record("fastpath_accuracy", both, status="skipped", reason=why)
        return [store.run("fastpath_accuracy", both, lambda: skipped, force=True)]
    steps_per_epoch = math.ceil(images / settings.batch_size)
    total = steps_per_epoch * settings.accuracy_epochs
    sched = LRSchedule(peak_lr=0.1, total_steps=total, warmup_steps=min(steps_per_epoch, total),
                       warmup_start_lr=0.01, decay="cosine")

    def train_both(todo):
        train = load_split(True, images, settings.dataset)
        test = load_split(False, test_images, settings.dataset)
        for (_, opts), cfg in zip(runs, cfgs):
            if opts.bf16 and not bf16_supported(dev):
                opts = replace(opts, bf16=False)
            trainer = build_trainer(opts, settings.width, dev, seed=settings.seed)
            loader = (spec_loader(train, settings.batch_size, opts.num_workers, seed=settings.seed)
                      if opts.loader == "spec" else
                      device_loader(train, dev, settings.batch_size, seed=settings.seed,
                                    channels_last=opts.channels_last))
            # timed epochs (phases synchronized): train_seconds as everywhere, loader waits excluded
            eps = [trainer.epoch(loader, schedule=sched, first_step=e * steps_per_epoch, timed=True)
                   for e in range(settings.accuracy_epochs)]
            test_loss, test_acc = evaluate_arrays(trainer.model, test, dev, settings.batch_size)
            metrics = {"train_seconds": sum(e.train_seconds for e in eps), "train_loss": eps[-1].loss,
                       "test_loss": test_loss, "test_accuracy": test_acc, "description": opts.describe()}
            yield Record("fastpath_accuracy", cfg, metrics, synthetic=train.synthetic,
                         dataset=train.dataset_name, hardware=_hardware(dev))

    return store.run_many("fastpath_accuracy", cfgs, train_both, force=force, hardware=_hardware(dev),
                          together=True)


@torch.no_grad()
def evaluate_arrays(model: nn.Module, split: ArraySplit, device: torch.device, batch_size: int = 100
                    ) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (eval mode, fp32) on ``split``."""
    ev = evaluate(model, device_loader(split, device, batch_size, augment=False, shuffle=False), device)
    return ev.loss, ev.accuracy
