"""Q1: the batch-size sweep on one device, up to the batch that no longer fits: one run of
:mod:`lab_utils.experiments.n01_batch_sweep.worker` per batch size (32, 128, 512, ... growing x4), one group,
smallest first; after an out-of-memory the larger sizes are rows "not tried". What a run measures, and how out
of memory is reached on purpose: the worker's docstring. Tables and figure:
:mod:`lab_utils.experiments.n01_batch_sweep.tables`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from lab_utils.engine import config, profiles
from lab_utils.engine.config import (
    CIFAR10_TEST_SIZE,
    CIFAR10_TRAIN_SIZE,
    DATASET_CHOICES,
    check_batch_sizes,
    resolve_dataset,
    resolved_images,
)
from lab_utils.engine.hardware import device_name
from lab_utils.engine.machine import Machine
from lab_utils.engine.memory import check_memory_fraction
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n01_batch_sweep import worker
from lab_utils.experiments.shared import estimates
from lab_utils.experiments.shared.data import check_num_workers
from lab_utils.learn.errors import LabError, check_choice, check_positive_int
from lab_utils.learn.models import flops_per_image
from lab_utils.learn.spread import REPEAT

__all__ = ["EXPERIMENT", "EXPERIMENTS", "MemoryLine", "SPEC_LR", "SWEEP_EXPERIMENT", "Settings",
           "cost", "doctor_settings", "fit_settings", "flops_per_image", "memory_line", "plan",
           "predict_peak_memory"]

EXPERIMENT = "batch_sweep"
SPEC_LR = 0.1


@dataclass(frozen=True)
class Settings:
    """The sweep's knobs for one profile (values: :attr:`QUICK` and :attr:`FULL` below).

    ``batch_sizes`` must grow (the sweep stops at the first one that does not fit).
    ``train_images`` / ``test_images`` of ``None`` mean the whole split. ``width`` is the
    ResNet-18 base width (64 is the spec's model). ``memory_cap_bytes`` (bytes) and
    ``memory_fraction`` (0 < f <= 1, GPU only) limit memory so that the out-of-memory
    path is reached on purpose; ``None`` (or 0) means no limit beyond the device's own.
    ``dataset``: auto | cifar10 | synthetic; None (the default) reads ``$LAB_DATASET`` (else auto),
    so that ``LAB_DATASET=cifar10`` makes a missing CIFAR-10 an error, as docs/instructor.md ("Data") says.
    """

    batch_sizes: tuple[int, ...]
    width: int
    train_images: int | None
    test_images: int | None
    epochs: int = 2
    reported_epoch: int = 2
    memory_cap_bytes: int | None = None
    memory_fraction: float | None = None
    num_workers: int | None = None  # None: the profile's
    cudnn_benchmark: bool = True
    seed: int = 0
    label: str = ""
    #: torch threads while training on the CPU (set, then restored); None: torch's default
    #: (one per core). Quick pins it to the DDP workers' threads per rank (notebook 02's
    #: ``cpu_threads``), so T(1) here and in notebook 02 compare.
    cpu_threads: int | None = None
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto
    #: each batch size measured this many times (the notebook's ``REPEATS``): the table reports the
    #: median and the spread over the repeats (:mod:`lab_utils.learn.spread`)
    repeats: int = 1

    # CPU/CI: a width-8 ResNet-18 (same family, 1/64 of the FLOPs) on 1,024 images; the
    # 450 MB cap lets 32, 128 and 512 fit (308 MB at 512: 2.1 MB + 0.6 MB of saved activations
    # per image at width 8) and makes 1024 run out of memory (615 MB), so the table shows the OOM
    # row and Exercise 01-c's prediction from 32 and 128 meets one measured batch size (512).
    QUICK: ClassVar[dict[str, Any]] = dict(
        batch_sizes=(32, 128, 512, 1024), width=8, train_images=1024, test_images=500,
        memory_cap_bytes=450_000_000, cpu_threads=1, repeats=1,
        label="quick: ResNet-18 width 8 on 1,024 images, 450 MB memory cap on CPU, 1 torch thread "
              "(as each DDP worker of notebook 02)")
    # The assignment: the spec model on all of CIFAR-10, 32 ... 32768 until it does not fit.
    FULL: ClassVar[dict[str, Any]] = dict(
        batch_sizes=(32, 128, 512, 2048, 8192, 32768), width=64, train_images=None, test_images=None,
        repeats=1,
        label="full: spec ResNet-18 (width 64) on all of CIFAR-10")

    def validate(self) -> Settings:
        """Reject settings the sweep cannot run, with one sentence naming the fix (a cap of 0: none)."""
        s = replace(self, memory_cap_bytes=None) if self.memory_cap_bytes == 0 else self
        sizes = check_batch_sizes(s.batch_sizes, "sweep batch sizes")
        if any(b >= a for a, b in zip(sizes[1:], sizes[:-1])):
            raise LabError(f"sweep batch sizes must grow strictly (the sweep stops at the first that does "
                           f"not fit), got {list(sizes)}; sort them, e.g. [32, 128, 512].")
        check_positive_int(s.width, "model width")
        check_positive_int(s.repeats, "repeats (REPEATS)")
        check_positive_int(s.epochs, "epochs")
        check_positive_int(s.reported_epoch, "reported epoch")
        if s.reported_epoch > s.epochs:
            raise LabError(f"reported epoch {s.reported_epoch} is after the last epoch {s.epochs}; "
                           f"train at least {s.reported_epoch} epochs.")
        for what, v in (("train images", s.train_images), ("test images", s.test_images)):
            if v is not None:
                check_positive_int(v, what)
        if s.memory_cap_bytes is not None:
            check_positive_int(s.memory_cap_bytes, "memory cap (bytes)")
        if s.memory_fraction is not None:
            check_memory_fraction(s.memory_fraction)
        if s.num_workers is not None:
            check_num_workers(s.num_workers)
        if s.dataset is not None:
            check_choice(s.dataset, DATASET_CHOICES, "dataset")
        return s


profiles.register(Settings, "sweep")


def fit_settings(settings: Settings) -> Settings:
    """``settings`` with only its two smallest batch sizes: what Exercise 01-c's prediction is fitted to,
    measured before the rest of the sweep (the same configurations, so the full sweep reuses them)."""
    return replace(settings, batch_sizes=tuple(settings.batch_sizes[:2]))


@dataclass(frozen=True)
class MemoryLine:
    """Peak memory of a training step against the batch size, as a line: ``fixed_bytes`` (what does not
    grow with the batch) + ``bytes_per_image`` x batch, both in bytes."""

    fixed_bytes: float
    bytes_per_image: float

    def peak_bytes(self, batch: int) -> float:
        """The line's peak at ``batch`` images (bytes)."""
        return self.fixed_bytes + self.bytes_per_image * batch

    def largest_batch(self, limit_bytes: float) -> int:
        """The largest whole batch whose peak stays within ``limit_bytes`` (0 when the fixed part alone
        does not fit)."""
        return max(0, math.floor((limit_bytes - self.fixed_bytes) / self.bytes_per_image))


def memory_line(batch_a: int, peak_a_bytes: float, batch_b: int, peak_b_bytes: float) -> MemoryLine:
    """The line through two measured peaks (bytes) at two batch sizes: every extra image adds the same
    bytes. One sentence when the two cannot make a line that grows."""
    if batch_a == batch_b:
        raise LabError(f"The memory line needs two different batch sizes, got {batch_a} twice; measure a "
                       "second batch size.")
    per_image = (peak_b_bytes - peak_a_bytes) / (batch_b - batch_a)
    if per_image <= 0:
        raise LabError(f"The peak memory does not grow from batch {batch_a} ({peak_a_bytes:,.0f} B) to "
                       f"{batch_b} ({peak_b_bytes:,.0f} B), so it predicts no limit; check that both peaks "
                       "were measured on the same device and model.")
    return MemoryLine(peak_a_bytes - per_image * batch_a, per_image)


def predict_peak_memory(batch_a: int, peak_a_bytes: float, batch_b: int, peak_b_bytes: float, batch: int,
                        limit_bytes: float) -> tuple[float, int]:
    """Exercise 01-c's reference: from the peaks measured at two batch sizes (bytes), the peak at ``batch``
    (bytes) and the largest batch whose peak stays within ``limit_bytes``, on :func:`memory_line`."""
    line = memory_line(batch_a, peak_a_bytes, batch_b, peak_b_bytes)
    return line.peak_bytes(batch), line.largest_batch(limit_bytes)


def plan(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """One run per batch size, every value of its config resolved (image counts, the data set, the
    loader workers, the device's name): the config is the record's, as stored before the plan existed."""
    s = settings
    if not machine.gpus and s.memory_fraction is not None:
        raise LabError("memory_fraction limits a GPU's memory; on the CPU use memory_cap_bytes instead.")
    n_train = resolved_images(s.train_images, CIFAR10_TRAIN_SIZE)
    threads = None if machine.gpus else s.cpu_threads
    workers = config.get_profile(profile).num_workers if s.num_workers is None else s.num_workers
    base = {"model": "resnet18", "width": s.width, "lr": SPEC_LR, "epochs": s.epochs,
            "reported_epoch": s.reported_epoch, "train_images": n_train,
            "test_images": resolved_images(s.test_images, CIFAR10_TEST_SIZE),
            "dataset": resolve_dataset(s.dataset), "num_workers": workers,
            "device": machine.gpu_name if machine.gpus else device_name("cpu"),
            "memory_cap_bytes": s.memory_cap_bytes, "memory_fraction": s.memory_fraction,
            "cudnn_benchmark": s.cudnn_benchmark,
            # only when pinned (CPU): the keys of records stored before the field stay valid
            **({"cpu_threads": threads} if threads is not None else {})}
    too_large = f"larger than the {n_train} training images: not a batch size of this data"
    # repeat r > 0 of a batch size is a config of its own ("repeat": r); the first has no such key,
    # so the records stored before repeats existed keep their keys
    return [Run(EXPERIMENT, {**base, "batch_size": b, **({REPEAT: r} if r else {})}, worker,
                device=machine.device, group=EXPERIMENT,
                skip=too_large if b > n_train else None, in_process=not machine.gpus, threads=threads,
                label=f"batch {b}" + (f" (repeat {r + 1})" if r else ""),
                options={"process_group": False, "seed": s.seed})
            for b in s.batch_sizes for r in range(1 if b > n_train else s.repeats)]


def cost(run: Run) -> float:
    """Seconds of one batch size on the budget's node, start-up excluded: ``epochs`` spec-path epochs
    on one GPU (:func:`lab_utils.experiments.shared.estimates.spec_epoch_seconds`) over its training
    images."""
    c = run.config
    epoch = estimates.spec_epoch_seconds(1, c["batch_size"]) * c["train_images"] / CIFAR10_TRAIN_SIZE
    return c["epochs"] * epoch


def doctor_settings(full: Settings) -> Settings:
    """The full profile's smallest batch on the spec model: one epoch of two steps, 100 test images."""
    b = min(full.batch_sizes)
    return replace(full, batch_sizes=(b,), train_images=2 * b, test_images=100, epochs=1, reported_epoch=1,
                   dataset="synthetic")


SWEEP_EXPERIMENT = Experiment(EXPERIMENT, "01", Settings, plan, cost, doctor_settings,
                              "the batch-size sweep on one device (Q1)")


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (SWEEP_EXPERIMENT,)
