"""Questions Q2 and Q3.1: scaling over 1/2/4 devices, and compute vs communication: the measurements.

The shape of every experiment: :class:`Settings`, :func:`measure` (notebook 02) and
:func:`measure_compute_vs_comm` (notebook 03) take the session and the settings and return
records; the tables and figures are in :mod:`lab_utils.experiments.scaling_tables` (notebook
02) and :mod:`lab_utils.experiments.compute_vs_comm` (notebook 03).

Notebook 02 (:func:`measure`)
-----------------------------
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
- **DataParallel** (``method="DataParallel"``): ``nn.DataParallel`` over N GPUs and the
  global batch N x b (it splits each batch), in one process of its own
  (:mod:`lab_utils.workers.dataparallel`, launched with ``nproc=1``: the notebook's kernel
  opens no CUDA context). Only with GPUs.
- A configuration that needs more GPUs than exist is a row ``needs N GPUs`` (status
  ``skipped``), one that does not fit is ``OOM``; never a number. Those rows are not
  stored, so a later run on a bigger node measures them.

Notebook 03 (:func:`measure_compute_vs_comm`)
---------------------------------------------
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

:func:`lab_utils.experiments.compute_vs_comm.comm_measurements` turns those records into one
row per (devices, per-device batch) with the three communication figures in seconds per epoch,
the steps per epoch and the gradient bytes: the stable interface for Table 3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from lab_utils import launcher
from lab_utils.core import profiles
from lab_utils.core.config import check_batch_sizes, check_positive_int
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import cpu_cores, hardware_summary
from lab_utils.core.memory import mentions_out_of_memory, oom_reason_from_log
from lab_utils.store import Record, ResultStore, canonical_key
from lab_utils.workers import dataparallel
from lab_utils.workers.args import WorkerArgs
from lab_utils.workers.dataparallel import dp_config

__all__ = ["COMPUTE_VS_COMM", "DDP", "DP", "DP_MODULE", "SCALING", "Placement", "Settings", "measure",
           "measure_compute_vs_comm", "worker_args"]

SCALING = "scaling"
COMPUTE_VS_COMM = "compute_vs_comm"
DDP = "DDP"
DP = dataparallel.METHOD
DP_BACKEND = dataparallel.BACKEND
DP_MODULE = "lab_utils.workers.dataparallel"


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

    def validate(self) -> Settings:
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


profiles.register(Settings, profiles.SCALING, "scaling")


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


def _place(method: str, devices: int, gpus: int, settings: Settings, cores: int) -> Placement:
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


def _methods_here(gpus: int) -> tuple[str, ...]:
    """DataParallel and DDP side by side with GPUs; DDP (gloo, CPU) alone without."""
    return (DP, DDP) if gpus else (DDP,)


# --------------------------------------------------------------------------- configurations


def worker_args(settings: Settings, profile: str, experiment: str, backend: str,
                batch_sizes: Sequence[int], measure_comm: bool = False) -> WorkerArgs:
    """The DDP worker's arguments for some batch sizes (resolved: image counts, dataset)."""
    b = tuple(batch_sizes)
    return WorkerArgs(
        experiment=experiment, profile=profile, batch_size=b[0] if len(b) == 1 else b,
        epochs=settings.epochs, width=settings.width,
        train_images=settings.train_images if settings.train_images is not None else 0,
        test_images=None, dataset=settings.dataset, num_workers=settings.num_workers,
        measure_comm=measure_comm, comm_steps=settings.comm_steps, backend=backend,
        bucket_cap_mb=settings.bucket_cap_mb, seed=settings.seed,
    ).validate().resolved()


def _unavailable_config(args: WorkerArgs, p: Placement) -> dict[str, Any]:
    """Config of a row that could not run, with the backend it would have used here: DDP with
    ``args.backend`` (gloo on a machine without GPUs, so the row is labelled "DDP (gloo, CPU
    processes)", never "NCCL, GPUs"; NCCL when GPUs exist), DataParallel on GPUs."""
    if p.method == DDP:
        return args.record_config(p.devices, args.backend if args.backend in ("nccl", "gloo") else "nccl")
    return dp_config(args, p.devices)


# --------------------------------------------------------------------------- running


def measure(lab, settings: Settings, force: bool = False, verbose: bool = True) -> list[Record]:
    """Notebook 02: every (method, devices, per-device batch) of ``settings``; one aggregate record each,
    in table order (measured now, stored, OOM, or a row not stored saying why it did not run).

    ``lab`` is the notebook's :class:`~lab_utils.session.LabSession` (profile, store, GPU count).
    Every measurement goes through the store's one door (:meth:`~lab_utils.store.ResultStore.run`
    / ``run_many``): a configuration stored on these devices is reused unless ``force``.
    """
    return _measure_grid(lab, settings.validate(), force, verbose, settings.devices, None, SCALING, False)


def measure_compute_vs_comm(lab, settings: Settings, force: bool = False,
                            verbose: bool = True) -> list[Record]:
    """Notebook 03: T(1) (from notebook 02's store, or measured now; experiment ``scaling``), DDP on
    ``comm_devices`` with communication measured (experiment ``compute_vs_comm``) and, with GPUs,
    DataParallel on the same device counts (method (a) only; experiment ``scaling``). The
    aggregate records of all three, T(1) first."""
    s = settings.validate()
    gpus = int(lab.gpu_count)
    out = _measure_grid(lab, s, False, verbose, (1,), None, SCALING, False)
    if gpus:
        out += _measure_grid(lab, s, False, verbose, s.comm_devices, (DP,), SCALING, False)
    return out + _measure_grid(lab, s, force, verbose, s.comm_devices, (DDP,), COMPUTE_VS_COMM, True)


def _measure_grid(lab, s: Settings, force: bool, verbose: bool, devs: Sequence[int],
                  methods: Sequence[str] | None, experiment: str, measure_comm: bool) -> list[Record]:
    """(method, devices, per-device batch) of ``devs`` x ``s.batch_sizes``: the records in table order."""
    store: ResultStore = lab.store
    profile = lab.profile.name
    gpus = int(lab.gpu_count)
    cores = cpu_cores()
    meths = tuple(methods) if methods is not None else _methods_here(gpus)
    run_b = [b for b in s.batch_sizes if s.run_batch_sizes is None or b in s.run_batch_sizes]
    out: dict[tuple[str, int, int], Record] = {}
    measured: list[tuple[str, int, int]] = []
    # DDP's launches first (the table order is kept), as when DataParallel trained in this process.
    for method in sorted(meths, key=lambda m: m != DDP):
        for n in devs:
            p = _place(method, n, gpus, s, cores)
            backend = p.backend if p.runs and method == DDP else ("gloo" if not gpus else "nccl")
            args = worker_args(s, profile, experiment, backend, s.batch_sizes, measure_comm)
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
    if verbose:
        now = ", ".join(f"{m} {n} x {b}" for m, n, b in measured) or "nothing (all from the store)"
        print(f"{experiment}: measured now: {now}", flush=True)
    order = [(m, n, b) for m in meths for n in devs for b in s.batch_sizes]
    return [out[k] for k in order if k in out]


def _row(args: WorkerArgs, p: Placement, experiment: str, status: str, reason: str | None) -> Record:
    cfg = _unavailable_config(args, p)
    return Record(experiment, cfg, status=status, reason=reason, profile=args.profile,
                  hardware={"device_type": p.device_type or cfg.get("device_type") or "cuda",
                            "device_name": None, "device_count": p.devices})


def _run_ddp(store: ResultStore, s: Settings, args: WorkerArgs, n: int, p: Placement,
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


def _run_dp_sizes(store: ResultStore, s: Settings, args: WorkerArgs, n: int, p: Placement,
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
            return _run_dp(s, args.for_batch(b), n)

        got[b] = rec = store.run(experiment, cfgs[b], measure, force=force, hardware=_hardware(p))
        if rec.status == "oom":
            oom_at = b
    return got, measured


def _run_dp(s: Settings, args: WorkerArgs, n: int) -> Record:
    """DataParallel over GPUs 0..n-1, global batch n x per-GPU batch: the record of one launch of
    :mod:`lab_utils.workers.dataparallel` with ONE process (this kernel opens no CUDA context; the
    worker says why). The worker turns out of memory into an ``oom`` record; a launch that ends in
    out of memory before it could (a CUDA context that does not fit) is an ``oom`` row too, any
    other failure is raised with the process's log."""
    threads = s.cpu_threads if s.pin_threads else None
    argv = [*args.to_argv(), "--gpus", str(n), *(["--threads", str(threads)] if threads else [])]
    try:
        res = launcher.launch(DP_MODULE, argv, nproc=1, timeout_s=s.timeout_s, threads_per_rank=threads)
    except LaunchError as e:
        if not mentions_out_of_memory(str(e)):
            raise
        return Record(args.experiment or SCALING, dp_config(args, n), status="oom", profile=args.profile,
                      reason=oom_reason_from_log(str(e)),
                      hardware={**hardware_summary("cuda", n), "processes": 1, "backend": DP_BACKEND})
    return res.records[-1]
