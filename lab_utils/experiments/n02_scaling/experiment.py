"""Questions Q2 and Q3.1: the plans of notebook 02 (scaling over 1/2/4 devices, Table 1) and notebook 03
(compute vs communication, Table 2; its Experiment is in
:mod:`~lab_utils.experiments.n03_compute_vs_comm.experiment`); their tables are in
:mod:`~lab_utils.experiments.n02_scaling.tables` (Q2's strong vs weak scaling:
:mod:`~lab_utils.experiments.n02_scaling.strong_weak`) and
:mod:`~lab_utils.experiments.n03_compute_vs_comm.tables`.

For each device count N and per-device batch b (global batch N x b), ResNet-18 trains ``epochs``
epochs; the last (2 of 2) is reported: its *training* time (host-to-device copies, forward, backward,
all-reduce, optimizer step; loader waits excluded, this rank's and, through the barrier after the data
movement, the other ranks': ``skew_wait``, its own column), of the SLOWEST rank.

- **DDP**: :mod:`lab_utils.experiments.n02_scaling.ddp_worker`, one process per GPU with NCCL, all batch sizes
  of one N in one launch. T(1) is the same worker with one process, so T(1) and T(N) go through the same code.
  Without enough GPUs: **gloo over CPU processes** (one thread each: a "device" is one core), labelled so
  (``backend`` gloo, ``device_type`` cpu).
- **DataParallel**: ``nn.DataParallel`` over N GPUs and the global batch, in a process of its own
  (:mod:`lab_utils.experiments.n02_scaling.dp_worker`: the notebook's kernel opens no CUDA context). GPUs
  only.
- A configuration that needs more GPUs than exist is a row ``needs N GPUs``, one that does not fit
  ``OOM``; never a number, and not stored, so a later run on a bigger node measures it.

Notebook 03 measures communication three ways on N = 2 and 4 (:mod:`lab_utils.learn.comm_probe`):
(a) the assignment's T(N) - T(1)/N, (b) the exposed part from the ``no_sync`` probe, (c) the
all-reduce time from the timing hook. The records' schema is in
:mod:`lab_utils.experiments.n02_scaling.ddp_worker`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar

from lab_utils.engine import config, profiles
from lab_utils.engine.config import (
    CIFAR10_TEST_SIZE,
    CIFAR10_TRAIN_SIZE,
    check_batch_sizes,
    resolve_dataset,
    resolved_images,
)
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n02_scaling import ddp_worker as ddp
from lab_utils.experiments.n02_scaling import dp_worker as dataparallel
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.n02_scaling.dp_worker import dp_config
from lab_utils.experiments.shared import estimates
from lab_utils.learn.errors import LabError, check_positive_int

__all__ = ["COMPUTE_VS_COMM", "DDP", "DP", "EXPERIMENTS", "Placement", "SCALING", "SCALING_EXPERIMENT",
           "Settings", "cost", "doctor_settings", "methods_here", "place", "plan",
           "plan_compute_vs_comm", "run_config"]

SCALING = "scaling"
COMPUTE_VS_COMM = "compute_vs_comm"
DDP = "DDP"
DP = dataparallel.METHOD
DP_BACKEND = dataparallel.BACKEND


@dataclass(frozen=True)
class Settings:
    """The knobs of notebooks 02 and 03 for one profile.

    ``devices``: device counts of Table 1; ``comm_devices``: those of Table 2.
    ``batch_sizes``: per-device batch sizes of the tables; ``run_batch_sizes`` (None:
    all) those actually run in this profile, the others are rows "skipped in quick
    profile". ``max_cpu_processes``: without enough GPUs, DDP runs with gloo over at most
    this many CPU processes of ``cpu_threads`` threads each (0: never). ``pin_threads``: the
    DataParallel process also runs with ``cpu_threads`` torch threads, so that its timings compare
    with the DDP workers' (quick). ``bucket_cap_mb``:
    DDP's bucket size (None: DDP's 25 MB); the quick profile scales it with the smaller
    model so that it, too, has several buckets. ``timeout_s`` bounds one launch (seconds).
    ``repeats``: each configuration is measured that many times (notebooks' ``REPEATS``); the tables
    report the median and the spread over the repeats (:mod:`lab_utils.learn.spread`).
    """

    devices: tuple[int, ...] = (1, 2, 4)
    comm_devices: tuple[int, ...] = (2, 4)
    batch_sizes: tuple[int, ...] = (32, 128, 512, 2048)
    run_batch_sizes: tuple[int, ...] | None = None
    epochs: int = 2
    width: int = 64
    train_images: int | None = None
    num_workers: int | None = None
    max_cpu_processes: int = 2
    cpu_threads: int = 1
    pin_threads: bool = False
    bucket_cap_mb: float | None = None
    comm_steps: int = 10
    timeout_s: float = 3600
    seed: int = 0
    label: str = ""
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto
    repeats: int = 1

    # CPU/CI: ResNet-18 at width 8 (1/64 of the FLOPs, 176k parameters) on 512 images,
    # gloo over 1, 2 and 4 single-thread processes; on 2 cores the 4 processes take turns
    # (oversubscribed, and Table 1 says so), which still runs every 4-device path. A global batch
    # larger than the subset (2 x 512, 4 x 512) is a row saying so. 512 images, not more: notebooks
    # 02 and 03 train 11 configurations (7 + 4) for two epochs each, and with 1,024 images they
    # were the quick lab's largest time after notebook 05 (65 + 80 s in a loaded test run).
    # Buckets of 0.4 MB (25 MB x 176k / 11.2M) give the small model several buckets, as the full
    # model has.
    QUICK: ClassVar[dict[str, Any]] = dict(
        run_batch_sizes=(32, 128, 512), width=8, train_images=512, max_cpu_processes=4,
        bucket_cap_mb=0.4, comm_steps=4, timeout_s=600, pin_threads=True, repeats=1,
        label="quick: ResNet-18 width 8 on 512 images; gloo over single-thread CPU processes")
    # The assignment: the spec model on all of CIFAR-10, 1/2/4 GPUs, 32 ... 2048 per GPU.
    FULL: ClassVar[dict[str, Any]] = dict(
        width=64, train_images=None, max_cpu_processes=0, comm_steps=10, timeout_s=3600, repeats=1,
        label="full: spec ResNet-18 (width 64) on all of CIFAR-10")

    def validate(self) -> Settings:
        check_batch_sizes(self.batch_sizes, "per-device batch sizes")
        check_positive_int(self.repeats, "repeats (REPEATS)")
        check_batch_sizes(self.devices, "device counts")
        check_batch_sizes(self.comm_devices, "device counts of Table 2")
        if self.run_batch_sizes is not None:
            check_batch_sizes(self.run_batch_sizes, "batch sizes to run")
        check_positive_int(self.epochs, "epochs")
        check_positive_int(self.width, "width")
        check_positive_int(self.cpu_threads, "cpu_threads")
        check_positive_int(self.comm_steps, "comm_steps")
        if self.max_cpu_processes < 0:
            raise LabError(f"max_cpu_processes must be 0 or more, got {self.max_cpu_processes}.")
        if self.timeout_s <= 0:
            raise LabError(f"timeout_s must be positive, got {self.timeout_s}.")
        return self

    def one_device(self) -> Settings:
        """Notebook 02's first step: these settings with only the one-device runs (a prediction's inputs)."""
        return replace(self, devices=(1,))

    def more_devices(self) -> Settings:
        """Notebook 02's second step: these settings with only the runs on more than one device."""
        return replace(self, devices=tuple(n for n in self.devices if n > 1))


profiles.register(Settings, "scaling")


# --------------------------------------------------------------------------- where each config runs


@dataclass(frozen=True)
class Placement:
    """How a (method, N devices) configuration runs on a machine, or why it cannot."""

    method: str
    devices: int
    backend: str | None       # "nccl", "gloo", DP_BACKEND; None when it cannot run
    device_type: str | None   # "cuda" | "cpu"
    reason: str | None = None  # why not, e.g. "needs 4 GPUs"

    @property
    def runs(self) -> bool:
        return self.reason is None


def place(method: str, devices: int, machine: Machine, settings: Settings) -> Placement:
    """Where ``method`` on ``devices`` devices runs on ``machine``: one GPU per rank with NCCL
    (DataParallel: one process over the GPUs), else gloo CPU processes (DDP, at most
    ``max_cpu_processes``, each a "device" of ``cpu_threads`` threads; more threads than cores
    still runs, and Table 1 says the times measure time-sharing), else a row "needs N GPUs"."""
    needs = f"needs {devices} GPU{'s' if devices > 1 else ''}"
    if method == DP:
        return Placement(DP, devices, DP_BACKEND, "cuda") if machine.gpus >= devices else \
            Placement(DP, devices, None, None, needs)
    if machine.gpus >= devices:
        return Placement(DDP, devices, "nccl", "cuda")
    if machine.gpus == 0 and devices <= settings.max_cpu_processes:
        return Placement(DDP, devices, "gloo", "cpu")
    return Placement(DDP, devices, None, None, needs)


def methods_here(machine: Machine) -> tuple[str, ...]:
    """DataParallel and DDP side by side with GPUs; DDP (gloo, CPU processes) alone without."""
    return (DP, DDP) if machine.gpus else (DDP,)


# --------------------------------------------------------------------------- the plans


def run_config(settings: Settings, profile: str, devices: int, backend: str, batch: int,
               measure_comm: bool = False) -> RunConfig:
    """The DDP worker's configuration of one (devices, per-device batch): image counts, workers and
    the data set resolved here (``$LAB_DATASET`` is read now: a missing data set is an error before
    anything runs)."""
    prof = config.get_profile(profile)
    return RunConfig(
        devices=devices, backend=backend, batch_size=batch, epochs=settings.epochs, width=settings.width,
        train_images=resolved_images(settings.train_images, CIFAR10_TRAIN_SIZE),
        test_images=resolved_images(prof.test_images, CIFAR10_TEST_SIZE),
        dataset=resolve_dataset(settings.dataset),
        num_workers=settings.num_workers if settings.num_workers is not None else prof.num_workers,
        measure_comm=measure_comm, comm_steps=settings.comm_steps if measure_comm else None,
        bucket_cap_mb=settings.bucket_cap_mb, seed=settings.seed).validate()


def _runs(settings: Settings, machine: Machine, profile: str, experiment: str, devices: Sequence[int],
          methods: Sequence[str], measure_comm: bool) -> list[Run]:
    """(method, devices, per-device batch) for ``devices`` x ``settings.batch_sizes``, in table order.

    The batch sizes of one (method, devices) are one group: one launch, smallest first, and after
    an out-of-memory the larger ones are not tried (:func:`lab_utils.engine.plan.measure`'s rule)."""
    run_b = settings.run_batch_sizes or settings.batch_sizes
    out = []
    for method in methods:
        for n in devices:
            p = place(method, n, machine, settings)
            backend = p.backend if p.runs and method == DDP else ("nccl" if machine.gpus else "gloo")
            for b in settings.batch_sizes:
                first = run_config(settings, profile, n, "nccl" if method == DP else backend, b, measure_comm)
                skip = p.reason or ("skipped in quick profile" if b not in run_b else None) or (
                    f"global batch {b * n} > {first.train_images} training images"
                    if b * n > first.train_images else None)
                for r in range(1 if skip else settings.repeats):  # repeat r > 0: a config of its own
                    args = replace(first, repeat=r)
                    cfg = dp_config(args) if method == DP else args.config()
                    out.append(Run(experiment, cfg, dataparallel if method == DP else ddp,
                                   processes=1 if method == DP else n, device=p.device_type or machine.device,
                                   group=f"{experiment} {method} {n}", skip=skip,
                                   threads=settings.cpu_threads if p.device_type == "cpu" or (
                                       method == DP and settings.pin_threads) else None,
                                   timeout_s=settings.timeout_s,
                                   label=f"{method} {n} x {b}" + (f" (repeat {r + 1})" if r else ""),
                                   options={"process_group": False} if method == DP else {}))
    return out


def plan(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """Notebook 02 (Table 1): every (method, devices, per-device batch). T(1) is the same worker with
    one process as T(N): both go through the same code, the launcher included."""
    return _runs(settings, machine, profile, SCALING, settings.devices, methods_here(machine), False)


def plan_compute_vs_comm(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """Notebook 03 (Table 2): T(1) (notebook 02's one-device runs, reused from its store), with GPUs
    DataParallel on ``comm_devices`` (method (a) only), and DDP on ``comm_devices`` with the
    communication measured (experiment ``compute_vs_comm``)."""
    ones = _runs(settings, machine, profile, SCALING, (1,), (DDP,), False)
    n = settings.comm_devices
    dps = _runs(settings, machine, profile, SCALING, n, (DP,), False) if machine.gpus else []
    return ones + dps + _runs(settings, machine, profile, COMPUTE_VS_COMM, n, (DDP,), True)


def cost(run: Run) -> float:
    """Seconds of one run on the budget's node, start-up excluded: ``epochs`` spec-path epochs
    (:func:`lab_utils.experiments.shared.estimates.spec_epoch_seconds`); the probe of notebook 03 adds
    0.1 epoch."""
    c = run.config
    epochs = c["epochs"] + (0.1 if c.get("measure_comm") else 0.0)
    per_epoch = (estimates.dp_epoch_seconds(c["devices"], c["batch_size"]) if c["method"] == DP
                 else estimates.spec_epoch_seconds(c["devices"], c["batch_size"]))
    return epochs * per_epoch * c["train_images"] / CIFAR10_TRAIN_SIZE


def doctor_settings(full: Settings) -> Settings:
    """The smallest full-profile configuration: the spec model, the smallest batch, one epoch of a
    few batches per device, on every device count (doctor runs it on the node)."""
    b = min(full.batch_sizes)
    return replace(full, batch_sizes=(b,), run_batch_sizes=None, epochs=1,
                   train_images=4 * b * max(full.devices),
                   comm_steps=2)


SCALING_EXPERIMENT = Experiment("scaling", "02", Settings, plan, cost, doctor_settings,
                                "DataParallel and DDP on 1, 2 and 4 devices (Table 1)")


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (SCALING_EXPERIMENT,)
