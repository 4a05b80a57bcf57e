"""The fast path: CIFAR-10 resident on the device, and switchable training options.

Notebooks 01-03 train with the assignment's pipeline: a ``DataLoader`` whose worker
processes decode every image into PIL, pad, crop, flip, convert and normalize it one
image at a time. This module keeps the whole uint8 data set on the device instead
(moved there once) and does the same augmentation for a whole batch in a few tensor
operations, so that the loader stops being the bottleneck. It then adds the usual
training speed-ups one at a time, each switchable and recorded in the results:

- ``loader="device"``: :class:`DeviceLoader` instead of the spec ``DataLoader``;
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
std per channel. :class:`DeviceLoader` draws the same offsets and flips (uniform over
0..8, probability 1/2, independent per image), gathers the crop (and flip) as one
index operation on the zero-padded uint8 images, and applies
``(x / 255 - mean) / std`` in float32. For a given offset and flip the result equals
torchvision's to float rounding (tested), and the distributions are compared
statistically in the tests.

Benchmarks (``python -m lab_utils bench data|train``)
-----------------------------------------------------
- :func:`bench_data`: images/s of the spec pipeline (``DataLoader`` with PIL
  transforms, ``num_workers=2``) and of :class:`DeviceLoader`, no model, measured
  side by side in one run; the ratio is device / spec.
- :func:`bench_train`: the waterfall. One epoch of the same model on the same number
  of images for the spec configuration and for each fast-path step added on top of
  the previous ones; images/s, epoch seconds, achieved TFLOP/s (FLOPs counted with
  :mod:`lab_utils.core.flops`), percent of the device's peak (:mod:`lab_utils.core.hardware`;
  none when the peak is unknown, e.g. on a CPU) and the speed-up over the spec row.

What an epoch time includes: the wall time from the first batch request to the last
optimizer step of one pass over the images, the device synchronized at both ends and
nowhere in between (so the host can queue work ahead, as in real training). Waiting on
the loader is included, which is the point. Warm-up steps (and compilation) are not.
Records go to the experiments ``bench_data`` and ``bench_train``; the profiler trace
and the accuracy check to ``fastpath_trace`` and ``fastpath_accuracy``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.core import config, data, onednn, profiles, watchdog
from lab_utils.core.backends import apply_training_backends, pinned_threads
from lab_utils.core.config import check_batch_size, check_choice, check_positive_int
from lab_utils.core.data import (  # the fast path's loaders live with the other loaders
    ArraySplit,
    check_num_workers,
    device_loader,
    load_split,
    spec_loader,
)
from lab_utils.core.errors import LabError
from lab_utils.core.flops import count_flops
from lab_utils.core.hardware import bf16_supported as native_bf16
from lab_utils.core.hardware import (
    device_name,
    fp32_training_precision,
    fraction_of_peak,
    hardware_summary,
    mig_profile,
)
from lab_utils.core.loop import (
    EpochRecord,
    StepOptions,
    evaluate,
    make_optimizer,
    peak_memory,
    reset_peak_memory,
    run_epoch,
    train_steps,
)
from lab_utils.core.memory import catch_oom, free_device_memory
from lab_utils.core.schedules import LRSchedule
from lab_utils.core.timing import synchronize
from lab_utils.models import ResNet18
from lab_utils.store import Record, ResultStore

SGD_IMPLS = ("default", "for-loop", "foreach", "fused")
METRICS_VERSION = 2
#: In every resume key of this module: bumped when a metric changes meaning, so that records of the
#: old meaning are measured again, not reused. 2 (issue 26): images/s of a waterfall row is
#: ``epoch_images_per_s`` (over epoch_seconds), the loader's ``loader_images_per_s``; the accuracy
#: check's ``train_seconds`` excludes loader waits (its epochs are timed by phase).
LOADERS = ("spec", "device")

# --------------------------------------------------------------------------- training options


@dataclass(frozen=True)
class TrainOptions:
    """One training configuration of the waterfall; every field is recorded."""

    loader: str = "spec"           # "spec": DataLoader + PIL transforms; "device": DeviceLoader
    channels_last: bool = False
    bf16: bool = False             # torch.autocast(dtype=bfloat16) around forward and loss
    compile: bool = False          # torch.compile(model), compiled during warm-up
    sgd: str = "default"           # "default" (torch's choice), "for-loop", "foreach", "fused"
    num_workers: int = 2           # spec loader's worker processes (unused by the device loader)

    def __post_init__(self):
        check_choice(self.loader, LOADERS, "loader")
        check_choice(self.sgd, SGD_IMPLS, "SGD implementation")
        check_num_workers(self.num_workers)

    def as_config(self) -> dict[str, Any]:
        d = asdict(self)
        if self.loader == "device":
            d["num_workers"] = 0
        return d

    def describe(self) -> str:
        parts = [f"DataLoader (PIL, {self.num_workers} workers)" if self.loader == "spec"
                 else "device-resident loader"]
        parts.append("channels_last" if self.channels_last else "NCHW")
        parts.append("bf16 autocast" if self.bf16 else "fp32")
        parts.append(f"SGD {self.sgd}")
        if self.compile:
            parts.append("torch.compile")
        return ", ".join(parts)


# (step name, what it adds, change applied to the previous step's options)
WATERFALL: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("spec", "the assignment: DataLoader with PIL transforms, fp32, eager", {}),
    ("device_loader", "+ data resident on the device, augmentation batched there", {"loader": "device"}),
    ("channels_last", "+ channels_last (NHWC) layout", {"channels_last": True}),
    ("bf16", "+ bf16 autocast", {"bf16": True}),
    ("fused_sgd", "+ fused SGD", {"sgd": "fused"}),
    ("compile", "+ torch.compile", {"compile": True}),
)
STEP_NAMES = tuple(s[0] for s in WATERFALL)


def waterfall_steps(num_workers: int = 2, steps: Sequence[str] | None = None
                    ) -> list[tuple[str, str, TrainOptions]]:
    """The cumulative waterfall: each step's options are the previous step's plus one change."""
    chosen = list(STEP_NAMES if steps is None else steps)
    unknown = [s for s in chosen if s not in STEP_NAMES]
    if unknown:
        raise LabError(f"Unknown waterfall step(s) {unknown}; choose from: {', '.join(STEP_NAMES)}.")
    if "spec" not in chosen:
        chosen.insert(0, "spec")  # every ratio is relative to the spec row
    opts = TrainOptions(num_workers=num_workers)
    out = []
    for name, what, change in WATERFALL:
        if name not in chosen:
            continue
        opts = replace(opts, **change)
        out.append((name, what, opts))
    return out


def bf16_supported(device: torch.device) -> bool:
    """bf16 autocast runs natively on this device (any CPU; CUDA GPUs from Ampere on, not
    emulated: :func:`lab_utils.core.hardware.bf16_supported`)."""
    return native_bf16(device)


def make_sgd(model: nn.Module, impl: str = "default", lr: float = 0.1) -> torch.optim.SGD:
    """The spec's SGD (momentum 0.9, weight decay 5e-4) with the chosen implementation."""
    kw = {"default": {}, "for-loop": {"foreach": False}, "foreach": {"foreach": True},
          "fused": {"fused": True}}
    if impl not in kw:
        raise LabError(f"Unknown SGD implementation {impl!r}; use one of: {', '.join(SGD_IMPLS)}.")
    return make_optimizer(model, lr=lr, **kw[impl])


def resolved_sgd(impl: str, device: torch.device) -> str:
    """What ``impl`` runs as: torch's default is foreach on CUDA and the for-loop on CPU."""
    if impl != "default":
        return impl
    return "foreach" if device.type == "cuda" else "for-loop"


@dataclass
class Trainer:
    """A model, its optimizer and a training step built from :class:`TrainOptions`."""

    model: nn.Module            # the parameters (eager module)
    forward: Any                # the callable used in training (compiled or not)
    optimizer: torch.optim.SGD
    options: TrainOptions
    device: torch.device
    # Set when the model was rewritten to avoid a oneDNN defect on this CPU: the row stores
    # the sentence (see lab_utils.core.onednn).
    onednn_workaround: str | None = None

    def step_options(self, schedule=None, first_step: int = 0, max_steps: int | None = None) -> StepOptions:
        """The lab's one loop with these options: bf16 autocast, channels_last batches, the lr of
        ``schedule`` (a :class:`lab_utils.core.schedules.LRSchedule`) from ``first_step`` on."""
        return StepOptions(autocast_dtype=torch.bfloat16 if self.options.bf16 else None,
                           channels_last=self.options.channels_last, first_step=first_step,
                           max_steps=max_steps, lr_at=schedule.lr_at if schedule is not None else None)

    def epoch(self, loader, max_steps: int | None = None, schedule=None, first_step: int = 0,
              timed: bool = False) -> EpochRecord:
        """One pass over ``loader`` (or its first ``max_steps`` batches) through THE epoch driver,
        :func:`lab_utils.core.loop.run_epoch`. ``timed=False`` (the waterfall): no phase boundaries,
        so the device is synchronized only at the pass's ends and the host queues work ahead, as
        in real training: ``epoch_seconds`` includes the loader waits, which is the point."""
        return run_epoch(self.forward, loader, self.optimizer, self.device, loss_fn=F.cross_entropy,
                         options=self.step_options(schedule, first_step, max_steps), timed=timed)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (summed loss, correct count) as device tensors (no sync)."""
        sums = train_steps(self.forward, [(x, y)], 1, self.optimizer, F.cross_entropy, None, self.device,
                           self.step_options())
        return sums.loss_sum, sums.correct


def build_trainer(options: TrainOptions, width: int, device: torch.device | str, seed: int = 0,
                  lr: float = 0.1) -> Trainer:
    """ResNet-18 of ``width`` on ``device`` (seeded, so every option starts from the same weights).

    Applies the lab's training backend settings (:func:`lab_utils.core.backends.apply_training_backends`:
    autotuned cuDNN convolutions), as every training path does.
    """
    apply_training_backends()
    device = torch.device(device)
    torch.manual_seed(seed)
    model = ResNet18(width=width).to(device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    workaround = onednn.apply_workaround(model, device, options.channels_last or options.compile)
    # dynamic=False: one static graph per batch shape. Without it the warm-up's second shape (the
    # last, partial batch) makes dynamo recompile with a symbolic batch size, and every batch of
    # the timed epoch would then run that dynamic-shape graph instead of the full batch's own.
    forward = torch.compile(model, dynamic=False) if options.compile else model
    return Trainer(model=model, forward=forward, optimizer=make_sgd(model, options.sgd, lr=lr),
                   options=options, device=device, onednn_workaround=workaround)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device,
              channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host batch to the device (non-blocking from pinned memory), in the model's layout."""
    if x.device != device:
        nb = device.type == "cuda"
        x, y = x.to(device, non_blocking=nb), y.to(device, non_blocking=nb)
    if channels_last and not x.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def warm_up(trainer: Trainer, loader, steps: int, remainder: int = 0) -> float:
    """Run ``steps`` training steps (plus one at batch size ``remainder`` if > 0); return seconds.

    This is where ``torch.compile`` compiles (both the full and the last, smaller batch
    shape, each its own static graph: :func:`build_trainer` compiles with ``dynamic=False``),
    where cuDNN picks algorithms and the allocator grows, so none of it lands in a timed epoch.
    """
    synchronize(trainer.device)
    t0 = time.perf_counter()
    if steps > 0:
        trainer.epoch(loader, max_steps=steps)
    if remainder > 0:
        x, y = to_device(*next(iter(loader)), trainer.device, trainer.options.channels_last)
        trainer.step(x[:remainder], y[:remainder])
        trainer.step(x, y)  # the full shape again: its first call after the switch is slow too
    synchronize(trainer.device)
    return time.perf_counter() - t0


def compiled_graphs() -> int | None:
    """How many graphs torch.compile (dynamo) has compiled in this process; None if unknown.

    Read before and after a timed epoch to show that no compilation happened inside it.
    """
    try:
        from torch._dynamo.utils import counters
    except Exception:  # an internal API: absent or moved in some torch version
        return None
    return int(counters["stats"].get("unique_graphs", 0))


@functools.lru_cache(maxsize=8)
def train_flops_per_image(width: int) -> float:
    """FLOPs of one training step per image (forward + backward, FlopCounterMode) for ResNet-18 ``width``."""
    model = ResNet18(width=width)
    return count_flops(model, torch.zeros(2, 3, 32, 32)).train_flops_per_sample


def peak_precision(options: TrainOptions, device_name: str) -> str:
    """The precision whose peak a run is compared with: bf16, else fp32 (tf32 where cuDNN uses it)."""
    return "bf16" if options.bf16 else fp32_training_precision(device_name)


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class FastSettings:
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

    def check(self) -> FastSettings:
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


# Per-profile values: lab_utils.core.profiles (one table for every notebook).
FAST_SETTINGS: dict[str, FastSettings] = profiles.table(FastSettings)


def settings_for(profile: str | config.Profile | None = None, **overrides: Any) -> FastSettings:
    """The profile's :class:`FastSettings`, with ``overrides`` whose value is not None applied."""
    name = profile.name if isinstance(profile, config.Profile) else config.resolve_profile_name(profile)[0]
    return profiles.override(FAST_SETTINGS[name], "fast-path", **overrides).check()


def _device(device: torch.device | str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise LabError("device='cuda' was asked for but torch sees no GPU; use device='cpu'.")
    return dev


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
    return {"images": images, "passes": passes, "seconds": seconds, "loader_images_per_s": images / seconds}


def bench_data(store: ResultStore, settings: FastSettings, device: torch.device | str | None = None,
               force: bool = False) -> list[Record]:
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
    settings.check()
    dev = _device(device)
    common = {"images": settings.data_images or data.CIFAR10_TRAIN_SIZE, "batch_size": settings.batch_size,
              "device": dev.type, "metrics_version": METRICS_VERSION}
    threads = 1 if dev.type == "cpu" else None
    cfgs = [{"pipeline": "spec", "num_workers": settings.num_workers, **common},
            {"pipeline": "device", "num_workers": 0, "cpu_threads": threads, **common}]

    def measure(todo):
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

    return store.run_many("bench_data", cfgs, measure, force=force, hardware=_hardware(dev), together=True)


def data_table(records: Sequence[Record]):
    """The bench data table: pipeline, where it runs, images (all passes), seconds, images/s, ratio."""
    import pandas as pd

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
                     "images": m.get("images"), "seconds": m.get("seconds"),
                     "images_per_s": m.get("loader_images_per_s"), "ratio_to_spec": m.get("ratio_to_spec")})
    return pd.DataFrame(rows)


# --------------------------------------------------------------------------- bench train


def _train_cfg(step: str, position: int, options: TrainOptions, settings: FastSettings, images: int,
               device: torch.device) -> dict[str, Any]:
    return {"step": step, "position": position, **options.as_config(), "width": settings.width,
            "images": images, "batch_size": settings.batch_size, "warmup_steps": settings.warmup_steps,
            "device": device.type, "metrics_version": METRICS_VERSION}


def _skip_reason(step: str, options: TrainOptions, settings: FastSettings, device: torch.device,
                 profile: str) -> str | None:
    if options.bf16 and not bf16_supported(device):
        return "this GPU has no bf16 (needs Ampere or newer)"
    if step == "compile" and not settings.compile:
        return f"skipped in {profile} profile (torch.compile of ResNet-18 takes minutes on a CPU)"
    return None


def measure_config(options: TrainOptions, settings: FastSettings, split: ArraySplit,
                   device: torch.device) -> dict[str, Any]:
    """Warm up, then time one epoch of ``split`` with ``options``; the metrics of one waterfall row."""
    trainer = build_trainer(options, settings.width, device, seed=settings.seed)
    if options.loader == "spec":
        loader = spec_loader(split, settings.batch_size, options.num_workers, seed=settings.seed)
    else:
        loader = device_loader(split, device, settings.batch_size, seed=settings.seed,
                               channels_last=options.channels_last)
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


def bench_train(store: ResultStore, settings: FastSettings, device: torch.device | str | None = None,
                force: bool = False, verbose: bool = False) -> list[Record]:
    """The waterfall: spec configuration, then each fast-path step added on top; one record per row.

    Every row trains the same ResNet-18 (same initial weights) for one timed epoch on
    the same ``train_images`` images after ``warmup_steps`` untimed steps. A row that
    cannot run says why (status ``skipped``/``oom``/``error``). ``ratio_to_spec`` is
    images/s over the spec row's, measured in the same run. Stored rows are reused
    only when all come from one run (``force=True`` always measures).
    """
    settings.check()
    dev = _device(device)
    images = min(settings.train_images or data.CIFAR10_TRAIN_SIZE, data.CIFAR10_TRAIN_SIZE)
    plan = plan_waterfall(settings, dev, store.profile)
    cfgs = [_train_cfg(name, i, opts, settings, images, dev) for i, (name, _, opts, _) in enumerate(plan)]
    hw = _hardware(dev)

    def measure(todo):
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

    return store.run_many("bench_train", cfgs, measure, force=force, hardware=hw, together=True)


def plan_waterfall(settings: FastSettings, device: torch.device, profile: str
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


def status_text(r: Record) -> str:
    """``ok``, or the status with its reason ("skipped in quick profile (...)", "oom: OOM")."""
    if r.status == "ok":
        return "ok"
    reason = r.reason or ""
    return reason if reason.lower().startswith(r.status) else f"{r.status}: {reason}"


def _blank(v: Any) -> Any:
    """None/NaN as an empty cell (tabulate keeps the column numeric and prints nothing)."""
    return "" if v is None or (isinstance(v, float) and math.isnan(v)) else v


def waterfall_table(records: Sequence[Record]):
    """One row per step: what it adds, images/s, epoch seconds, TFLOP/s, % of peak, ratio to spec.

    ``percent_of_peak`` says ``none (peak unknown)`` where the device has no peak in
    :mod:`lab_utils.core.hardware`; rows that did not run have empty cells and their reason.
    """
    import pandas as pd

    rows = []
    for r in sorted(records, key=lambda r: r.config.get("position", 0)):
        m = r.metrics if r.status == "ok" else {}
        pct = m.get("percent_of_peak")
        rows.append({
            "step": r.config["step"], "adds": r.metrics.get("adds", ""),
            "images_per_s": _blank(m.get("epoch_images_per_s")),
            "epoch_seconds": _blank(m.get("epoch_seconds")),
            "warmup_seconds": _blank(m.get("warmup_seconds")),
            "compile_seconds": _blank(m.get("compile_seconds")),
            "achieved_tflops_per_s": _blank(m.get("achieved_tflops_per_s")),
            "percent_of_peak": pct if pct is not None else (_no_peak(r) if m else ""),
            "ratio_to_spec": _blank(m.get("ratio_to_spec")),
            "status": status_text(r),
        })
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
        if r.status == "ok":
            txt = f" {r.metrics['epoch_images_per_s']:,.0f} img/s, x{r.metrics.get('ratio_to_spec') or 1:.2f}"
        else:
            txt = f" {status_text(r)}"
        ax.text(s, y, txt, va="center", fontsize=8)
    ax.set_xlim(0, top * 1.6)
    images = recs[0].config.get("images") if recs else "?"
    ax.set_xlabel(f"seconds per epoch of {images} images (lower is better)")
    ax.set_title("From the spec configuration to the fast path, one step at a time")
    fig.tight_layout()
    return fig


def fastest_options(records: Sequence[Record], num_workers: int = 2) -> tuple[str, TrainOptions]:
    """The step (and its options) with the most images/s among the rows that ran."""
    ok = [r for r in records if r.status == "ok"]
    if not ok:
        raise LabError("No waterfall row ran; run bench_train first (or fix the errors it recorded).")
    best = max(ok, key=lambda r: r.metrics["epoch_images_per_s"])
    c = best.config
    opts = TrainOptions(loader=c["loader"], channels_last=c["channels_last"], bf16=c["bf16"],
                        compile=c["compile"], sgd=c["sgd"],
                        num_workers=c["num_workers"] if c["loader"] == "spec" else num_workers)
    return c["step"], opts


def waterfall_notes(settings: FastSettings, records: Sequence[Record]) -> list[str]:
    """What the waterfall's numbers mean, for the saved table."""
    images = records[0].config.get("images") if records else settings.train_images
    return [
        f"Each row: one epoch of {images} images, ResNet-18 width {settings.width}, "
        f"batch {settings.batch_size}, same initial weights; each step keeps the changes of the rows "
        "above it.",
        "epoch_seconds: wall time of the pass, device synchronized at both ends only; waiting on the loader "
        f"is included. warmup_seconds: the {settings.warmup_steps} untimed step(s) before it "
        "(compile_seconds: the same, torch.compile's compilation included); never part of an epoch.",
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
    acc = [r for r in accuracy_records if r.status == "ok"]
    if len(acc) == 2:
        d = 100 * (acc[1].metrics["test_accuracy"] - acc[0].metrics["test_accuracy"])
        full = acc[0].config.get("images") == data.CIFAR10_TRAIN_SIZE and acc[0].config.get("width") == 64
        lines.append(f"test accuracy, fast path minus spec after {acc[0].config['epochs']} epochs: {d:+.1f} "
                     "points (target on one H100, full profile: within 1 point"
                     + ("" if full else "; not comparable: too few images and a narrow model") + ")")
    return lines


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


def trace_fast_path(store: ResultStore, settings: FastSettings, options: TrainOptions, step: str = "",
                    device: torch.device | str | None = None, force: bool = False) -> TraceResult:
    """Profile ``settings.trace_steps`` training steps with ``options`` and save a Chrome/Perfetto trace.

    ``self_ms`` is GPU kernel time on a GPU (with the host's ``self_cpu_ms`` next to
    it) and CPU time on a CPU. The steps run after ``warmup_steps`` untimed ones (compilation included), under
    ``torch.profiler`` (CPU, plus CUDA when on a GPU). The trace is written to
    ``results/<profile>/traces/fastpath_<step>.json`` (open it at https://ui.perfetto.dev).
    The loader's work shows up as ``data_loader`` ranges and each step as ``train_step``.
    """
    import pandas as pd
    from torch.profiler import ProfilerActivity, profile, record_function

    settings.check()
    dev = _device(device)
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
    def measure() -> Record:
        split = load_split(True, images, settings.dataset)
        trainer = build_trainer(options, settings.width, dev, seed=settings.seed)
        if options.loader == "spec":
            loader = spec_loader(split, settings.batch_size, options.num_workers, seed=settings.seed)
        else:
            loader = device_loader(split, dev, settings.batch_size, seed=settings.seed,
                                   channels_last=options.channels_last)
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
    rec = store.run("fastpath_trace", cfg, measure, force=force or not path.exists(), hardware=_hardware(dev))
    return TraceResult(rec, path, pd.DataFrame(rec.metrics["top_ops"]))


# --------------------------------------------------------------------------- accuracy check


def accuracy_check(store: ResultStore, settings: FastSettings, fast: TrainOptions, fast_step: str = "fast",
                   device: torch.device | str | None = None, force: bool = False) -> list[Record]:
    """Train the spec configuration and ``fast`` for ``accuracy_epochs`` with the same short schedule.

    Same initial weights, same images, batch ``batch_size``, lr warm-up over the first
    epoch from 0.01 to 0.1 then cosine decay to 0 (a schedule that ends converged, so
    the comparison is not dominated by the noise of a constant lr). Test accuracy is
    measured in fp32 on the eager model with the device loader's test pipeline
    (ToTensor + Normalize, numerically the spec's) for both. Returns two records; a
    single ``skipped`` record when ``accuracy_epochs`` is 0.
    """
    settings.check()
    dev = _device(device)
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

    def measure(todo):
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

    return store.run_many("fastpath_accuracy", cfgs, measure, force=force, hardware=_hardware(dev),
                          together=True)


@torch.no_grad()
def evaluate_arrays(model: nn.Module, split: ArraySplit, device: torch.device, batch_size: int = 100
                    ) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` (eval mode, fp32) on ``split``."""
    ev = evaluate(model, device_loader(split, device, batch_size, augment=False, shuffle=False), device)
    return ev.loss, ev.accuracy


def accuracy_table(records: Sequence[Record]):
    import pandas as pd

    rows = []
    for r in records:
        m = r.metrics
        rows.append({"run": r.config.get("run"), "description": m.get("description"),
                     "epochs": r.config.get("epochs"), "train_seconds": m.get("train_seconds"),
                     "test_loss": m.get("test_loss"),
                     "test_accuracy_percent": None if m.get("test_accuracy") is None
                     else 100 * m["test_accuracy"],
                     "status": status_text(r)})
    df = pd.DataFrame(rows)
    ok = [r for r in records if r.status == "ok"]
    if len(ok) == 2:
        diff = 100 * (ok[1].metrics["test_accuracy"] - ok[0].metrics["test_accuracy"])
        df["difference_points"] = ["", diff]
    return df


# --------------------------------------------------------------------------- command line


def _common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", default=None, help="quick | full | auto (default: $LAB_PROFILE or auto)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--num-workers", type=int, default=None, help="spec DataLoader workers (default 2)")
    p.add_argument("--dataset", default=None, help="auto | cifar10 | synthetic")


def _print_table(df) -> None:
    print(df.to_markdown(index=False, floatfmt=".4g"))


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
    store = ResultStore(a.profile)
    s = settings_for(store.profile, data_images=a.images, batch_size=a.batch_size, num_workers=a.num_workers,
                     data_min_seconds=a.min_seconds, dataset=a.dataset)
    dev = _device(a.device)
    recs = bench_data(store, s, dev, force=True)
    print(f"profile {store.profile}, device {dev}, {recs[0].dataset}, batch {s.batch_size}, "
          f"cpu cores {recs[0].hardware.get('cpu_cores')}")
    _print_table(data_table(recs))
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
    g = p.add_mutually_exclusive_group()
    g.add_argument("--compile", dest="compile", action="store_true", default=None,
                   help="run the torch.compile step even in the quick profile")
    g.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--row-timeout", type=float, default=None,
                   help="seconds one row may take before it is recorded as an error and the process "
                        "stops (quick 900, full 1800)")
    a = p.parse_args(argv)
    store = ResultStore(a.profile)
    steps = tuple(s.strip() for s in a.steps.split(",") if s.strip()) if a.steps else None
    s = settings_for(store.profile, train_images=a.images, width=a.width, batch_size=a.batch_size,
                     num_workers=a.num_workers, warmup_steps=a.warmup_steps, steps=steps, compile=a.compile,
                     dataset=a.dataset, row_timeout_s=a.row_timeout)
    dev = _device(a.device)
    print(f"profile {store.profile}, device {dev}, ResNet-18 width {s.width}, batch {s.batch_size}, "
          f"{s.train_images or data.CIFAR10_TRAIN_SIZE} images per epoch, {s.warmup_steps} warm-up steps")
    recs = bench_train(store, s, dev, force=True)
    print(f"data: {recs[0].dataset}")
    _print_table(waterfall_table(recs).drop(columns=["adds"]))
    print(f"recorded in {store.path('bench_train')}")
    return 0

