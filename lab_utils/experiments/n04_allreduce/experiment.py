"""Notebook 04 (Q3.2 and the projections): the all-reduce benchmark and the compute time per step.

Two plans of runs (:mod:`lab_utils.engine.plan`), one :class:`Settings`:

- :data:`ALLREDUCE_BENCH_EXPERIMENT`: :mod:`lab_utils.experiments.n04_allreduce.allreduce_worker` on each rank
  count, every fp32 message size from ``min_bytes`` to ``max_bytes`` a run, the sizes of one rank count one
  ``together`` group (one launch, reused only whole). NCCL with a GPU per rank on 2+ GPUs, else gloo between
  CPU processes (NCCL cannot put two ranks on one GPU); a rank count the machine lacks is a row "needs N GPUs"
  (CPU: "needs N CPU cores": more processes than cores would time the scheduler, not the all-reduce).
- :data:`COMPUTE_STEP_EXPERIMENT`: :mod:`lab_utils.experiments.n04_allreduce.compute_step_worker`, seconds of
  one training step of ResNet-18 per per-device batch (the projection's compute side), one launch on a GPU, in
  this process on a CPU.

The formulas are in :mod:`lab_utils.learn.ring`, the fit in :mod:`lab_utils.learn.alpha_beta`; the
benchmark's tables and fit in :mod:`lab_utils.experiments.n04_allreduce.tables`, Table 3 in
:mod:`~lab_utils.experiments.n04_allreduce.table3`, the projections in
:mod:`~lab_utils.experiments.n04_allreduce.projection` and the algorithms in
:mod:`~lab_utils.experiments.n04_allreduce.algorithms`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from lab_utils.engine import hardware, profiles
from lab_utils.engine.config import CIFAR10_TRAIN_SIZE, check_batch_sizes
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n04_allreduce import allreduce_worker as allreduce_bench
from lab_utils.experiments.n04_allreduce import compute_step_worker as compute_step
from lab_utils.experiments.shared import estimates
from lab_utils.learn.alpha_beta import message_sizes
from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.ring import GIB, MIB

# The formulas notebook 04 and its exercises call as comm.<name> (re-exported from core.ring).
from lab_utils.learn.ring import gradient_bytes as gradient_bytes
from lab_utils.learn.ring import ring_bytes_per_epoch as ring_bytes_per_epoch

__all__ = ["ALLREDUCE_BENCH_EXPERIMENT", "BENCH", "COMPUTE", "COMPUTE_STEP_EXPERIMENT", "EXPERIMENTS",
           "LinkPeak", "Settings", "cost", "detect_link_peak", "doctor_settings",
           "gradient_bytes", "plan_bench", "plan_compute", "ring_bytes_per_epoch"]

BENCH = "allreduce_bench"
COMPUTE = "compute_step"


@dataclass(frozen=True)
class Settings:
    """Notebook 04's knobs for one profile.

    The benchmark: ``bench_ranks`` rank counts (all the GPUs too, when there are more), fp32 messages
    doubling from ``min_bytes`` to ``max_bytes``, each checked once, ``warmup`` untimed and ``iters``
    timed all-reduces; ``timeout_s`` bounds one launch. The projection: ``batch_sizes`` per device and
    ResNet-18 ``width``, ``compute_steps`` timed after ``compute_warmup``; ``table_devices``: the
    device counts of Table 3, ``projection_devices`` those projected to.
    """

    bench_ranks: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    width: int
    compute_steps: int
    compute_warmup: int
    max_bytes: int
    iters: int
    warmup: int
    min_bytes: int = 8
    timeout_s: float = 600.0
    table_devices: tuple[int, ...] = (2, 4)
    projection_devices: tuple[int, ...] = tuple(2**k for k in range(3, 11))  # 8 ... 1024
    label: str = ""

    QUICK: ClassVar[dict[str, Any]] = dict(
        bench_ranks=(2, 4), batch_sizes=(32,), width=8, compute_steps=2, compute_warmup=1,
        max_bytes=8 * MIB, iters=10, warmup=3, timeout_s=300.0,
        label="quick: gloo CPU processes, messages up to 8 MiB, ResNet-18 width 8")
    FULL: ClassVar[dict[str, Any]] = dict(
        bench_ranks=(2, 4), batch_sizes=(32, 128, 512), width=64, compute_steps=20, compute_warmup=5,
        max_bytes=1 * GIB, iters=20, warmup=5, timeout_s=1800.0,
        label="full: NCCL on the GPUs (gloo CPU processes with fewer than 2), "
              "messages up to 1 GiB, the spec ResNet-18")

    def validate(self) -> Settings:
        check_batch_sizes(self.batch_sizes, "per-device batch sizes")
        for what in ("width", "compute_steps", "max_bytes", "min_bytes", "iters"):
            check_positive_int(getattr(self, what), what.replace("_", " "))
        if not self.bench_ranks or min(check_positive_int(p, "rank count") for p in self.bench_ranks) < 2:
            raise LabError(f"An all-reduce benchmark needs at least 2 ranks; got {self.bench_ranks}.")
        if self.warmup < 0 or self.compute_warmup < 0:
            raise LabError("Warm-up iterations (warmup, compute_warmup) must be 0 or more.")
        if self.timeout_s <= 0:
            raise LabError(f"timeout_s must be positive, got {self.timeout_s}.")
        return self


profiles.register(Settings, "notebook 04")


# --------------------------------------------------------------------------- the plans


def plan_bench(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """The benchmark's runs: one per (rank count, message size), the sizes of a rank count one
    ``together`` group. On 2+ GPUs every rank count up to the GPUs (and all of them) on NCCL, one rank
    per GPU; otherwise gloo CPU processes, at most one per core (at least 2)."""
    s, gpus = settings, machine.gpus
    if gpus >= 2:
        backend, device, most, ranks = "nccl", "cuda", gpus, {*s.bench_ranks, gpus}
    else:  # NCCL cannot put two ranks on one GPU
        backend, device, most, ranks = "gloo", "cpu", max(machine.cores, 2), set(s.bench_ranks)
    lacks = "GPUs" if device == "cuda" else "CPU cores (more processes than cores time the scheduler)"
    runs = []
    for p in sorted(ranks):
        skip = None if p <= most else f"needs {p} {lacks}"
        for size in message_sizes(s.min_bytes, s.max_bytes):
            cfg = {"world_size": p, "backend": backend, "size_bytes": size, "dtype": "float32",
                   "iters": s.iters, "warmup": s.warmup}
            runs.append(Run(BENCH, cfg, allreduce_bench, processes=p, device=device, group=f"{BENCH} {p}",
                            together=True, skip=skip, timeout_s=s.timeout_s, options={"backend": backend},
                            label=f"{p} ranks, {size:,} B"))
    return runs


def plan_compute(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """The compute step at each per-device batch, smallest first (one group: after an out-of-memory the
    larger batches are not tried), on one GPU through the launcher, or in this process on a CPU."""
    s, device = settings, machine.device
    return [Run(COMPUTE, {"model": "resnet18", "width": s.width, "batch_size": b, "device_type": device,
                          "steps": s.compute_steps, "warmup": s.compute_warmup}, compute_step, device=device,
                group=COMPUTE, in_process=device != "cuda", timeout_s=s.timeout_s,
                options={"process_group": False}, label=f"batch {b}")
            for b in sorted(s.batch_sizes)]


#: The time budget's 30 s for the full benchmark on one rank count (8 B ... 1 GiB: the allocations,
#: checks and warm-ups of each size dominate its timed loops), per size.
BENCH_SIZE_S = 30.0 / len(message_sizes(8, GIB))


def cost(run: Run) -> float:
    """Seconds of one run on the budget's node, start-up excluded: a benchmark size
    :data:`BENCH_SIZE_S`; a compute-step run its steps at the fast path's FLOP rate
    (:func:`lab_utils.experiments.shared.estimates.fast_epoch_seconds`, fp32 as TF32)."""
    c = run.config
    if run.experiment == BENCH:
        return BENCH_SIZE_S
    images = (c["steps"] + c["warmup"]) * c["batch_size"] * (c["width"] / 64) ** 2
    return images * estimates.fast_epoch_seconds("tf32") / CIFAR10_TRAIN_SIZE


def doctor_settings(full: Settings) -> Settings:
    """The smallest full-profile configuration: the benchmark from 1 MiB to 256 MiB (NCCL's bandwidth
    regime, seconds on a node), 5 timed all-reduces each; two compute steps at the smallest batch."""
    return replace(full, min_bytes=MIB, max_bytes=256 * MIB, iters=5, warmup=2,
                   batch_sizes=(min(full.batch_sizes),), compute_steps=2, compute_warmup=1)


ALLREDUCE_BENCH_EXPERIMENT = Experiment(BENCH, "04", Settings, plan_bench, cost, doctor_settings,
                                        "all-reduce benchmark (nccl-tests columns) and its fit",
                                        also_in=("02",))   # 02 predicts T(N) from its fit
COMPUTE_STEP_EXPERIMENT = Experiment(COMPUTE, "04", Settings, plan_compute, cost, doctor_settings,
                                     "compute seconds per training step (the projection's input)")


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
    """The nominal one-direction bandwidth of the link a ring uses (``kind``:
    :func:`lab_utils.engine.hardware.classify_interconnect`); CPU processes, mixed topologies and unknown GPUs
    get no number."""
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


def _pcie_link(indices: list[int]) -> tuple[int | None, int | None]:
    """The PCIe generation and width (nvidia-smi's ``.max``) of the slowest link among the GPUs of
    nvidia-smi's ``indices`` (the ring is as fast as its slowest hop), or (None, None)."""
    out = hardware.nvidia_smi("--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                               "--format=csv,noheader,nounits")
    links = {}
    for line in (out or "").strip().splitlines():
        try:
            index, gen, width = (int(v) for v in line.split(","))
        except ValueError:  # "[N/A]" or a banner: not known
            continue
        links[index] = (gen, width)
    known = [links[i] for i in indices if i in links and links[i][0] in _PCIE_LANE_GB_PER_S]
    if not indices or len(known) < len(indices):
        return None, None
    return min(known, key=lambda gw: _PCIE_LANE_GB_PER_S[gw[0]] * gw[1])


def detect_link_peak(n_gpus: int | None = None) -> LinkPeak:
    """The nominal link peak between this process's first ``n_gpus`` GPUs (default: all it sees):
    NVLink table, or PCIe gen x width. nvidia-smi lists every GPU of the node; the rows read are
    those ``CUDA_VISIBLE_DEVICES`` maps this process's devices to (:func:`hardware.visible_gpu_indices`);
    a device it cannot map has no known link."""
    count = hardware.gpu_count() if n_gpus is None else n_gpus
    if count < 2:  # the benchmark then runs gloo between CPU processes (see plan_bench)
        return _nominal_link_peak("cpu", None)
    mapped = [i for i in (hardware.visible_gpu_indices() or [])[:count] if i is not None]
    kind = (hardware.classify_interconnect(hardware.interconnect(), count, mapped) if len(mapped) == count
            else None)
    gen, width = _pcie_link(mapped) if kind == "pcie" else (None, None)
    return _nominal_link_peak(hardware.device_name("cuda"), kind, gen, width)


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (ALLREDUCE_BENCH_EXPERIMENT, COMPUTE_STEP_EXPERIMENT)
