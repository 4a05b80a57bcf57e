"""Notebook 09: data parallelism built by hand, checked against one process, timed against torch's DDP.
Worker: :mod:`lab_utils.experiments.n09_build_ddp.worker`; the four implementations:
:mod:`lab_utils.learn.handmade`;
tables and figures: :mod:`lab_utils.experiments.n09_build_ddp.tables`.

For each device count N (one launch, one group): the correctness check (K steps, every
implementation against one process on the global batch), an all-reduce timing of a few sizes (this
run's own alpha-beta fit), each implementation's memory (with the recipe's SGD, and ZeRO-1 and DDP
with Adam too), one comparison per per-device batch (every implementation interleaved step by step),
and for N = ``sweep_devices`` the bucket-size sweep of (c) with torch's DDP and its bf16 compression
hook beside it, and the per-rank profiler traces. Without enough GPUs the ranks are gloo
CPU processes of ``cpu_threads`` threads (at most ``max_cpu_processes``), as in notebooks 02-03.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from lab_utils.engine import config, profiles
from lab_utils.engine.config import CIFAR10_TRAIN_SIZE, check_batch_sizes, resolve_dataset
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n02_scaling.experiment import DDP, place
from lab_utils.experiments.n09_build_ddp import worker as handmade_ddp
from lab_utils.experiments.shared import estimates
from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.ring import MIB

__all__ = ["BUILD_DDP", "BUILD_DDP_EXPERIMENT", "EXPERIMENTS", "Settings", "cost",
           "doctor_settings", "plan"]

BUILD_DDP = "build_ddp"
_MAIN = ("local", "naive", "per_tensor", "flat", "bucketed", "zero1", "ddp")   # the comparison's rows
_ADAM = ("zero1", "ddp")   # measured with Adam too: when sharding the optimizer state pays
_TRACED = ("flat", "bucketed", "ddp")                             # (b), (c) and DDP under the profiler


@dataclass(frozen=True)
class Settings:
    """The knobs of notebook 09 for one profile.

    ``devices``: rank counts; ``batch_sizes``: per-device batches of the comparison. Each timed
    comparison runs ``warmup`` untimed then ``steps`` timed rounds. ``check_steps`` (K) and
    ``check_batch``: the correctness check. ``bucket_cap_mb``: (c)'s and DDP's bucket size in the
    comparison (MB of 2^20 bytes, as DDP counts); ``sweep_mb``: the bucket sizes of (c)'s sweep (one
    bucket is added), run on ``sweep_devices`` ranks at the largest batch, with the profiler traces
    (``trace_steps`` steps). ``bench_max_bytes``: the largest all-reduce of this run's own timing.
    ``timeout_s`` bounds one launch.
    """

    devices: tuple[int, ...] = (2, 4)
    batch_sizes: tuple[int, ...] = (32, 128, 512)
    width: int = 64
    warmup: int = 3
    steps: int = 20
    check_steps: int = 5
    check_batch: int = 32
    bucket_cap_mb: float = 25.0
    sweep_mb: tuple[float, ...] = (1.0, 5.0, 25.0, 100.0)
    sweep_devices: int = 2
    trace_steps: int = 3
    bench_max_bytes: int = 64 * MIB
    train_images: int | None = None
    max_cpu_processes: int = 0
    cpu_threads: int = 1
    timeout_s: float = 1800.0
    seed: int = 0
    label: str = ""
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto

    # CPU/CI: ResNet-18 at width 8 (176k parameters, 0.7 MB of gradients, the spec model's 62 tensors) on
    # gloo CPU processes of one thread, 2 and 4 of them (4 take turns on 2 cores: oversubscribed, the
    # table says so). Bucket sizes scaled with the gradient (x 176k / 11.2M): DDP's 25 MB is 0.4 MB, the
    # sweep's 1, 5, 25 MB are 0.016, 0.08, 0.4 MB; 100 MB would already be one bucket.
    # Batches of 4 and 16 per rank keep the notebook near a minute on 2 cores (every round of the
    # comparison steps every implementation once).
    QUICK: ClassVar[dict[str, Any]] = dict(
        batch_sizes=(4, 16), width=8, warmup=1, steps=4, check_steps=3, check_batch=4,
        bucket_cap_mb=0.4, sweep_mb=(0.016, 0.08, 0.4), trace_steps=2, bench_max_bytes=4 * MIB,
        max_cpu_processes=4, timeout_s=300.0,
        label="quick: ResNet-18 width 8; gloo over single-thread CPU processes")
    # The spec model on GPUs with NCCL: 2 and 4 ranks, 32 ... 512 per GPU, DDP's 25 MB buckets.
    FULL: ClassVar[dict[str, Any]] = dict(
        label="full: spec ResNet-18 (width 64) on CIFAR-10 batches, NCCL")

    def validate(self) -> Settings:
        check_batch_sizes(self.devices, "device counts")
        check_batch_sizes(self.batch_sizes, "per-device batch sizes")
        for what in ("width", "steps", "check_steps", "check_batch", "trace_steps", "cpu_threads",
                     "bench_max_bytes", "sweep_devices"):
            check_positive_int(getattr(self, what), what.replace("_", " "))
        if min(self.devices) < 2:
            raise LabError(f"devices must be 2 or more ranks (one rank has nothing to average), got "
                           f"{list(self.devices)}.")
        if self.warmup < 0 or self.max_cpu_processes < 0:
            raise LabError("warmup and max_cpu_processes must be 0 or more.")
        if not all(mb > 0 for mb in (self.bucket_cap_mb, *self.sweep_mb)):
            raise LabError(f"bucket sizes must be positive MB, got {self.bucket_cap_mb} and "
                           f"{list(self.sweep_mb)}.")
        return self


profiles.register(Settings, "build_ddp")


def plan(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """Per device count N, one group (one launch): check, bench, memory (at the smallest batch), a
    comparison per batch, and on ``sweep_devices`` ranks the bucket sweep (with DDP and its bf16 hook) and
    the traces."""
    images = settings.train_images or config.get_profile(profile).train_images
    common = {"width": settings.width, "seed": settings.seed, "dataset": resolve_dataset(settings.dataset),
              "train_images": config.resolved_images(images, CIFAR10_TRAIN_SIZE)}
    options = {"trace_dir": str(config.results_dir(profile) / "traces")}
    cap, big, timed = settings.bucket_cap_mb, max(settings.batch_sizes), (settings.warmup, settings.steps)
    impls = [[name, cap if name in ("bucketed", "ddp") else None] for name in _MAIN]
    runs = []
    for n in settings.devices:
        where = place(DDP, n, machine, settings)
        backend = where.backend or ("nccl" if machine.gpus else "gloo")
        run = _runner(settings, machine, where, {**common, "devices": n, "backend": backend}, options)
        runs.append(run("check", f"check, {settings.check_steps} steps", batch_size=settings.check_batch,
                        steps=settings.check_steps, dtype="float64",
                        implementations=impls[1:] + [["ddp_bf16", cap]]))
        sizes = [4096 * 4 ** k for k in range(12) if 4096 * 4 ** k <= settings.bench_max_bytes]
        runs.append(run("bench", "all-reduce timing", batch_size=settings.check_batch, sizes_bytes=sizes,
                        warmup=2, iters=10))
        memory = [[*i, "sgd"] for i in impls] + [[*i, "adam"] for i in impls if i[0] in _ADAM]
        runs.append(run("memory", f"memory at {n} x {min(settings.batch_sizes)}",
                        batch_size=min(settings.batch_sizes), implementations=memory))
        for b in settings.batch_sizes:
            runs.append(run("compare", f"{n} x {b}", batch_size=b, warmup=timed[0], steps=timed[1],
                            implementations=impls))
        if n == settings.sweep_devices:
            sweep = [["local", None]] + [["bucketed", mb] for mb in settings.sweep_mb] + [["bucketed", None]]
            runs.append(run("compare", f"bucket sweep at {n} x {big}", batch_size=big, warmup=timed[0],
                            steps=timed[1], implementations=sweep + [["ddp", cap], ["ddp_bf16", cap]]))
            runs.append(run("trace", f"traces at {n} x {big}", batch_size=big, steps=settings.trace_steps,
                            implementations=[[name, cap if name != "flat" else None] for name in _TRACED]))
    return runs


def _runner(settings: Settings, machine: Machine, where: Any, base: dict[str, Any],
            options: dict[str, Any]) -> Any:
    """Makes the runs of one device count: one group, one launch, the placement's device and threads."""
    n = base["devices"]

    def run(kind: str, label: str, **cfg: Any) -> Run:
        return Run(BUILD_DDP, {**base, "kind": kind, **cfg}, handmade_ddp, processes=n,
                   device=where.device_type or machine.device, group=f"{BUILD_DDP} {n}",
                   skip=where.reason, threads=settings.cpu_threads if where.device_type == "cpu" else None,
                   timeout_s=settings.timeout_s, options=options, label=f"{n} ranks: {label}")

    return run


def _step_seconds(batch: int, width: int) -> float:
    """One training step on the budget's GPU: FLOP-bound at the assumed fraction of the TF32 peak
    (the fast path's rate per image), at least 5 ms (a small step is launch-bound)."""
    per_image = estimates.fast_epoch_seconds("tf32") / CIFAR10_TRAIN_SIZE * (width / 64) ** 2
    return max(0.005, batch * per_image)


def cost(run: Run) -> float:
    """Seconds of one run on the budget's node, start-up excluded: its steps x :func:`_step_seconds`
    (the check adds one process's K x N reference steps; memory: three steps per implementation; a
    comparison times the backward of ``steps`` more steps; the profiler triples its steps' time)."""
    c = run.config
    step = _step_seconds(c["batch_size"], c["width"])
    if c["kind"] == "bench":
        return 2.0
    if c["kind"] == "check":
        return c["steps"] * (len(c["implementations"]) + c["devices"]) * step
    if c["kind"] == "memory":
        return 3 * len(c["implementations"]) * step
    if c["kind"] == "compare":
        return ((c["warmup"] + c["steps"]) * len(c["implementations"]) + c["steps"]) * step
    return (1 + 3 * c["steps"]) * len(c["implementations"]) * step + 5.0


def doctor_settings(full: Settings) -> Settings:
    """The smallest full-profile configuration (doctor runs it on a GPU node): the fewest ranks, the
    smallest batch, two steps of each kind, one bucket size in the sweep."""
    n, b = min(full.devices), min(full.batch_sizes)
    return replace(full, devices=(n,), batch_sizes=(b,), warmup=1, steps=2, check_steps=2, check_batch=b,
                   sweep_mb=(full.bucket_cap_mb,), sweep_devices=n, trace_steps=1, bench_max_bytes=MIB)


BUILD_DDP_EXPERIMENT = Experiment(BUILD_DDP, "09", Settings, plan, cost, doctor_settings,
                                  "data parallelism by hand: naive, flat, bucketed, ZeRO-1 beside DDP")


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (BUILD_DDP_EXPERIMENT,)
