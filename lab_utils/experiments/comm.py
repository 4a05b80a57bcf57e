"""Notebook 04's measurements: the all-reduce benchmark, Table 3, the fit and the projections.

The formulas (the gradient's bytes, what a ring all-reduce sends per rank and per epoch,
the time models of ring, tree, recursive doubling and halving-doubling, nccl-tests' algbw
and busbw, the alpha-beta fit) live in :mod:`lab_utils.core.ring`; this module measures and
projects with them, and re-exports the two notebook 04 calls (``comm.gradient_bytes``,
``comm.ring_bytes_per_epoch``).

The experiment's shape: :class:`Settings` (and the benchmark's :class:`BenchSettings`),
:func:`measure` (lab, settings) -> the benchmark's records; the tables, the fit, the projections
and the figures are in :mod:`lab_utils.experiments.comm_tables`.

**Benchmark.** :func:`measure_bench` runs :mod:`lab_utils.workers.allreduce_bench` under torchrun
(NCCL on GPUs, gloo on CPU processes); the worker hands its records back, the store keeps them.
**Table 3** (:func:`utilization_rows`): bytes a ring moves per rank and epoch over measured
communication seconds (:class:`CommMeasurement`).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_utils import launcher
from lab_utils.core import hardware, profiles
from lab_utils.core.backends import apply_training_backends
from lab_utils.core.comm_hooks import noise_flag
from lab_utils.core.config import check_positive_int
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import cpu_cores, gpu_count, hardware_summary
from lab_utils.core.loop import make_optimizer, train_steps
from lab_utils.core.ring import achieved_gb_per_s, iterations_per_epoch, message_sizes, ring_bytes_per_rank

# The formulas notebook 04 and its exercises call as comm.<name> (re-exported from core.ring).
from lab_utils.core.ring import gradient_bytes as gradient_bytes
from lab_utils.core.ring import ring_bytes_per_epoch as ring_bytes_per_epoch
from lab_utils.core.timing import synchronize
from lab_utils.models import ResNet18
from lab_utils.session import session_for
from lab_utils.store import Record
from lab_utils.workers.args import BenchArgs

__all__ = ["BENCH_EXPERIMENT", "BenchSettings", "CommMeasurement", "LinkPeak", "Settings",
           "bench_rank_counts", "detect_link_peak", "gradient_bytes", "measure", "measure_bench",
           "measure_compute_step_seconds", "measure_compute_steps", "plan_bench", "ring_bytes_per_epoch",
           "utilization_rows"]

BENCH_EXPERIMENT = "allreduce_bench"
_BENCH_MODULE = "lab_utils.workers.allreduce_bench"


# The spec's device counts for projections past the hardware at hand.
_PROJECTION_DEVICES = tuple(2**k for k in range(3, 11))  # 8, 16, ..., 1024


# --------------------------------------------------------------------------- nominal links

# Nominal NVLink bandwidth per GPU, one direction, decimal GB/s (data sheets: total
# bidirectional / 2). busbw is compared with one direction: a ring sends and receives at once.
_NVLINK_GB_PER_S: list[tuple[str, float]] = [
    ("H100 NVL", 300.0),   # NVLink bridge, 600 GB/s bidirectional
    ("H100 PCIe", 300.0),  # NVLink bridge, 600 GB/s bidirectional
    ("H100", 450.0),       # SXM5, NVLink 4, 900 GB/s bidirectional
    ("H200", 450.0),
    ("A100", 300.0),       # NVLink 3, 600 GB/s bidirectional
    ("V100", 150.0),       # SXM2, NVLink 2, 300 GB/s bidirectional
]
# PCIe, per lane and direction, decimal GB/s after line encoding.
_PCIE_LANE_GB_PER_S = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}

@dataclass
class LinkPeak:
    """A nominal per-direction link bandwidth, or why there is none."""

    gb_per_s: float | None
    description: str
    kind: str | None = None   # of what: "nvlink", "pcie", "mixed", None (hardware.classify_interconnect)


def _nominal_link_peak(device_name: str | None, kind: str | None, pcie_gen: int | None = None,
                      pcie_width: int | None = None) -> LinkPeak:
    """The nominal one-direction bandwidth of the link a ring uses, when it is known.

    ``kind`` comes from :func:`lab_utils.core.hardware.classify_interconnect`. CPU processes (gloo over shared
    memory / loopback), mixed topologies and unknown GPUs get no number.
    """
    if kind == "nvlink" and device_name:
        for pattern, gbps in _NVLINK_GB_PER_S:
            if pattern.lower() in device_name.lower():
                return LinkPeak(gbps, f"NVLink, {device_name}: {gbps:g} GB/s per direction (nominal)", kind)
        return LinkPeak(None, f"NVLink on {device_name}: not in the lab's table, no nominal peak", kind)
    if kind == "pcie" and pcie_gen in _PCIE_LANE_GB_PER_S and pcie_width:
        gbps = _PCIE_LANE_GB_PER_S[pcie_gen] * pcie_width
        return LinkPeak(gbps, f"PCIe gen{pcie_gen} x{pcie_width}: {gbps:.1f} GB/s per direction (nominal)",
                        kind)
    if kind == "pcie":
        return LinkPeak(None, "PCIe, generation and width unknown (nvidia-smi did not say): no nominal peak",
                        kind)
    if kind == "mixed":
        return LinkPeak(None, "mixed NVLink/PCIe topology: the ring's slowest hop is unknown, "
                              "no nominal peak", kind)
    if kind is None and (device_name or "").startswith("cpu"):
        return LinkPeak(None, "CPU processes (gloo over shared memory): no nominal link peak")
    return LinkPeak(None, "interconnect unknown: no nominal peak")


def _pcie_link() -> tuple[int | None, int | None]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None, None
    try:
        out = subprocess.run([exe, "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        gen, width = out.stdout.strip().splitlines()[0].split(",")
        return int(gen), int(width)
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None, None


def detect_link_peak(n_gpus: int | None = None) -> LinkPeak:
    """The nominal link peak of this machine's GPUs (NVLink table, or PCIe gen x width).

    With fewer than 2 GPUs there is no GPU link to use: the benchmark runs CPU processes.
    """
    count = hardware.gpu_count() if n_gpus is None else n_gpus
    if count < 2:  # the benchmark then runs gloo between CPU processes (see plan_bench)
        return _nominal_link_peak("cpu", None)
    kind = hardware.classify_interconnect(hardware.interconnect(), count)
    gen, width = _pcie_link() if kind == "pcie" else (None, None)
    return _nominal_link_peak(hardware.device_name("cuda"), kind, gen, width)


# --------------------------------------------------------------------------- the benchmark


@dataclass(frozen=True)
class BenchSettings:
    """Per-profile knobs of the all-reduce benchmark.

    Sizes double from ``min_bytes`` to ``max_bytes`` (fp32 messages); each size gets one
    correctness check, ``warmup`` untimed all-reduces, then ``iters`` timed ones.
    ``timeout_s`` bounds one launch (start-up included).
    """

    max_bytes: int
    iters: int
    warmup: int
    min_bytes: int = 8
    timeout_s: float = 600.0


profiles.register(BenchSettings, profiles.BENCH, "all-reduce benchmark")


@dataclass(frozen=True)
class _BenchPlan:
    """Which backend and how many ranks a benchmark runs, and on what."""

    backend: str
    nproc: int
    device_type: str
    note: str = ""


def plan_bench(nproc: int | None = None, backend: str = "auto") -> _BenchPlan:
    """NCCL on GPUs when there are at least 2 (one rank per GPU), else gloo on CPU processes.

    Two NCCL ranks cannot share one GPU, so a one-GPU machine benchmarks gloo between
    CPU processes and says so.
    """
    if backend not in ("auto", "nccl", "gloo"):
        raise LabError(f"Unknown backend {backend!r}; use auto, nccl or gloo.")
    gpus = gpu_count()
    if nproc is not None:
        check_positive_int(nproc, "--nproc")
    if backend == "auto":
        backend = "nccl" if gpus >= 2 and (nproc is None or nproc <= gpus) else "gloo"
    if backend == "nccl":
        if gpus == 0:
            raise LabError("The nccl backend needs CUDA GPUs; use --backend gloo on this machine.")
        n = nproc or gpus
        if n > gpus:
            raise LabError(f"NCCL runs one rank per GPU: {n} ranks need {n} GPUs, this machine has {gpus}; "
                           f"use --nproc {gpus} or --backend gloo.")
        return _BenchPlan("nccl", n, "cuda")
    n = nproc or 2
    note = ""
    if gpus == 1:
        note = "one GPU only: NCCL needs a GPU per rank, so this benchmarks gloo between CPU processes"
    elif gpus == 0:
        note = "no GPU: gloo between CPU processes (shared memory), not a GPU interconnect"
    return _BenchPlan("gloo", n, "cpu", note)


def _bench_args(settings: BenchSettings, backend: str) -> BenchArgs:
    """The benchmark worker's arguments, :class:`lab_utils.workers.args.BenchArgs` (the launcher
    adds ``--out``)."""
    return BenchArgs(max_bytes=settings.max_bytes, min_bytes=settings.min_bytes, iters=settings.iters,
                     warmup=settings.warmup, backend=backend).validate()


def measure_bench(lab, nproc: int | None = None, settings: BenchSettings | None = None,
                  backend: str = "auto", force: bool = False, log_dir: str | Path | None = None,
                  verbose: bool = True) -> list[Record]:
    """Run (or reuse) the benchmark on ``nproc`` ranks; return one stored Record per message size.

    The sizes are one benchmark, measured side by side: all are reused (unless ``force``) when
    every one is stored from one run on this machine's devices; otherwise one torchrun launch
    measures all sizes and each becomes a record of experiment ``allreduce_bench`` (metrics:
    ``time_us`` = mean microseconds per all-reduce of the slowest rank, ``algbw_gb_per_s``,
    ``busbw_gb_per_s``, ``correct``), stored through :meth:`~lab_utils.store.ResultStore.run_many`.
    """
    store = session_for(lab).store
    settings = settings or profiles.settings(BenchSettings, store.profile)
    sizes = message_sizes(settings.min_bytes, settings.max_bytes)
    check_positive_int(settings.iters, "benchmark iterations")
    if settings.warmup < 0:
        raise LabError(f"Warm-up iterations must be 0 or more, got {settings.warmup}.")
    plan = plan_bench(nproc, backend)
    if plan.nproc < 2:
        raise LabError("An all-reduce benchmark needs at least 2 ranks; use --nproc 2 or more.")
    args = _bench_args(settings, plan.backend)
    cfgs = [args.record_config(plan.nproc, s) for s in sizes]
    hw = hardware_summary(plan.device_type, plan.nproc)
    measured = []

    def measure(todo):
        if verbose:
            print(f"all-reduce benchmark: {plan.backend}, {plan.nproc} ranks, {len(sizes)} sizes "
                  f"{sizes[0]} B .. {sizes[-1]} B" + (f" ({plan.note})" if plan.note else ""))
        for rec in launcher.stream(_BENCH_MODULE, args.to_argv(), nproc=plan.nproc,
                                   timeout_s=settings.timeout_s, log_dir=log_dir):
            if plan.note:
                rec.metrics["note"] = plan.note
            measured.append(rec)
            yield rec

    out = store.run_many(BENCH_EXPERIMENT, cfgs, measure, force=force, hardware=hw, together=True)
    if verbose and not measured:
        print(f"all-reduce benchmark ({plan.backend}, {plan.nproc} ranks): reusing {len(out)} "
              f"stored sizes (force=True to re-measure)")
    return [r if r is not None else Record(BENCH_EXPERIMENT, c, status="error", hardware=hw,
                                           reason="the worker returned no timing for it")
            for r, c in zip(out, cfgs)]


# --------------------------------------------------------------------------- Table 3


@dataclass
class CommMeasurement:
    """Communication seconds for one (devices, per-GPU batch) from notebook 03, by source.

    ``source`` names how the seconds were obtained (derived ``T(N) - T(1)/N``, exposed,
    hook all-reduce total); ``seconds`` is per epoch; None with a ``reason`` when missing.
    ``grad_bytes`` / ``dataset_size`` describe the run the seconds belong to;
    ``steps_per_epoch`` (the run's measured steps) overrides the formula's iterations.
    """

    devices: int
    per_device_batch: int
    source: str
    seconds: float | None
    grad_bytes: int
    dataset_size: int
    reason: str | None = None
    steps_per_epoch: int | None = None
    method: str = "DDP"
    noise_seconds: float | None = None  # standard error of ``seconds`` where it was repeated (probe (b))


# Which Table 3 GB/s answers Q3.2, and why (one entry per source; the table's ``q3_2`` column).
_Q32_ROLE = {
    "(a) derived T(N)-T(1)/N": "Q3.2 answer (the assignment's comm time, Q3.1's T(N) - T(1)/N)",
    "(b) exposed (sync - no_sync)": "not a rate: only the exposed part of the all-reduce",
    "(c) hook all-reduce": "check: the all-reduce's own measured time (the network's real rate)",
}


def utilization_rows(measurements: Iterable[CommMeasurement], peak_busbw: Mapping[int, float] | float | None,
                     link: LinkPeak | None = None) -> list[dict[str, Any]]:
    """Table 3 rows: bytes per rank per epoch, seconds, achieved GB/s and utilization percentages.

    Achieved GB/s = (ring bytes sent per rank per epoch) / (communication seconds)
    (:func:`lab_utils.core.ring.achieved_gb_per_s`): the same quantity as nccl-tests' busbw, so it
    is compared with the benchmark's peak busbw (``peak_busbw``: one number, or a mapping ranks ->
    peak) and with the link's nominal one-direction bandwidth when known. A missing or
    non-positive time gives no rate. A measurement on one device is refused (LabError): one
    device communicates nothing, so it has no bandwidth.
    """
    rows = []
    measurements = list(measurements)
    for m in measurements:
        if m.devices < 2:
            raise LabError(f"Table 3 has no row for {m.devices} device ({m.method}, batch "
                           f"{m.per_device_batch}): one device communicates nothing, so it has no bandwidth; "
                           "measure 2 or more.")
    for m in measurements:
        steps = m.steps_per_epoch or iterations_per_epoch(m.dataset_size, m.per_device_batch, m.devices)
        bytes_epoch = steps * ring_bytes_per_rank(m.grad_bytes, m.devices)
        if isinstance(peak_busbw, Mapping):
            peak = peak_busbw.get(m.devices)
        else:
            peak = peak_busbw
        row: dict[str, Any] = {
            "method": m.method,
            "devices": m.devices, "per_gpu_batch": m.per_device_batch, "comm_source": m.source,
            "grad_bytes": m.grad_bytes,
            "steps_per_epoch": steps,
            "bytes_per_rank_per_epoch": bytes_epoch, "comm_seconds": m.seconds,
            "achieved_gb_per_s": None, "pct_of_bench_peak_busbw": None, "pct_of_link_nominal": None,
            "note": m.reason or "",
            "q3_2": _Q32_ROLE.get(m.source, ""), "noise_flag": noise_flag(m.seconds, m.noise_seconds),
        }
        if m.seconds is not None and m.seconds > 0:
            achieved = achieved_gb_per_s(m.grad_bytes, m.devices, steps, m.seconds)
            row["achieved_gb_per_s"] = achieved
            if peak:
                row["pct_of_bench_peak_busbw"] = 100 * achieved / peak
            if link is not None and link.gb_per_s:
                row["pct_of_link_nominal"] = 100 * achieved / link.gb_per_s
        elif m.seconds is not None and not m.reason:
            row["note"] = "communication time <= 0 (within noise): no rate"
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- DDP buckets


# --------------------------------------------------------------------------- compute per step


_COMPUTE_EXPERIMENT = "compute_step"


def measure_compute_step_seconds(width: int, batch_size: int, device, steps: int, warmup: int,
                                 seed: int = 0) -> float:
    """Mean seconds of one training step on one device (forward, loss, backward, SGD step).

    Random inputs already on the device (no loader, no host-to-device copy); the device
    is synchronized before the clock starts and after the last step. ``warmup`` steps
    (allocator, cuDNN autotuning) are not timed.
    """
    import itertools
    import time

    import torch


    check_positive_int(width, "model width")
    check_positive_int(batch_size, "batch size")
    check_positive_int(steps, "timed steps")
    apply_training_backends()  # the same cuDNN settings as the runs this step time is compared with
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = ResNet18(width=width).to(dev)
    opt = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch_size, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch_size,), device=dev)
    def run(n: int) -> None:  # n steps of the lab's one loop, untimed inside (no per-step sync)
        train_steps(model, itertools.repeat((x, y), n), n, opt, loss_fn, None, dev)

    if warmup:
        run(warmup)
    synchronize(dev)
    start = time.perf_counter()
    run(steps)
    synchronize(dev)
    return (time.perf_counter() - start) / steps


def measure_compute_steps(lab, settings: Settings, batch_sizes: Sequence[int] | None = None,
                          force: bool = False) -> list[Record]:
    """The projection's compute side, measured in this process on ``lab.device`` (one device, random
    tensors): seconds per forward+backward+SGD step of ResNet-18 (``settings.width``) at each batch
    size (default ``settings.batch_sizes``), ``compute_steps`` timed after ``compute_warmup``; one
    record each (experiment ``compute_step``), reused from ``lab.store`` unless ``force``."""
    import torch

    lab = session_for(lab)
    dev = torch.device(lab.device)
    out = []
    for b in tuple(batch_sizes or settings.batch_sizes):
        cfg = {"model": "resnet18", "width": settings.width, "batch_size": b, "device_type": dev.type,
               "steps": settings.compute_steps, "warmup": settings.compute_warmup}

        def measure(b=b):
            seconds = measure_compute_step_seconds(settings.width, b, dev, settings.compute_steps,
                                                   settings.compute_warmup)
            return Record(_COMPUTE_EXPERIMENT, {}, metrics={"compute_seconds_per_step": seconds},
                          synthetic=True, dataset="random tensors", hardware=hardware_summary(dev.type, 1))

        out.append(lab.store.run(_COMPUTE_EXPERIMENT, cfg, measure, force=force,
                                 hardware=hardware_summary(dev.type, 1)))
    return out


# --------------------------------------------------------------------------- notebook 04


@dataclass(frozen=True)
class Settings:
    """Per-profile knobs of notebook 04 (the benchmark's own are :class:`BenchSettings`).

    ``bench_ranks``: rank counts to benchmark (capped by the GPUs present; CPU processes
    when there are fewer than 2 GPUs). ``batch_sizes`` / ``width`` / ``compute_*``: the
    per-device batches and the model for the projection's compute time per step, used
    only when notebook 03's single-device records are missing. ``table_devices``: the
    device counts of Table 3.
    """

    bench_ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    width: int
    compute_steps: int
    compute_warmup: int
    table_devices: tuple[int, ...] = (2, 4)
    projection_devices: tuple[int, ...] = _PROJECTION_DEVICES
    label: str = ""


profiles.register(Settings, profiles.COMM_LAB, "notebook 04")


def measure(lab, settings: Settings, bench: BenchSettings | None = None, force: bool = False,
            verbose: bool = True) -> list[Record]:
    """Notebook 04: the all-reduce benchmark on every rank count of :func:`bench_rank_counts` (the
    settings' ``bench_ranks`` on this machine); every message size's record, rank counts in order.
    ``bench`` (default: the profile's :class:`BenchSettings`) sets the sizes and repetitions."""
    lab = session_for(lab)
    bench = bench or profiles.settings(BenchSettings, lab.profile.name)
    out: list[Record] = []
    for p in bench_rank_counts(settings.bench_ranks, gpu_count(), cpu_cores()):
        out += measure_bench(lab, nproc=p, settings=bench, force=force, verbose=verbose)
    return out


def bench_rank_counts(wanted: Sequence[int], gpus: int, cpu_cores: int | None = None) -> list[int]:
    """The rank counts to benchmark: ``wanted`` capped by the GPUs, plus all GPUs when more.

    With fewer than 2 GPUs the benchmark runs CPU processes: ``wanted`` capped by the
    cores (``cpu_cores``, None: no cap; at least 2 ranks), since more processes than
    cores would measure the scheduler, not the all-reduce.
    """
    ranks = sorted({check_positive_int(p, "benchmark rank count") for p in wanted})
    if gpus < 2:
        cap = max(cpu_cores, 2) if cpu_cores is not None else None
        kept = [p for p in ranks if p >= 2 and (cap is None or p <= cap)]
        return kept or ([2] if cap is not None else [])
    out = sorted({p for p in ranks if 2 <= p <= gpus} | {gpus})
    return out


