"""Questions Q2 and Q3.1: scaling over 1/2/4 devices, and compute vs communication.

Notebook 02 (:func:`run_scaling`, :func:`scaling_table`, :func:`speedup_figure`)
---------------------------------------------------------------------------
For each device count N and per-device batch b (global batch N x b), ResNet-18 trains
``epochs`` epochs; epoch ``epochs`` (2 of 2) is reported, as in notebook 01: its
*training* time (host-to-device copies, forward, backward, all-reduce, optimizer step;
waiting on the loader excluded, this rank's and, through the barrier after the data
movement, the other ranks': ``skew_wait``, its own column), of the SLOWEST rank.

- **DDP** (``method="DDP"``): :mod:`lab_utils.workers.ddp` under ``torchrun`` through
  :func:`lab_utils.launcher.launch`, one process per GPU with NCCL. All per-device batch
  sizes of one N run in one launch (one start-up). T(1) is the same worker with one
  process, so T(1) and T(N) go through the same code. Without enough GPUs the lab runs
  DDP with **gloo over CPU processes** (one CPU thread each: a "device" is one core),
  labelled so in the table (``backend`` gloo, ``device_type`` cpu).
- **DataParallel** (``method="DataParallel"``): in this process with
  ``nn.DataParallel`` over N GPUs and the global batch N x b (it splits each batch).
  Only with GPUs.
- A configuration that needs more GPUs than exist is a row ``needs N GPUs`` (status
  ``skipped``), one that does not fit is ``OOM``; never a number. Those rows are not
  stored, so a later run on a bigger node measures them.

Notebook 03 (:func:`run_compute_vs_comm`, :func:`compute_vs_comm_table`)
-----------------------------------------------------------------------
DDP on N = 2 and 4 with ``--measure-comm``: communication measured three ways (see
:mod:`lab_utils.core.comm_hooks`): (a) the assignment's derivation compute = T(1)/N,
communication = T(N) - T(1)/N (T(1) from notebook 02's one-device run, run here when
missing); (b) exposed communication from the ``no_sync`` probe; (c) total all-reduce
time from the timing hook; overlap = (c) - (b).

Record schema (stable; notebook 04's Table 3 reads it)
------------------------------------------------------
Experiments: ``scaling`` (notebook 02) and ``compute_vs_comm`` (notebook 03). Each
holds the DDP worker's records (one aggregate + one per rank per configuration; the
full schema is in :mod:`lab_utils.workers.ddp`'s docstring) and, with GPUs, DataParallel
records. Select the aggregates with ``config["record"] == "aggregate"``. Keys used here:

- ``config``: ``method`` ("DDP" | "DataParallel"), ``devices``, ``batch_size`` (per
  device), ``global_batch``, ``backend`` ("nccl" | "gloo" | "single process"),
  ``device_type`` ("cuda" | "cpu"), ``width``, ``train_images``, ``epochs``,
  ``measure_comm`` (True in ``compute_vs_comm``), ``record``, ``rank``.
- ``metrics``: ``train_seconds`` (reported epoch, slowest rank, seconds; neither loader
  waits nor ``skew_wait``, the wait for the other ranks' loaders), ``skew_wait_seconds_max``
  (absent in records written before the skew barrier: the tables show it blank),
  ``epoch_seconds``, ``steps`` (per rank in the reported epoch), ``steps_per_epoch``,
  ``parameters``, ``gradient_bytes`` (fp32 gradient size S in bytes),
  ``epochs`` (per-epoch history), and in ``compute_vs_comm``: ``exposed_comm_seconds``
  (b, per epoch), ``allreduce_seconds`` (c, per epoch), ``overlap_seconds``,
  ``overlap_fraction``, ``comm_probe`` (per-step values).

:func:`comm_measurements` turns those records into one row per (devices, per-device
batch) with the three communication figures in seconds per epoch, the steps per epoch
and the gradient bytes: the stable interface for Table 3.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lab_utils import launcher
from lab_utils.core import config, profiles
from lab_utils.core.backends import apply_training_backends, pinned_threads
from lab_utils.core.comm_hooks import NOISE_SIGMAS, derived_comm, noise_flag, overlap_figures
from lab_utils.core.config import CIFAR10_TRAIN_SIZE, check_batch_sizes, check_positive_int
from lab_utils.core.data import make_loaders
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import cpu_cores, hardware_summary
from lab_utils.core.loop import make_optimizer, run_epoch, wrap_data_parallel
from lab_utils.core.memory import catch_oom, free_device_memory, mentions_out_of_memory
from lab_utils.core.ring import ring_bytes_per_rank
from lab_utils.models import ResNet18, count_parameters
from lab_utils.store import Record, ResultStore, canonical_key
from lab_utils.workers.args import WorkerArgs

SCALING = "scaling"
COMPUTE_VS_COMM = "compute_vs_comm"
DDP = "DDP"
DP = "DataParallel"
DP_BACKEND = "single process"


@dataclass(frozen=True)
class ScalingSettings:
    """The knobs of notebooks 02 and 03 for one profile.

    ``devices``: device counts of Table 1; ``comm_devices``: those of Table 2.
    ``batch_sizes``: per-device batch sizes of the tables; ``run_batch_sizes`` (None:
    all) those actually run in this profile, the others are rows "skipped in quick
    profile". ``max_cpu_processes``: without enough GPUs, DDP runs with gloo over at most
    this many CPU processes of ``cpu_threads`` threads each (0: never). ``pin_threads``: the
    in-process DataParallel path also runs with ``cpu_threads`` torch threads (set, then
    restored), so that its timings compare with the DDP workers' (quick). ``bucket_cap_mb``:
    DDP's bucket size (None: DDP's 25 MB); the quick profile scales it with the smaller
    model so that it, too, has several buckets. ``timeout_s`` bounds one launch (seconds).
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

    def validate(self) -> ScalingSettings:
        check_batch_sizes(self.batch_sizes, "per-device batch sizes")
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


# Per-profile values: lab_utils.core.profiles (one table for every notebook).
SETTINGS: dict[str, ScalingSettings] = profiles.table(ScalingSettings)


def settings_for(profile: str | config.Profile, **overrides: Any) -> ScalingSettings:
    """The profile's settings with notebook parameters that are not None applied."""
    name = profile.name if isinstance(profile, config.Profile) else config.resolve_profile_name(profile)[0]
    return profiles.override(SETTINGS[name], "scaling", **overrides)


# --------------------------------------------------------------------------- where each config runs


@dataclass(frozen=True)
class Placement:
    """How a (method, N devices) configuration runs here, or why it cannot."""

    method: str
    devices: int
    backend: str | None       # "nccl", "gloo", DP_BACKEND; None when it cannot run
    device_type: str | None   # "cuda" | "cpu"
    reason: str | None = None  # why not, e.g. "needs 4 GPUs"
    oversubscribed: str | None = None  # e.g. "4 processes x 1 thread on 2 cores": rows say so

    @property
    def runs(self) -> bool:
        return self.reason is None


def place(method: str, devices: int, gpus: int, settings: ScalingSettings, cores: int) -> Placement:
    """Where ``method`` on ``devices`` devices runs, given ``gpus`` GPUs and ``cores`` CPU cores."""
    if method == DP:
        if gpus >= devices:
            return Placement(DP, devices, DP_BACKEND, "cuda")
        return Placement(DP, devices, None, None, f"needs {devices} GPU{'s' if devices > 1 else ''}")
    if gpus >= devices:
        return Placement(DDP, devices, "nccl", "cuda")
    if gpus == 0 and devices <= settings.max_cpu_processes:
        # More threads than cores (4 single-thread ranks on 2 cores in quick) still runs, so that
        # every 4-device path is exercised, but its times measure time-sharing: the rows say so.
        k = settings.cpu_threads
        over = (f"{devices} processes x {k} thread{'s' if k > 1 else ''} on {cores} cores"
                if devices * k > cores else None)
        return Placement(DDP, devices, "gloo", "cpu", oversubscribed=over)
    return Placement(DDP, devices, None, None, f"needs {devices} GPU{'s' if devices > 1 else ''}")


def methods_here(gpus: int) -> tuple[str, ...]:
    """DataParallel and DDP side by side with GPUs; DDP (gloo, CPU) alone without."""
    return (DP, DDP) if gpus else (DDP,)


# --------------------------------------------------------------------------- configurations


def worker_args(settings: ScalingSettings, profile: str, experiment: str, backend: str,
                batch_sizes: Sequence[int], measure_comm: bool = False,
                dataset: str | None = None) -> WorkerArgs:
    """The DDP worker's arguments for some batch sizes (resolved: image counts, dataset)."""
    b = tuple(batch_sizes)
    return WorkerArgs(
        experiment=experiment, profile=profile, batch_size=b[0] if len(b) == 1 else b,
        epochs=settings.epochs, width=settings.width,
        train_images=settings.train_images if settings.train_images is not None else 0,
        test_images=None, dataset=dataset or "auto", num_workers=settings.num_workers,
        measure_comm=measure_comm, comm_steps=settings.comm_steps, backend=backend,
        bucket_cap_mb=settings.bucket_cap_mb, seed=settings.seed,
    ).validate().resolved()


def dp_config(args: WorkerArgs, devices: int) -> dict[str, Any]:
    """A DataParallel record's config: the DDP keys, with the method and backend changed."""
    cfg = args.record_config(devices, "nccl")
    cfg.update({"method": DP, "backend": DP_BACKEND, "device_type": "cuda", "comm_steps": None,
                "bucket_cap_mb": None, "measure_comm": False})
    return cfg


def unavailable_config(args: WorkerArgs, p: Placement) -> dict[str, Any]:
    """Config of a row that could not run, with the backend it would have used here: DDP with
    ``args.backend`` (gloo on a machine without GPUs, so the row is labelled "DDP (gloo, CPU
    processes)", never "NCCL, GPUs"; NCCL when GPUs exist), DataParallel on GPUs."""
    if p.method == DDP:
        return args.record_config(p.devices, args.backend if args.backend in ("nccl", "gloo") else "nccl")
    return dp_config(args, p.devices)


# --------------------------------------------------------------------------- running


@dataclass
class ScalingResult:
    """Aggregate records of one notebook's configurations, in table order."""

    records: list[Record]
    settings: ScalingSettings
    profile: str
    experiment: str
    measured: list[tuple[str, int, int]]  # (method, devices, batch) measured by this call

    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "ok"]


def run_scaling(lab, settings: ScalingSettings | None = None, force: bool = False,
                devices: Sequence[int] | None = None, methods: Sequence[str] | None = None,
                experiment: str = SCALING, measure_comm: bool = False,
                dataset: str | None = None) -> ScalingResult:
    """Notebook 02: every (method, devices, per-device batch); resumes from the store.

    ``lab`` is the notebook's :class:`~lab_utils.session.LabSession` (profile, store,
    GPU count). Returns one aggregate record per configuration (measured, stored,
    OOM, or a not-stored row saying why it did not run).
    """
    s = (settings or settings_for(lab.profile)).validate()
    store: ResultStore = lab.store
    profile = lab.profile.name
    gpus = int(lab.gpu_count)
    cores = cpu_cores()
    devs = tuple(devices) if devices is not None else s.devices
    meths = tuple(methods) if methods is not None else methods_here(gpus)
    run_b = [b for b in s.batch_sizes if s.run_batch_sizes is None or b in s.run_batch_sizes]
    out: dict[tuple[str, int, int], Record] = {}
    measured: list[tuple[str, int, int]] = []
    # DDP's launches first: DataParallel trains in this process and opens a CUDA context on
    # each GPU it uses, which would leave the DDP ranks less memory (the table order is kept).
    for method in sorted(meths, key=lambda m: m != DDP):
        for n in devs:
            p = place(method, n, gpus, s, cores)
            backend = p.backend if p.runs and method == DDP else ("gloo" if not gpus else "nccl")
            args = worker_args(s, profile, experiment, backend, s.batch_sizes, measure_comm, dataset)
            if not p.runs:
                for b in s.batch_sizes:
                    out[(method, n, b)] = _row(args.for_batch(b), p, experiment, "skipped", p.reason)
                continue
            cfgs: dict[int, dict[str, Any]] = {}
            for b in s.batch_sizes:
                one = args.for_batch(b)
                cfg = one.record_config(n, p.backend) if method == DDP else dp_config(one, n)
                if b not in run_b or b * n > one.train_images:
                    why = ("skipped in quick profile" if b not in run_b
                           else f"global batch {b * n} > {one.train_images} training images")
                    out[(method, n, b)] = Record(experiment, cfg, status="skipped", reason=why,
                                                 profile=profile)
                    continue
                cfgs[b] = cfg
            if not cfgs:
                continue
            run = _run_ddp if method == DDP else _run_dp_sizes
            got, now = run(store, s, args, n, p, cfgs, force)
            for b, rec in got.items():
                out[(method, n, b)] = rec
            measured += [(method, n, b) for b in now]
    order = [(m, n, b) for m in meths for n in devs for b in s.batch_sizes]
    return ScalingResult([out[k] for k in order if k in out], s, profile, experiment, measured)


def _row(args: WorkerArgs, p: Placement, experiment: str, status: str, reason: str | None) -> Record:
    cfg = unavailable_config(args, p)
    return Record(experiment, cfg, status=status, reason=reason, profile=args.profile,
                  hardware={"device_type": p.device_type or cfg.get("device_type") or "cuda",
                            "device_name": None, "device_count": p.devices})


def _run_ddp(store: ResultStore, s: ScalingSettings, args: WorkerArgs, n: int, p: Placement,
             cfgs: dict[int, dict[str, Any]], force: bool) -> tuple[dict[int, Record], list[int]]:
    """The records of the per-device batch sizes ``cfgs`` on ``n`` DDP ranks: stored ones reused,
    the others measured by ONE launch of the DDP worker (every size, one start-up) and stored
    through :meth:`~lab_utils.store.ResultStore.run_many` as rank 0 hands each size's records back.

    Out of memory ends the launch: the first size without records gets a stored ``oom`` row,
    larger ones a row (not stored) saying why they were not tried. Any other failure is
    raised (with the failing rank's log); the sizes that finished before it stay stored.
    Returns ``({batch: record}, batch sizes measured now)``.
    """
    experiment = args.experiment or SCALING
    threads = s.cpu_threads if p.device_type == "cpu" else None
    by_key = {canonical_key(c): b for b, c in cfgs.items()}
    measured: list[int] = []
    oom_at: list[int] = []

    def measure(todo: list[dict[str, Any]]):
        sizes = sorted(by_key[canonical_key(c)] for c in todo)
        run_args = replace(args, batch_size=tuple(sizes) if len(sizes) > 1 else sizes[0])
        try:
            for rec in launcher.stream("lab_utils.workers.ddp", run_args.to_argv(), nproc=n,
                                       timeout_s=s.timeout_s, threads_per_rank=threads):
                if rec.key in by_key:
                    measured.append(by_key[rec.key])
                yield rec
        except LaunchError as e:
            left = [b for b in sizes if b not in measured]
            if not left or not mentions_out_of_memory(str(e)):
                raise
            oom_at.append(left[0])
            yield Record(experiment, cfgs[left[0]], status="oom", reason="OOM", profile=store.profile,
                         synthetic=args.dataset == "synthetic", dataset=args.dataset, hardware=_hardware(p))

    recs = store.run_many(experiment, list(cfgs.values()), measure, force=force, hardware=_hardware(p))
    got: dict[int, Record] = {}
    for (b, cfg), rec in zip(cfgs.items(), recs):
        if rec is None:
            if not oom_at:
                raise LaunchError(f"The DDP worker finished but returned no record for per-device batch {b}; "
                                  "check its log.")
            # a larger per-device batch needs more memory still: not tried
            rec = Record(experiment, cfg, status="skipped", reason=f"OOM at per-device batch {oom_at[0]}",
                         profile=store.profile)
        got[b] = rec
    return got, measured + oom_at


def _hardware(p: Placement) -> dict:
    """What a record says about the devices of ``p`` (no device name where CUDA is absent)."""
    if p.device_type == "cuda" and not torch.cuda.is_available():
        return {"device_type": "cuda", "device_name": None, "device_count": p.devices}
    return hardware_summary("cuda" if p.device_type == "cuda" else "cpu", p.devices)


def _run_dp_sizes(store: ResultStore, s: ScalingSettings, args: WorkerArgs, n: int, p: Placement,
                  cfgs: dict[int, dict[str, Any]], force: bool) -> tuple[dict[int, Record], list[int]]:
    """:func:`_run_dp` for the per-GPU batch sizes of ``cfgs``, smallest first, on ``n`` GPUs, each
    through :meth:`~lab_utils.store.ResultStore.run` (a stored one is reused).

    After the first out-of-memory (measured now, or stored for a smaller batch), larger batch
    sizes are not tried: they would need more memory still. Their rows (status ``skipped``,
    not stored) say so. Returns ``({batch: record}, batch sizes measured now)``.
    """
    experiment = args.experiment or SCALING
    got: dict[int, Record] = {}
    measured: list[int] = []
    oom_at: int | None = None
    for b in sorted(cfgs):
        if oom_at is not None:
            got[b] = Record(experiment, cfgs[b], status="skipped",
                            reason=f"not tried: per-GPU batch {oom_at} already ran out of memory",
                            profile=store.profile)
            continue

        def measure(b=b) -> Record:
            measured.append(b)
            return _run_dp(store.profile, s, args.for_batch(b), n)

        got[b] = rec = store.run(experiment, cfgs[b], measure, force=force, hardware=_hardware(p))
        if rec.status == "oom":
            oom_at = b
    return got, measured


def _run_dp(profile: str, s: ScalingSettings, args: WorkerArgs, n: int) -> Record:
    """DataParallel over GPUs 0..n-1 in this process, global batch n x per-GPU batch: the record.

    Out of memory (:func:`lab_utils.core.memory.catch_oom`) gives an ``oom`` record with the
    allocator's message; the model, optimizer and loaders are dropped and the cache is
    emptied after the ``with`` statement, once the traceback that holds them is gone.
    """
    cfg = dp_config(args, n)
    experiment = args.experiment or SCALING
    synthetic = args.dataset == "synthetic"
    common = {"profile": profile, "synthetic": synthetic,
              "dataset": "synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10",
              "hardware": {**hardware_summary("cuda", n), "processes": 1, "backend": DP_BACKEND}}
    apply_training_backends()
    held: dict[str, Any] = {}  # what holds device memory, dropped before the cache is emptied
    threads = s.cpu_threads if s.pin_threads else None
    with pinned_threads(threads) as used, catch_oom() as oom:
        history, params = _train_dp(args, n, held)
    held.clear()
    free_device_memory("cuda")
    if oom:
        return Record(experiment, cfg, status="oom", reason=oom.reason, **common)
    last = history[-1]
    metrics = {k: v for k, v in last.items() if k != "epoch"}
    metrics.update({"reported_epoch": last["epoch"], "epochs": history, "world_size": n,
                    "backend": DP_BACKEND, "device_type": "cuda", "parameters": params,
                    "threads_per_rank": used, "threads_pinned": threads is not None,
                    "gradient_bytes": 4 * params, "steps_per_epoch": last["steps"],
                    "global_batch": args.batch_size * n,
                    "time_rule": "one process: epoch and training times of the whole DataParallel step"})
    return Record(experiment, cfg, metrics, **common)


def _train_dp(args: WorkerArgs, n: int, held: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Train ``args.epochs`` epochs with DataParallel on ``n`` GPUs; (per-epoch history, parameters).

    Everything that holds device memory is also put in ``held`` (and is otherwise local to
    this frame), so that the caller can drop it all after an out-of-memory failure.
    """
    held["loaders"] = loaders = make_loaders(
        batch_size=args.batch_size * n, num_workers=args.num_workers, train_images=args.train_images,
        test_images=args.test_images, dataset=args.dataset, seed=args.seed)
    torch.manual_seed(args.seed)
    held["model"] = model = ResNet18(width=args.width).cuda()
    params = count_parameters(model)
    held["dp"] = dp = wrap_data_parallel(model, device_ids=list(range(n)))
    held["optimizer"] = opt = make_optimizer(dp, lr=args.lr)
    history = [run_epoch(dp, loaders.train, opt, "cuda:0", epoch=epoch).as_dict()
               for epoch in range(1, args.epochs + 1)]
    return history, params


def run_compute_vs_comm(lab, settings: ScalingSettings | None = None, force: bool = False,
                        dataset: str | None = None) -> tuple[ScalingResult, ScalingResult]:
    """Notebook 03: T(1) (from notebook 02's store, or run now) and DDP on ``comm_devices`` with comm
    measurement; DataParallel on the same device counts when GPUs exist (method (a) only).

    Returns ``(one_device, n_devices)`` results.
    """
    s = (settings or settings_for(lab.profile)).validate()
    gpus = int(lab.gpu_count)
    one = run_scaling(lab, s, force=False, devices=(1,), dataset=dataset)
    ddp = run_scaling(lab, s, force=force, devices=s.comm_devices, methods=(DDP,),
                      experiment=COMPUTE_VS_COMM, measure_comm=True, dataset=dataset)
    if gpus:
        dp = run_scaling(lab, s, force=False, devices=s.comm_devices, methods=(DP,), dataset=dataset)
        ddp = replace(ddp, records=dp.records + ddp.records, measured=dp.measured + ddp.measured)
    return one, ddp


# --------------------------------------------------------------------------- tables


def _t(rec: Record | None) -> float | None:
    if rec is None or rec.status != "ok":
        return None
    v = rec.metrics.get("train_seconds")
    return float(v) if v is not None else None


def _metric(rec: Record | None, key: str) -> float | None:
    """A number from an ok record's metrics; None (a blank cell) when missing."""
    if rec is None or rec.status != "ok":
        return None
    v = rec.metrics.get(key)
    return float(v) if v is not None else None


def _skew(rec: Record | None) -> float | None:
    """The slowest rank's skew wait in the reported epoch (seconds): the time it waited in the
    barrier after the data movement for the other ranks' loaders. None (blank) for DataParallel
    and for DDP records written before the barrier existed (their T(N) includes the wait)."""
    return _metric(rec, "skew_wait_seconds_max")


def oversubscribed(rec: Record | None) -> str | None:
    """"4 processes x 1 thread on 2 cores" for a measured gloo run whose ranks had more torch
    threads than the machine had cores (they time-share the cores, so its times do not show
    scaling); None otherwise, or where the record does not say (cores or threads unknown)."""
    if rec is None or rec.status != "ok" or rec.config.get("device_type") != "cpu":
        return None
    n, threads, cores = int(rec.config.get("devices", 1)), rec.threads, rec.hardware.get("cpu_cores")
    if not threads or not cores or n * threads <= cores:
        return None
    return f"{n} processes x {threads} thread{'s' if threads > 1 else ''} on {cores} cores"


def _label(method: str, backend: str | None, device_type: str | None) -> str:
    if method == DP:
        return "DataParallel (1 process, GPUs)"
    if backend == "gloo" or device_type == "cpu":
        return "DDP (gloo, CPU processes)"
    return "DDP (NCCL, GPUs)"


def _none_for_nan(df):
    """Object columns with None for missing numbers: the tables show an empty cell, never 'nan'."""
    for c in df.columns:
        if df[c].dtype.kind == "f":
            df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df


def karp_flatt(speedup: float, devices: int) -> float | None:
    """The experimentally determined serial fraction e = (1/S - 1/N) / (1 - 1/N); None for N = 1.

    Amdahl's law S = 1 / (e + (1 - e)/N) solved for e. A fraction that grows with N points
    at overhead that grows with N (communication), not at a fixed serial part.
    """
    if devices <= 1 or not speedup or speedup <= 0:
        return None
    return (1 / speedup - 1 / devices) / (1 - 1 / devices)


def amdahl_speedup(serial_fraction: float, devices: int) -> float:
    """Amdahl (fixed problem): S(N) = 1 / (e + (1 - e)/N)."""
    return 1 / (serial_fraction + (1 - serial_fraction) / devices)


def gustafson_speedup(serial_fraction: float, devices: int) -> float:
    """Gustafson (problem grows with N, serial share e measured on N devices): S(N) = N - e (N - 1)."""
    return devices - serial_fraction * (devices - 1)


# Earlier cohorts' reports (SPEC.md), hardware unknown (V100 / RTX 8000 class): epoch-2 seconds
# by (GPUs, per-GPU batch), as published. Both cohorts ran nn.DataParallel, as the assignment
# asks (not DDP): the first scaled well, the other got slower at batch 32. The first cohort's
# 1-GPU row is 41.3 / 33.64 / 33.95 s in its report (SPEC.md rounds it to 33.6 / 34.0); the lab
# uses the published values everywhere (notebooks 01-04, the time budget): this is their one copy.
ANCHOR_COHORT_SECONDS = {(1, 32): 41.3, (1, 128): 33.64, (1, 512): 33.95,
                         (2, 32): 23.15, (2, 128): 17.87, (2, 512): 17.50,
                         (4, 32): 11.65, (4, 128): 9.23, (4, 512): 9.01}
ANCHOR_DDP_SECONDS = ANCHOR_COHORT_SECONDS  # old name, kept for code that imported it (it was never DDP)
ANCHOR_DP_SECONDS = {(1, 32): 38.0, (2, 32): 67.0, (4, 32): 121.0}
ANCHOR_COHORT_LABEL = "DataParallel (earlier cohort)"


def anchor_frame():
    """The earlier cohorts' numbers with their speedups T(1)/T(N) (sanity anchors, not targets).
    Both cohorts used DataParallel (the assignment's method), so both rows say so."""
    import pandas as pd

    rows = []
    for label, table in ((ANCHOR_COHORT_LABEL, ANCHOR_COHORT_SECONDS),
                         ("DataParallel (another cohort)", ANCHOR_DP_SECONDS)):
        for (n, b), t in table.items():
            t1 = table.get((1, b))
            rows.append({"method": label, "gpus": n, "per_gpu_batch": b, "epoch2_seconds": t,
                         "speedup": t1 / t if t1 else None, "efficiency": t1 / t / n if t1 else None})
    return pd.DataFrame(rows)


# ----- Q2: the speedup definitions side by side (the course forum's and the lab's)

SPEEDUP_DEFINITIONS: tuple[str, ...] = (
    "lab: T(1)/T(N) on epoch times. One epoch is a fixed amount of work (the whole training set, split "
    "over the N devices), so this is STRONG scaling of the epoch (Amdahl): ideal N, efficiency = "
    "speedup / N.",
    "forum: N x T(1)/T(N), the definition a course forum suggested and an earlier report quotes, is "
    "Gustafson's SCALED speedup (WEAK scaling): how much more work per second N devices do, valid when "
    "T(N) is the time of N times the work of T(1), each device keeping its own share. Per step at a "
    "fixed per-device batch that holds: N x t(1)/t(N), t = seconds per step (Table 1's scaled_speedup).",
    "The forum's formula on this lab's EPOCH times counts N twice: an epoch's work does not grow with N "
    "(it already has N times fewer steps), so N x T(1)/T(N) on epoch times is N x the speedup, a "
    "'super-linear' figure that never happened (Table 1's n_t1_over_tn_epoch).",
    "Why the lab reports T(1)/T(N): the assignment times an epoch of the fixed data set, that is the "
    "time a user waits for the same training, and with the per-device batch fixed it EQUALS the forum's "
    "scaled speedup on step times (up to the last partial batch). Each definition, applied to its own "
    "T, gives the same number: an answer in either form is correct when it says which T it divides.",
)

SPEEDUP_DEFINITION_COLUMNS = ["method", "devices", "per_device_batch",
                              "lab: T(1)/T(N), epoch (strong)", "forum: N x t(1)/t(N), step (scaled, weak)",
                              "forum's formula on epoch times: N x T(1)/T(N)"]


def speedup_definitions_frame(table=None, dataset_size: int | None = None):
    """Q2's two speedup definitions side by side, per (method, N > 1, per-device batch): the lab's
    T(1)/T(N) on epoch times, the forum's N x t(1)/t(N) on step times (the scaled speedup), and the
    forum's formula applied to epoch times. From Table 1 (:func:`scaling_frame`) when given, then the
    earlier cohort's published DataParallel epochs, whose steps per epoch are ceil(N_images / (N x b))
    (one loader feeding N x b images per step)."""
    import pandas as pd

    rows = []
    if table is not None and len(table):
        ok = table[table["speedup"].notna() & (table["devices"] > 1)]
        for _, r in ok.iterrows():
            rows.append(dict(zip(SPEEDUP_DEFINITION_COLUMNS,
                                 (r["method"], r["devices"], r["per_device_batch"], r["speedup"],
                                  r["scaled_speedup"], r["n_t1_over_tn_epoch"]), strict=True)))
    images = dataset_size or CIFAR10_TRAIN_SIZE
    for (n, b), tn in ANCHOR_COHORT_SECONDS.items():
        if n == 1:
            continue
        t1 = ANCHOR_COHORT_SECONDS[(1, b)]
        step1, step_n = t1 / math.ceil(images / b), tn / math.ceil(images / (n * b))
        values = (ANCHOR_COHORT_LABEL, n, b, t1 / tn, n * step1 / step_n, n * t1 / tn)
        rows.append(dict(zip(SPEEDUP_DEFINITION_COLUMNS, values, strict=True)))
    return pd.DataFrame(rows, columns=SPEEDUP_DEFINITION_COLUMNS)


def save_speedup_definitions(store: ResultStore, result: ScalingResult):
    """Save ``tables/scaling_definitions`` (md + csv): :func:`speedup_definitions_frame` of this run's
    Table 1 and the earlier cohort, with :data:`SPEEDUP_DEFINITIONS` as its notes; return it."""
    df = speedup_definitions_frame(scaling_frame(result.records))
    store.save_table(_none_for_nan(df.copy()), "scaling_definitions",
                     [r for r in result.records if r.status == "ok"],
                     title="Q2: the speedup definitions side by side (the course forum's and the lab's)",
                     notes=list(SPEEDUP_DEFINITIONS))
    return df


def karp_flatt_note(speedup: float | None, devices: int) -> str:
    """What a Karp-Flatt fraction outside [0, 1] means, in words ("" inside it).

    e < 0 exactly when the speedup exceeds N (super-linear); e > 1 exactly when the speedup
    is below 1: N devices took LONGER than one. Neither is a serial fraction.
    """
    if speedup is None or devices <= 1 or _isnan(speedup):
        return ""
    if speedup > devices:
        return "speedup > N (super-linear): question the measurement before projecting"
    if speedup < 1:
        return (f"speedup {speedup:.3g} < 1: {devices} devices were SLOWER than one (e > 1 is no serial "
                "fraction); nothing to project")
    return ""


def serial_fraction_frame(table, project_to: int = 8):
    """From Table 1: each N > 1 row's Karp-Flatt serial fraction e and what Amdahl and
    Gustafson predict with that e at ``project_to`` devices. A speedup above N (e < 0) or
    below 1 (e > 1: slower than one device) is flagged instead of projected: no serial
    fraction explains it."""
    import pandas as pd

    rows = []
    ok = table[table["speedup"].notna() & (table["devices"] > 1)]
    for _, r in ok.iterrows():
        e = r["serial_fraction"]
        row = {"method": r["method"], "devices": r["devices"], "per_device_batch": r["per_device_batch"],
               "speedup": r["speedup"], "serial_fraction": e,
               f"amdahl_speedup_at_{project_to}": None, f"gustafson_speedup_at_{project_to}": None,
               "note": ""}
        if e is not None and 0 <= e <= 1:
            row[f"amdahl_speedup_at_{project_to}"] = amdahl_speedup(e, project_to)
            row[f"gustafson_speedup_at_{project_to}"] = gustafson_speedup(e, project_to)
        else:
            row["note"] = karp_flatt_note(float(r["speedup"]), int(r["devices"]))
        rows.append(row)
    return pd.DataFrame(rows)


# ----- Q2's second half: the other type of scaling (fixed global batch) from rows already measured

FIXED_GLOBAL_COLUMNS = ["method", "devices", "global_batch", "status", "T1_seconds",
                        "strong_per_device_batch", "strong_TN_seconds", "strong_speedup", "strong_efficiency",
                        "weak_per_device_batch", "weak_TN_seconds", "weak_speedup", "weak_efficiency",
                        "better"]


def fixed_global_batch_rows(seconds: dict[tuple[int, int], float | None],
                            reasons: dict[tuple[int, int], str] | None = None,
                            method: str = "") -> list[dict]:
    """Strong vs weak scaling from the same starting point, using only measured (devices, per-device
    batch) -> epoch seconds.

    Start from one device at batch G (time T(1, G)). Strong scaling keeps the GLOBAL batch G and
    splits it: N devices x G/N, speedup T(1, G) / T(N, G/N). Weak scaling (what Table 1 ran)
    keeps G PER DEVICE: N x G, speedup T(1, G) / T(N, G) (Table 1's speedup of that row). Both
    are epoch times over the same data set, so the speedups compare directly. One row per
    (N > 1, G) whose strong split G/N is a per-device batch of the grid (``seconds`` and
    ``reasons`` keys); a row with a missing time says which run is missing and why.
    """
    reasons = dict(reasons or {})
    grid = set(seconds) | set(reasons)
    ones = sorted(b for n, b in grid if n == 1)
    rows = []
    for n in sorted({n for n, _ in grid if n > 1}):
        for g in ones:
            if g % n or (n, g // n) not in grid:
                continue
            row = dict.fromkeys(FIXED_GLOBAL_COLUMNS)
            row.update({"method": method, "devices": n, "global_batch": g, "strong_per_device_batch": g // n,
                        "weak_per_device_batch": g})
            t1, ts, tw = seconds.get((1, g)), seconds.get((n, g // n)), seconds.get((n, g))
            row.update({"T1_seconds": t1, "strong_TN_seconds": ts, "weak_TN_seconds": tw})
            missing = [f"{k} x {b}: {reasons.get((k, b)) or 'not measured'}"
                       for k, b, t in ((1, g, t1), (n, g // n, ts)) if not t]
            if t1 and ts:
                row["strong_speedup"] = t1 / ts
                row["strong_efficiency"] = t1 / ts / n
            if t1 and tw:
                row["weak_speedup"] = t1 / tw
                row["weak_efficiency"] = t1 / tw / n
            if row["strong_speedup"] is not None and row["weak_speedup"] is not None:
                row["status"] = "ok"
                row["better"] = ("strong" if row["strong_speedup"] > row["weak_speedup"]
                                 else "weak" if row["strong_speedup"] < row["weak_speedup"] else "equal")
            elif missing:
                row["status"] = "no strong-scaling comparison: " + "; ".join(missing)
            else:
                row["status"] = (f"strong only: {n} x {g}: {reasons.get((n, g)) or 'not measured'}")
            rows.append(row)
    return rows


def fixed_global_batch_frame(records: Sequence[Record] | None = None,
                             seconds: dict[tuple[int, int], float | None] | None = None, method: str = ""):
    """:func:`fixed_global_batch_rows` as a DataFrame, from Table 1's records (one block per method)
    or from a ``seconds`` table such as :data:`ANCHOR_COHORT_SECONDS`."""
    import pandas as pd

    rows: list[dict] = []
    if seconds is not None:
        rows += fixed_global_batch_rows(seconds, method=method)
    if records is not None:
        t1 = scaling_frame(records)
        for m, g in t1.groupby("method", sort=False):
            times, why = {}, {}
            for _, r in g.iterrows():
                key = (int(r["devices"]), int(r["per_device_batch"]))
                if r["status"] == "ok" and not _isnan(r["epoch2_train_seconds"]):
                    times[key] = float(r["epoch2_train_seconds"])
                else:
                    why[key] = str(r["status"])
            rows += fixed_global_batch_rows(times, why, method=m)
    return pd.DataFrame(rows, columns=FIXED_GLOBAL_COLUMNS)


def fixed_global_batch_verdict(df) -> str:
    """The one-line answer to "would the other type of scaling be better or worse?", computed from
    the comparable rows of :func:`fixed_global_batch_frame` (never assumed)."""
    ok = df[df["status"] == "ok"] if len(df) else df
    if not len(ok):
        return ("No verdict: no fixed-global-batch pair was measured here (each row says which run is "
                "missing).")
    worse = int((ok["better"] == "weak").sum())
    better = int((ok["better"] == "strong").sum())
    pairs = "; ".join(f"N={r['devices']}, global {r['global_batch']}: strong {r['strong_speedup']:.3g}x "
                      f"vs weak {r['weak_speedup']:.3g}x" for _, r in ok.iterrows())
    if worse == len(ok):
        head = "Strong scaling (fixed global batch) would be WORSE than the weak scaling measured"
    elif better == len(ok):
        head = "Strong scaling (fixed global batch) would be BETTER than the weak scaling measured"
    else:
        head = (f"Mixed: strong scaling is worse in {worse} and better in {better} of {len(ok)} pairs "
                "(differences this small are within run-to-run noise)")
    return f"{head} ({pairs})."


FIXED_GLOBAL_EXPLANATION = (
    "Why strong scaling usually loses: splitting a fixed global batch G over N devices gives each "
    "device G/N images per step, but every step still all-reduces the WHOLE gradient (S bytes, "
    "2(N-1)/N x S per rank) and pays the same fixed per-step costs (kernel launches, optimizer over all "
    "parameters). Compute per step shrinks N-fold, communication and overhead do not, so they take a "
    "larger share, and a small per-device batch also uses each GPU less efficiently. Weak scaling keeps "
    "the per-device work, so the compute that hides the all-reduce stays the same.")


def fixed_global_batch_table(store: ResultStore, result: ScalingResult, include_anchors: bool = True):
    """Save the strong-vs-weak comparison (``tables/scaling_fixed_global_batch.md`` + ``.csv``): this
    run's rows, then the earlier cohort's anchors through the same arithmetic; returns
    (DataFrame, verdict for this run, verdict for the anchors)."""
    import pandas as pd

    here = fixed_global_batch_frame(result.records)
    anchors = fixed_global_batch_frame(seconds=ANCHOR_COHORT_SECONDS, method=ANCHOR_COHORT_LABEL)
    df = pd.concat([here, anchors], ignore_index=True) if include_anchors else here
    verdict, anchor_verdict = fixed_global_batch_verdict(here), fixed_global_batch_verdict(anchors)
    notes = ["T1_seconds = T(1, G): one device at batch G. strong: N x G/N (global batch fixed), speedup "
             "T(1, G)/T(N, G/N); weak: N x G (per-device batch fixed, as Table 1), speedup T(1, G)/T(N, G). "
             "Epoch-2 training seconds, slowest rank; efficiency = speedup / N.",
             "Only pairs whose split G/N is one of the per-device batch sizes appear (with batch sizes "
             "growing x4, that is N = 4; N = 2 would need a 2 x 64 run).",
             f"This run: {verdict}", f"{ANCHOR_COHORT_LABEL}: {anchor_verdict}", FIXED_GLOBAL_EXPLANATION]
    store.save_table(_none_for_nan(df.copy()), "scaling_fixed_global_batch",
                     [r for r in result.records if r.status == "ok"],
                     title="Q2: strong (fixed global batch) vs weak (fixed per-device batch) scaling",
                     notes=notes)
    return df, verdict, anchor_verdict


def comm_volume_frame(records: Sequence[Record]):
    """Why small per-device batches scale badly: per stored N-device DDP run, the ring all-reduce
    bytes each rank sends per step and per epoch (2(N-1)/N x S, S = fp32 gradient bytes), next to
    the images each device computes per step. Bytes are decimal (MB = 1e6)."""
    import pandas as pd


    rows = []
    for r in records:
        c, m = r.config, r.metrics
        if r.status != "ok" or c.get("record", "aggregate") != "aggregate" or c["devices"] < 2:
            continue
        per_step = ring_bytes_per_rank(m["gradient_bytes"], c["devices"])
        rows.append({"method": _label(c["method"], c.get("backend"), c.get("device_type")),
                     "devices": c["devices"], "per_device_batch": c["batch_size"],
                     "steps_per_epoch": m["steps"], "images_per_device_per_step": c["batch_size"],
                     "allreduce_mb_per_step_per_rank": per_step / 1e6,
                     "allreduce_mb_per_epoch_per_rank": per_step * m["steps"] / 1e6,
                     "bytes_per_image": per_step / c["batch_size"]})
    return pd.DataFrame(rows)


def scaling_frame(records: Sequence[Record]):
    """Table 1 as a DataFrame: time, both speedups and efficiency per (method, devices, batch).

    ``epoch2_train_seconds`` T(N) is the reported epoch's training time (slowest rank);
    ``step_seconds`` t(N) = T(N) / steps. speedup = T(1)/T(N) (strong scaling of one
    epoch over the fixed data set); scaled_speedup = N x t(1)/t(N) (weak scaling: the work
    per device per step is fixed; Gustafson); efficiency = speedup / N. T(1) is the
    same method's one-device run with the same per-device batch.
    """
    import pandas as pd

    aggs = [r for r in records if r.config.get("record", "aggregate") == "aggregate"]
    base = {}
    for r in aggs:
        if r.config["devices"] == 1 and r.status == "ok":
            base[(r.config["method"], r.config["batch_size"])] = r
    rows = []
    for r in aggs:
        c, m = r.config, r.metrics
        n = int(c["devices"])
        tn = _t(r)
        steps = m.get("steps") if r.status == "ok" else None
        b1 = base.get((c["method"], c["batch_size"]))
        t1 = _t(b1)
        row = {"method": _label(c["method"], c.get("backend"), c.get("device_type")), "devices": n,
               "per_device_batch": c["batch_size"], "global_batch": c["batch_size"] * n,
               "status": "ok" if r.status == "ok" else (r.reason or r.status),
               "epoch2_train_seconds": tn, "step_seconds": tn / steps if tn and steps else None,
               "speedup": None, "scaled_speedup": None, "n_t1_over_tn_epoch": None, "efficiency": None,
               "serial_fraction": None, "skew_wait_seconds": _skew(r),
               "train_plus_skew_wait_seconds": _metric(r, "train_plus_skew_wait_seconds"),
               "oversubscribed": oversubscribed(r)}
        if tn and t1:
            row["speedup"] = t1 / tn
            row["n_t1_over_tn_epoch"] = n * t1 / tn  # earlier reports' formula, kept to be questioned
            row["efficiency"] = row["speedup"] / n
            row["serial_fraction"] = karp_flatt(row["speedup"], n)
            s1 = b1.metrics.get("steps")
            if steps and s1:
                row["scaled_speedup"] = n * (t1 / s1) / (tn / steps)
        rows.append(row)
    df = pd.DataFrame(rows, columns=["method", "devices", "per_device_batch", "global_batch", "status",
                                     "epoch2_train_seconds", "step_seconds", "speedup", "scaled_speedup",
                                     "n_t1_over_tn_epoch", "efficiency", "serial_fraction",
                                     "skew_wait_seconds", "train_plus_skew_wait_seconds", "oversubscribed"])
    return df


TABLE1_NOTES = [
    "oversubscribed: the gloo ranks had more threads than the machine has cores (quick: 4 single-thread "
    "processes on 2 cores), so they took turns on the cores: the row exercises the 4-device path, its "
    "times do not measure scaling.",
    "epoch2_train_seconds T(N): training time of epoch 2 of 2 (host-to-device copies, forward, backward, "
    "all-reduce, optimizer step; loader waits excluded), the SLOWEST rank's; seconds.",
    "speedup = T(1)/T(N) on epoch time (strong scaling: the epoch's data set is fixed); "
    "efficiency = speedup / N.",
    "scaled_speedup = N x t(1)/t(N), t = time per step (weak scaling, Gustafson: per-device batch fixed). "
    "It equals the speedup up to the last partial batch.",
    "n_t1_over_tn_epoch = N x T(1)/T(N) on EPOCH times: the course forum's scaled-speedup formula (an "
    "earlier report's second definition) applied to epoch times. With the per-device batch fixed each epoch "
    "already has N times fewer steps, so this counts N twice (about N x the speedup); the same formula on "
    "STEP times is scaled_speedup. Both definitions side by side: tables/scaling_definitions.",
    "T(1): the same method with one device and the same per-device batch.",
    "serial_fraction: Karp-Flatt e = (1/speedup - 1/N) / (1 - 1/N), the non-parallel share Amdahl's law "
    "would need to explain the speedup (empty for N = 1).",
    "A row whose status is not ok did not run: it has no numbers.",
    "skew_wait_seconds: the slowest rank's wait, in a barrier right after each step's data movement, for "
    "the other ranks' loaders (DDP only; 0 with one device). It is NOT in T(N): without the barrier it "
    "would sit inside compute (backward's all-reduce waits for the slowest loader). "
    "train_plus_skew_wait_seconds: max over ranks of training + skew wait, about what T(N) was before "
    "the barrier existed. Both are blank for DataParallel and for records written before the barrier "
    "existed, whose T(N) still includes that wait.",
]


def scaling_table(store: ResultStore, result: ScalingResult):
    """Save Table 1 (``tables/scaling.md`` + ``.csv``) and return it."""
    df = scaling_frame(result.records)
    notes = list(TABLE1_NOTES)
    if any(r.config.get("backend") == "gloo" for r in result.records):
        notes.append("DDP (gloo, CPU processes): no GPU here; each 'device' is one single-thread CPU "
                     "process, so these numbers show the mechanics, not GPU performance.")
    notes.append(f"settings: {result.settings.label}")
    store.save_table(_none_for_nan(df.copy()), "scaling", [r for r in result.records if r.status == "ok"],
                     title="Table 1: epoch-2 training time and speedup over devices", notes=notes)
    return df


def speedup_figure(store: ResultStore, result: ScalingResult, name: str = "scaling_speedup"):
    """Speedup T(1)/T(N) against devices, one line per (method, per-device batch), with the ideal line."""
    import matplotlib.pyplot as plt

    df = scaling_frame(result.records)
    df = df[df["speedup"].notna()]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    top = max([1, *result.settings.devices])
    ax.plot([1, top], [1, top], "k--", lw=1, label="ideal (speedup = N)")
    for (method, b), g in df.groupby(["method", "per_device_batch"], sort=False):
        g = g.sort_values("devices")
        ax.plot(g["devices"], g["speedup"].astype(float), "o-", label=f"{method}, {b}/device")
    ax.set_xlabel("devices N")
    ax.set_ylabel("speedup T(1)/T(N), epoch 2")
    ax.set_xticks(sorted(set(result.settings.devices)))
    ax.set_title("Speedup over devices (per-device batch fixed)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the provenance label below the axis
    path = store.save_figure(fig, name, result.ok())
    return fig, path


# ----- Table 2


@dataclass
class CommRow:
    """Communication of one (method, devices, per-device batch) configuration, seconds per epoch."""

    method: str
    devices: int
    per_device_batch: int
    status: str
    t1_seconds: float | None = None
    tn_seconds: float | None = None
    compute_a_seconds: float | None = None
    comm_a_seconds: float | None = None
    exposed_b_seconds: float | None = None
    allreduce_c_seconds: float | None = None
    overlap_seconds: float | None = None
    overlap_fraction: float | None = None
    steps_per_epoch: int | None = None
    gradient_bytes: int | None = None
    backend: str | None = None
    skew_wait_seconds: float | None = None
    exposed_noise_b_seconds: float | None = None  # standard error of (b), per epoch (probe pairs)
    oversubscribed: str | None = None  # see :func:`oversubscribed`


def comm_measurements(store: ResultStore, devices: Sequence[int] | None = None,
                      methods: Sequence[str] = (DDP,)) -> list[CommRow]:
    """One :class:`CommRow` per stored N-device configuration of notebook 03 (the Table 3 interface).

    (a) uses T(1) from ``scaling`` (same method, same per-device batch, one device) and
    T(N) from ``compute_vs_comm`` (DDP) or ``scaling`` (DataParallel); (b) and (c) come
    from the DDP worker's probe, scaled to the reported epoch's steps.
    """
    ones = {}
    for r in store.latest(SCALING):
        if r.config.get("record") == "aggregate" and r.config["devices"] == 1 and r.status == "ok":
            ones[(r.config["method"], r.config["batch_size"], r.config.get("device_type"))] = r
    recs = [r for r in store.latest(COMPUTE_VS_COMM) if r.config.get("record") == "aggregate"]
    if DP in methods:
        recs += [r for r in store.latest(SCALING) if r.config.get("record") == "aggregate"
                 and r.config["method"] == DP and r.config["devices"] > 1]
    return [comm_row(r, ones.get((r.config["method"], r.config["batch_size"], r.config.get("device_type"))))
            for r in recs if r.config["method"] in methods
            and (devices is None or r.config["devices"] in devices)]


def comm_row(rec: Record, one: Record | None) -> CommRow:
    """Table 2's figures for one N-device record and its one-device counterpart."""
    c, m = rec.config, rec.metrics
    row = CommRow(method=_label(c["method"], c.get("backend"), c.get("device_type")),
                  devices=int(c["devices"]), per_device_batch=int(c["batch_size"]), backend=c.get("backend"),
                  status="ok" if rec.status == "ok" else (rec.reason or rec.status))
    if rec.status != "ok":
        return row
    row.tn_seconds = _t(rec)
    row.t1_seconds = _t(one)
    row.skew_wait_seconds = _skew(rec)
    row.oversubscribed = oversubscribed(rec)
    row.steps_per_epoch = m.get("steps")
    row.gradient_bytes = m.get("gradient_bytes")
    if row.t1_seconds is None:
        row.status = "T(1) missing: run the one-device configuration (notebook 02)"
    else:
        row.compute_a_seconds, row.comm_a_seconds = derived_comm(row.t1_seconds, row.tn_seconds, row.devices)
    if "exposed_comm_seconds" in m:
        row.exposed_b_seconds = m["exposed_comm_seconds"]
        row.allreduce_c_seconds = m["allreduce_seconds"]
        row.overlap_seconds, row.overlap_fraction = overlap_figures(row.exposed_b_seconds,
                                                                    row.allreduce_c_seconds)
        probe = m.get("comm_probe") or {}
        se = probe.get("noise_seconds")
        if se is not None and not _isnan(se) and row.steps_per_epoch:
            row.exposed_noise_b_seconds = float(se) * int(row.steps_per_epoch)
    return row


def compute_vs_comm_frame(rows: Sequence[CommRow]):
    """Table 2 as a DataFrame (seconds per epoch; ratios unitless)."""
    import pandas as pd

    out = []
    for r in rows:
        d = {"method": r.method, "devices": r.devices, "per_device_batch": r.per_device_batch,
             "status": r.status, "T1_seconds": r.t1_seconds, "TN_seconds": r.tn_seconds,
             "compute_a_seconds": r.compute_a_seconds, "comm_a_seconds": r.comm_a_seconds,
             "compute_to_comm_a": None,
             "exposed_comm_b_seconds": r.exposed_b_seconds, "allreduce_c_seconds": r.allreduce_c_seconds,
             "overlap_c_minus_b_seconds": r.overlap_seconds,
             "hidden_percent": 100 * r.overlap_fraction if r.overlap_fraction is not None else None,
             "compute_to_comm_b": None, "skew_wait_seconds": r.skew_wait_seconds,
             "exposed_noise_b_seconds": r.exposed_noise_b_seconds,
             "noise_flag": noise_flag(r.exposed_b_seconds, r.exposed_noise_b_seconds),
             "oversubscribed": r.oversubscribed}
        if r.compute_a_seconds is not None and r.comm_a_seconds and r.comm_a_seconds > 0:
            d["compute_to_comm_a"] = r.compute_a_seconds / r.comm_a_seconds
        if r.exposed_b_seconds and r.tn_seconds and r.exposed_b_seconds > 0:
            d["compute_to_comm_b"] = (r.tn_seconds - r.exposed_b_seconds) / r.exposed_b_seconds
        out.append(d)
    cols = ["method", "devices", "per_device_batch", "status", "T1_seconds", "TN_seconds",
            "compute_a_seconds", "comm_a_seconds", "compute_to_comm_a", "exposed_comm_b_seconds",
            "allreduce_c_seconds", "overlap_c_minus_b_seconds", "hidden_percent", "compute_to_comm_b",
            "skew_wait_seconds", "exposed_noise_b_seconds", "noise_flag", "oversubscribed"]
    return pd.DataFrame(out, columns=cols)


TABLE2_NOTES = [
    "All seconds are per epoch (epoch 2 of 2, slowest rank). (a) the assignment's derivation: "
    "compute = T(1)/N, comm = T(N) - T(1)/N (negative: faster than a perfect split, the assumption fails).",
    "(b) exposed comm = (step with gradient sync - the same step under no_sync) x steps per epoch.",
    "(c) all-reduce = time in which a bucket all-reduce was in flight (DDP comm hook) x steps per epoch.",
    "overlap = (c) - (b): all-reduce hidden behind backward; hidden_percent = overlap / (c).",
    f"exposed_noise_b_seconds: standard error of (b) over the probe's sync/no_sync pairs, per epoch. "
    f"noise_flag 'noise >= effect: not a result' when {NOISE_SIGMAS:g} x that error >= (b): then (b), the "
    "overlap and hidden_percent are not results (e.g. 100 % hidden at one batch and 0 % at another can both "
    "be noise); repeat with more comm_steps. Blank: records written before the noise was kept.",
    "compute_to_comm_a = compute (a) / comm (a); compute_to_comm_b = (T(N) - (b)) / (b).",
    "oversubscribed: more gloo threads than cores (quick: 4 single-thread ranks on 2 cores); the ranks took "
    "turns on the cores, so the row exercises the path and its split is not a measurement of the network.",
    "T(N) excludes every rank's loader wait and skew wait (the wait for the slowest rank's loader, timed "
    "by a barrier after the data movement; shown as skew_wait_seconds, slowest rank), so a slow loader "
    "is not counted as communication by (a). Blank skew_wait_seconds: a record from before the barrier "
    "existed, whose T(N) includes that wait.",
]


def compute_vs_comm_rows(lab, one: ScalingResult, many: ScalingResult) -> list[CommRow]:
    """Table 2's rows in table order, including rows that did not run (with their reason)."""
    s = many.settings
    ones = {(r.config["method"], r.config["batch_size"]): r for r in one.records
            if r.config.get("record", "aggregate") == "aggregate"}
    rows = []
    for r in many.records:
        if r.config.get("record", "aggregate") != "aggregate":
            continue
        if r.config["devices"] not in s.comm_devices:
            continue
        rows.append(comm_row(r, ones.get((r.config["method"], r.config["batch_size"]))))
    return rows


def compute_vs_comm_table(store: ResultStore, lab, one: ScalingResult, many: ScalingResult):
    """Save Table 2 (``tables/compute_vs_comm.md`` + ``.csv``) and return it."""
    rows = compute_vs_comm_rows(lab, one, many)
    df = compute_vs_comm_frame(rows)
    notes = list(TABLE2_NOTES)
    if any(r.backend == "gloo" for r in rows):
        notes.append("DDP (gloo, CPU processes): on a CPU the all-reduce thread competes with backward for "
                     "the same core, so (b) can exceed (c); on GPUs NCCL runs beside the compute kernels.")
    notes.append(f"settings: {many.settings.label}")
    recs = [r for r in one.records + many.records if r.status == "ok"]
    store.save_table(_none_for_nan(df.copy()), "compute_vs_comm", recs,
                     title="Table 2: compute vs communication per epoch", notes=notes)
    return df


def compute_vs_comm_figure(store: ResultStore, df, records: Sequence[Record], name: str = "compute_vs_comm"):
    """Stacked bars per configuration: compute + communication by (a), and by (b) for DDP.

    A negative communication by (a) (T(N) < T(1)/N) is drawn as 0 and labelled, not
    subtracted from the compute bar. DDP's (b) bars carry the all-reduce time (c) as a label.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    ok = df[df["TN_seconds"].notna()]
    labels, comp, comm, kinds, allreduce = [], [], [], [], []
    for _, r in ok.iterrows():
        base = f"{_short_method(r['method'])} N={r['devices']}\n{r['per_device_batch']}/device"
        if r["compute_a_seconds"] is not None and not _isnan(r["compute_a_seconds"]):
            labels.append(base + "\nmethod (a)")
            comp.append(float(r["compute_a_seconds"]))
            comm.append(float(r["comm_a_seconds"]))
            kinds.append("a")
            allreduce.append(None)
        if r["exposed_comm_b_seconds"] is not None and not _isnan(r["exposed_comm_b_seconds"]):
            labels.append(base + "\nmethod (b)")
            comp.append(float(r["TN_seconds"]) - float(r["exposed_comm_b_seconds"]))
            comm.append(float(r["exposed_comm_b_seconds"]))
            kinds.append("b")
            allreduce.append(None if _isnan(r["allreduce_c_seconds"]) else float(r["allreduce_c_seconds"]))
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.4))
    x = np.arange(len(labels))
    shown = [max(0.0, v) for v in comm]
    ax.bar(x, comp, color="#4c72b0", label="compute")
    ax.bar(x, shown, bottom=comp, color="#dd8452", label="communication")
    for i, (k, c) in enumerate(zip(kinds, allreduce)):
        top = comp[i] + shown[i]
        if k == "b" and c is not None:
            ax.annotate(f"(c) {c:.3g} s", (x[i], top), ha="center", va="bottom", fontsize=6)
        if comm[i] < 0:
            ax.annotate(f"comm (a) = {comm[i]:.3g} s < 0", (x[i], top), ha="center", va="bottom",
                        fontsize=6, color="#a03000")
    ax.axhline(0, color="k", lw=0.8)
    if comp:
        ax.set_ylim(0, 1.15 * max(c + v for c, v in zip(comp, shown)))  # head-room for the labels
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("seconds per epoch (epoch 2)")
    ax.set_title("Compute vs communication per epoch\n"
                 "(a) T(1)/N split   (b) measured exposed   (c) all-reduce in flight", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout(rect=(0, 0.05, 1, 1))  # room for the provenance label below the tick labels
    path = store.save_figure(fig, name, records)
    return fig, path


def _short_method(label: str) -> str:
    """A tick label's method from a table's method label: "DP", "DDP" (NCCL) or "DDP gloo/CPU"."""
    if label.startswith("DataParallel"):
        return "DP"
    return "DDP gloo/CPU" if "gloo" in label else "DDP"


def _isnan(v) -> bool:
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return True


def rank_breakdown_frame(records: Sequence[Record], devices: int, batch_size: int):
    """Per-rank phases of the reported epoch for one DDP configuration (seconds) plus the aggregate row.

    ``skew_wait_seconds`` (the rank's wait for the other ranks' loaders, not part of
    ``train_seconds``) is NaN for records written before the skew barrier existed.
    """
    import pandas as pd

    rows = []
    for r in records:
        c = r.config
        if c.get("method") != DDP or c["devices"] != devices or c["batch_size"] != batch_size:
            continue
        m = r.metrics
        if c.get("record") == "rank":
            rows.append({"rank": c["rank"], "epoch_seconds": m["epoch_seconds"],
                         "train_seconds": m["train_seconds"],
                         "data_loading_seconds": m["data_loading_seconds"],
                         "data_movement_seconds": m["data_movement_seconds"],
                         "compute_seconds": m["compute_seconds"],
                         "communication_seconds": m["communication_seconds"],
                         # None (blank) in records written before the skew barrier existed
                         "skew_wait_seconds": m.get("skew_wait_seconds")})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows).sort_values("rank")
    df["skew_wait_seconds"] = pd.to_numeric(df["skew_wait_seconds"])  # None -> NaN
    mean = df.drop(columns="rank").mean()
    slow = df.drop(columns="rank").max()
    df = pd.concat([df, pd.DataFrame([{"rank": "mean", **mean}, {"rank": "max (reported)", **slow}])],
                   ignore_index=True)
    return df
