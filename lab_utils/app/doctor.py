"""``python -m lab_utils doctor``: the first session on a new GPU node, checked in minutes.

The tests run the lab's CUDA-only branches against a fake GPU (tests/fake_gpu.py); this command checks,
on the node, what only a real one can show: CUDA events agree with the host clock, an out-of-memory
error under a memory cap is caught and its memory given back, bf16 is native, NCCL moves data at the
links' speed, ``torch.compile`` works, and each notebook's own code runs: every experiment of
:mod:`lab_utils.experiments.registry` measures its smallest full-profile plan (``experiment.doctor``)
through :func:`lab_utils.engine.plan.measure` into a scratch store, and its records are judged (phases sum to
the step and the all-reduce fits in it; 0 <= exposed communication <= all-reduce is expected, a miss
beyond the noise a warning). It prints one table
(``| check | measured | expected | verdict |``) within ``--budget`` seconds (600), also written to
``results/<profile>/doctor.md`` and ``doctor.json``. A verdict is ``ok``, ``warn`` (works, but a number
to look at), ``fail`` (wrong numbers or a crash here: exit code 1) or ``skipped: <why>``.

Every check has a time limit. Those that touch CUDA run in a child process (``python -m
lab_utils.app.doctor --child NAME``) stopped at its limit with everything it started
(:func:`lab_utils.engine.proc.run`), so a hung driver, NCCL or compiler is a ``fail`` row; multi-GPU runs go
through the launcher, whose timeout stops the whole ``torchrun`` tree. The doctor's own process never
opens a CUDA context: it stands in for the notebook's kernel. Without a GPU it runs what applies
(versions, the timers' overhead), marks the rest ``skipped: no GPU`` and exits 0.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lab_utils.engine import config, cuda_builds, hardware, memory, plan, proc, profiles
from lab_utils.engine.environment import gpu_node_problem, software_stack
from lab_utils.engine.machine import Machine as PlanMachine
from lab_utils.engine.plan import Experiment, aggregates, make_plan
from lab_utils.engine.store import ResultStore, _atomic_write_text
from lab_utils.experiments import registry
from lab_utils.experiments.n04_allreduce import experiment as comm
from lab_utils.experiments.n08_speed_limits import fast_train
from lab_utils.experiments.shared import data
from lab_utils.learn import timing
from lab_utils.learn.errors import LabError, LaunchError, error_line, first_line
from lab_utils.learn.spread import NOISE_SIGMAS

DEFAULT_BUDGET_S = 600.0
NO_GPU = "skipped: no GPU"


# --------------------------------------------------------------------------- rows and the machine


@dataclass
class Row:
    """One line of the doctor's table."""

    check: str
    measured: str
    expected: str
    verdict: str                      # "ok" | "warn" | "fail" | "skipped: <why>"
    seconds: float = 0.0
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.verdict == "fail"


@dataclass
class Machine:
    """What the doctor knows before any check, read without opening a CUDA context."""

    gpus: int                          # torch.cuda.device_count() (NVML: no context)
    names: list[str | None]            # the visible devices' names, from nvidia-smi -L
    mig: list[str]                     # MIG profiles of the visible devices ("1g.5gb"), if any
    driver: str | None                 # NVIDIA driver version, or None
    problem: str | None                # the driver reports GPUs this torch cannot use (or has no kernels for)
    profile: str
    no_kernels: bool = False           # torch sees the GPUs but has no kernels for them: GPU checks not run
    compute_modes: list[str] = field(default_factory=list)   # nvidia-smi's, per GPU ("Exclusive_Process")

    @property
    def name(self) -> str | None:
        return next((n for n in self.names if n), None)


def read_machine(profile: str | None = None) -> Machine:
    """This machine's GPUs, driver and MIG slices, from NVML and ``nvidia-smi`` (no CUDA context)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = hardware.visible_gpu_names() or []
    driver = cuda_builds.query_driver()
    found = gpu_node_problem(driver)
    name = config.resolve_profile_name(profile)[0]
    return Machine(gpus=gpus, names=names[:gpus] if gpus else names,
                   mig=[p for n in names[:max(gpus, 1)] if (p := hardware.mig_profile(n))],
                   driver=driver.version if driver else None,
                   problem=f"{found[0]}; {found[1]}." if found else None, profile=name,
                   no_kernels=bool(found and gpus),
                   compute_modes=[g.compute_mode or "unknown" for g in (driver.gpus if driver else [])])


# --------------------------------------------------------------------------- the checks' measurements
# Each ``measure_*`` returns a dict of plain values (JSON): in a child process for CUDA work.
# Each ``judge_*`` turns it into (measured, expected, verdict) text, in the doctor's process.


def measure_versions(m: Machine) -> dict[str, Any]:
    return {"stack": software_stack(), "driver": m.driver, "problem": m.problem}


def judge_versions(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    stack = d["stack"]
    measured = (f"driver {d['driver'] or 'none'}, torch {torch.__version__}, CUDA {stack.get('torch CUDA')}, "
                f"cuDNN {stack.get('cuDNN')}, NCCL {stack.get('NCCL')}")
    expected = "a torch build whose CUDA this driver runs, with kernels for these GPUs"
    if d["problem"]:
        return f"{measured}; {d['problem']}", expected, "fail"
    return measured, expected, "ok"


def measure_mig(m: Machine) -> dict[str, Any]:
    return {"mig": m.mig, "names": m.names}


def judge_mig(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    expected = "whole GPUs (a MIG slice has no peak FLOP/s and no NCCL between slices)"
    if not d["mig"]:
        return f"no MIG slice among {len(d['names'])} GPU(s)", expected, "ok"
    return (f"MIG slice(s): {', '.join(d['mig'])}: no % of peak (MFU) in any table; multi-GPU runs "
            "need whole GPUs", expected, "warn")


#: What :func:`tiny_kernel` computes: 2 x (0 + 1 + ... + 7).
KERNEL_EXPECTED = 56.0


def tiny_kernel(index: int) -> float:
    """One elementwise kernel and one reduction on GPU ``index`` (a torch without kernels for this GPU
    fails here with "no kernel image is available"); their result, :data:`KERNEL_EXPECTED` if right."""
    x = torch.arange(8, dtype=torch.float32, device=torch.device("cuda", index))
    return float((x * 2).sum().item())


def measure_cuda_init(m: Machine, kernel: Callable[[int], float] = tiny_kernel) -> dict[str, Any]:
    """Initialize CUDA on every visible GPU: torch's names, capability and memory, and one kernel launched
    on each (``kernel(index)``, default :func:`tiny_kernel`), in a child process."""
    smi = hardware.visible_gpu_names() or []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        g = {"index": i, "torch_name": p.name, "smi_name": smi[i] if i < len(smi) else None,
             "capability": f"{p.major}.{p.minor}", "total_bytes": int(total), "free_bytes": int(free)}
        try:
            g["kernel_result"] = kernel(i)
        except Exception as e:  # "no kernel image is available": the row says so
            g["kernel_error"] = first_line(e, 160) or type(e).__name__
        out.append(g)
    return {"gpus": out}


def judge_cuda_init(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    gpus = d["gpus"]
    names = sorted({g["torch_name"] for g in gpus})
    free = min((g["free_bytes"] for g in gpus), default=0) / 2**30
    measured = (f"{len(gpus)} x {', '.join(names)} (sm {gpus[0]['capability']}), "
                f"{gpus[0]['total_bytes'] / 2**30:.0f} GiB, free {free:.1f} GiB" if gpus else "no device")
    expected = (f"{m.gpus} device(s); a kernel runs on each; names from nvidia-smi -L = torch's (the store's "
                "reuse check names GPUs without a CUDA context)")
    if len(gpus) != m.gpus or not gpus:
        return measured, expected, "fail"
    for g in gpus:
        if "kernel_error" in g:
            return f"{measured}; GPU {g['index']}: {g['kernel_error']}", expected, "fail"
        if g.get("kernel_result") != KERNEL_EXPECTED:
            return (f"{measured}; GPU {g['index']}: the kernel computed {g.get('kernel_result')}, not "
                    f"{KERNEL_EXPECTED}", expected, "fail")
    differ = [g for g in gpus if g["smi_name"] is not None and g["smi_name"] != g["torch_name"]]
    if differ:
        g = differ[0]
        return f"{measured}; GPU {g['index']}: nvidia-smi says {g['smi_name']!r}", expected, "fail"
    low = [g for g in gpus if g["free_bytes"] < 0.8 * g["total_bytes"]]
    if low:  # another process (or a stray context) holds memory on this GPU
        used = 1 - low[0]["free_bytes"] / low[0]["total_bytes"]
        return f"{measured}; GPU {low[0]['index']} already {used:.0%} used", expected, "warn"
    return measured + "; a kernel ran on each", expected, "ok"


def _matmul_workload(device: str, n: int = 2048, repeats: int = 20) -> tuple[Callable[[], None], float]:
    """A known workload: ``repeats`` fp32 matmuls of n x n (2 n^3 FLOPs each). Returns (run, FLOPs)."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)

    def run() -> None:
        for _ in range(repeats):
            torch.mm(a, b)

    return run, 2.0 * n ** 3 * repeats


def measure_clock(m: Machine, workload: Callable[[], None] | None = None, flops: float | None = None,
                  device: str = "cuda", repeats: int = 5,
                  clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """CUDA events vs the host clock (synchronized) around the same workload; seconds, medians.

    ``workload`` (default: fp32 matmuls with known FLOPs) runs once untimed, then ``repeats``
    times under each clock, alternating.
    """
    if workload is None:
        workload, flops = _matmul_workload(device)
    workload()
    timing.synchronize(device)
    events, host = [], []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        workload()
        end.record()
        end.synchronize()
        events.append(start.elapsed_time(end) / 1e3)  # ms -> s
        timing.synchronize(device)
        t0 = clock()
        workload()
        timing.synchronize(device)
        host.append(clock() - t0)
    name = hardware.device_name(device)
    # the matmuls' precision in this (the measuring) process: torch.mm takes TF32 only if allowed here
    return {"event_seconds": statistics.median(events), "host_seconds": statistics.median(host),
            "flops": flops, "device_name": name, "precision": hardware.fp32_matmul_precision(name)}


#: A clock that reads a rate this much above the device's dense peak missed work (5 %: the data sheets'
#: boost clock against a GPU that runs a little faster).
PEAK_SLACK = 1.05


def judge_clock(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    """Events against the host clock; with the workload's FLOPs, its rate against the device's peak for
    the precision the fp32 matmuls ran in (TF32 only where ``torch.backends.cuda.matmul.allow_tf32`` was
    set: :func:`lab_utils.engine.hardware.fp32_matmul_precision`): above it, the clock missed work."""
    ev, host = d["event_seconds"], d["host_seconds"]
    measured = f"events {ev * 1e3:.2f} ms, host clock {host * 1e3:.2f} ms"
    expected = "equal within 5 % + 0.5 ms"
    if d.get("flops"):
        rate = d["flops"] / ev if ev > 0 else math.inf
        name = d.get("device_name")
        precision = d.get("precision") or hardware.fp32_matmul_precision(name)
        measured += f" ({rate / 1e12:.1f} TFLOP/s {precision})"
        peak = hardware.peak_flops_per_s(name, precision)
        if peak:
            expected += f"; at most the {precision} peak, {peak / 1e12:g} TFLOP/s"
        if peak and rate > PEAK_SLACK * peak:  # faster than the hardware
            return (measured + f" > the {precision} peak {peak / 1e12:g} TFLOP/s: the clock missed work",
                    expected, "fail")
    if ev <= 0 or abs(ev - host) > 0.05 * host + 5e-4:
        return measured, expected, "fail"
    return measured, expected, "ok"


def measure_timer_overhead(m: Machine, device: str | None = None, phases: int = 2000,
                           clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Seconds one empty :class:`~lab_utils.learn.timing.PhaseTimer` phase costs (its two
    device synchronizations and clock reads), on an idle device."""
    device = device or ("cuda" if m.gpus else "cpu")
    timer = timing.PhaseTimer(device)
    timing.synchronize(device)
    t0 = clock()
    for _ in range(phases):
        with timer.phase("compute"):
            pass
    total = clock() - t0
    return {"per_phase_seconds": total / phases, "phases": phases, "device": str(device),
            "timed_phases": timer.stats["compute"].count}


def judge_timer_overhead(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    us = d["per_phase_seconds"] * 1e6
    limit = 100.0 if d["device"].startswith("cuda") else 50.0
    measured = f"{us:.1f} us per timed phase on {d['device']}"
    expected = f"< {limit:.0f} us a phase (< {limit / 100:.1f} % of a 10 ms step)"
    if d["timed_phases"] != d["phases"]:
        return measured, expected, "fail"
    return measured, expected, "ok" if us < limit else "warn"


def measure_oom(m: Machine, device: str = "cuda", fraction: float = 0.05,
                allocate: Callable[[int], Any] | None = None) -> dict[str, Any]:
    """Cap the caching allocator at ``fraction`` of the GPU, allocate twice that: the lab's OOM path
    (:func:`~lab_utils.engine.memory.catch_oom`) must turn it into a reason, and
    :func:`~lab_utils.engine.memory.free_device_memory` must give the memory back. Bytes."""
    dev = memory.resolve_cuda_device(device)
    if allocate is None:
        def allocate(nbytes: int) -> Any:
            return torch.empty(nbytes, dtype=torch.uint8, device=dev)
    total = torch.cuda.get_device_properties(dev).total_memory
    base_alloc = torch.cuda.memory_allocated(dev)
    capped = memory.set_memory_fraction(fraction, dev)[1]
    try:
        keep = allocate(int(total * fraction / 4))      # fits under the cap
        with memory.catch_oom() as oom:
            big = allocate(int(total * fraction * 2))   # does not
            del big
        held = torch.cuda.memory_allocated(dev)
        del keep
        memory.free_device_memory(dev)
        after_alloc = torch.cuda.memory_allocated(dev)
        after_reserved = torch.cuda.memory_reserved(dev)
    finally:
        memory.set_memory_fraction(1.0, capped)
    return {"oom": bool(oom), "reason": oom.reason, "total_bytes": int(total), "fraction": fraction,
            "base_allocated_bytes": int(base_alloc), "held_after_oom_bytes": int(held),
            "allocated_after_free_bytes": int(after_alloc), "reserved_after_free_bytes": int(after_reserved)}


def judge_oom(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    expected = "an 'oom' row with the allocator's reason; memory back to where it was"
    if not d["oom"]:
        what = f"allocating {2 * d['fraction']:.0%} of the GPU under a {d['fraction']:.0%} cap did not fail"
        return what, expected, "fail"
    leaked = d["allocated_after_free_bytes"] - d["base_allocated_bytes"]
    slack = 2 * 2 ** 20
    measured = (f"oom: {d['reason'][:60]}...; after free: {d['allocated_after_free_bytes'] / 2**20:.1f} MiB "
                f"allocated, {d['reserved_after_free_bytes'] / 2**20:.1f} MiB reserved")
    if leaked > slack or d["reserved_after_free_bytes"] > d["base_allocated_bytes"] + slack:
        return measured, expected, "fail"
    return measured, expected, "ok"


def measure_bf16(m: Machine, device: str = "cuda", math_device: str | None = None) -> dict[str, Any]:
    """Whether bf16 is native here (not emulated), and a bf16 matmul's error against fp32."""
    native = hardware.bf16_supported(device)
    out: dict[str, Any] = {"native": native, "device_name": hardware.device_name(device)}
    if not native:
        cap = torch.cuda.get_device_capability(torch.device(device))
        out["capability"] = f"{cap[0]}.{cap[1]}"
        return out
    dev = math_device or device
    g = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(256, 256, generator=g).to(dev) for _ in range(2))
    ref = a @ b
    got = (a.bfloat16() @ b.bfloat16()).float()
    out["relative_error"] = float((got - ref).norm() / ref.norm())
    return out


def judge_bf16(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    expected = "native bf16 (sm 8.0+), bf16 matmul within 1 % of fp32; else its rows are skipped"
    if not d["native"]:
        return (f"{d['device_name']}: no native bf16 (sm {d.get('capability')}): the bf16 rows say so",
                expected, "skipped: no native bf16 on this GPU")
    err = d["relative_error"]
    return f"native; bf16 matmul relative error {err:.2e}", expected, "ok" if err < 1e-2 else "fail"


def measure_int8_mm(m: Machine, device: str = "cuda") -> dict[str, Any]:
    """``torch._int_mm`` (cuBLAS int8) at 17 rows against an int32 matmul; whether 8 rows are refused.
    Where cuBLASLt has no int8 kernel for this GPU (``CUBLAS_STATUS_NOT_SUPPORTED``, reported on sm_70)
    the 17-row call raises: ``unavailable`` says why, as notebook 07's probe does
    (:func:`lab_utils.experiments.n07_quantization.quant_variants.int_mm_probe`), and its rows then say
    what ran instead."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randint(-100, 100, (17, 64), dtype=torch.int8, generator=g)
    b = torch.randint(-100, 100, (64, 64), dtype=torch.int8, generator=g)
    dev = torch.device(device)
    sm = "sm_{}{}".format(*torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else dev.type
    try:
        got = torch._int_mm(a.to(device), b.to(device)).cpu()
    except RuntimeError as e:
        return {"exact": None, "eight_rows": None, "sm": sm, "unavailable": first_line(e, 160)}
    exact = bool(torch.equal(got, a.int() @ b.int()))
    try:
        torch._int_mm(a[:8].to(device), b.to(device))
        small = "accepted"
    except RuntimeError as e:
        small = first_line(e, 120)
    return {"exact": exact, "eight_rows": small, "sm": sm}


def judge_int8_mm(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    expected = "int8 x int8 -> int32 exact at 17 rows (notebook 07 pads smaller matmuls to 17)"
    if d.get("unavailable"):   # notebook 07's int8 rows say so and what ran instead
        return (f"17 rows: {d['unavailable']}", expected,
                f"skipped: cuBLAS int8 unavailable on {d.get('sm') or 'this GPU'}")
    measured = f"17 rows: {'exact' if d['exact'] else 'WRONG'}; 8 rows: {d['eight_rows']}"
    return measured, expected, "ok" if d["exact"] else "fail"


# --------------------------------------------------------------------------- NCCL


def measure_nccl(m: Machine, timeout_s: float = 240.0, backend: str | None = None,
                 max_bytes: int = 256 * 2 ** 20) -> dict[str, Any]:
    """All-reduce on every GPU: the run on the most ranks of notebook 04's benchmark plan (its doctor
    settings, 1 MiB to ``max_bytes``) measured through :func:`lab_utils.engine.plan.measure`; the best size's
    busbw (GB/s, nccl-tests' definition) against the link's nominal peak. ``backend`` replaces the
    planned one (tests: gloo standing in for NCCL), which is kept in ``planned_backend``."""
    machine = _plan_machine(m)
    full = profiles.settings(comm.Settings, "full")
    settings = replace(comm.doctor_settings(full), max_bytes=max_bytes, timeout_s=timeout_s)
    runs = [r for r in comm.plan_bench(settings, machine, "full") if r.skip is None]
    most = max(r.processes for r in runs)
    runs = [r for r in runs if r.processes == most]
    planned = runs[0].config["backend"]
    if backend:
        runs = [replace(r, config={**r.config, "backend": backend}, options={**r.options, "backend": backend},
                        device="cuda" if backend == "nccl" else "cpu") for r in runs]
    with _scratch_lab() as lab:
        records = plan.measure(lab, comm.ALLREDUCE_BENCH_EXPERIMENT, settings, force=True, verbose=False,
                               machine=machine, runs=runs)
    best = max(records, key=lambda r: r.metrics["busbw_gb_per_s"])
    link = comm.detect_link_peak(m.gpus)
    return {"planned_backend": planned, "backend": backend or planned, "ranks": most,
            "busbw_gb_per_s": best.metrics["busbw_gb_per_s"], "size_bytes": best.config["size_bytes"],
            "correct": all(r.metrics["correct"] for r in records), "link_gb_per_s": link.gb_per_s,
            "link": link.description, "link_kind": link.kind}


#: busbw as a share of the link's nominal per-direction peak below which a link is suspect: NVLink
#: rings reach well over half of it; NCCL over PCIe (through a switch or the host bridge) less.
NCCL_EXPECTED_SHARE = {"nvlink": 0.40, "pcie": 0.25}
#: busbw above this many times the link's nominal per-direction peak: the clock stopped before NCCL's
#: asynchronous work ended. A ring cannot beat the link; NVLink SHARP (NVLS) on NVSwitch nodes reduces
#: in the switch and can pass 1x, hence 2x.
NCCL_CEILING = 2.0


def judge_nccl(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    """busbw against the link: >= 40 % of NVLink's nominal peak, >= 25 % of PCIe's (warn below, fail
    below a quarter of that), and at most :data:`NCCL_CEILING` x it (above: "the clock missed work",
    fail); a link without a nominal peak (mixed, unknown) cannot be judged: warn, saying there is no
    expectation. Wrong sums always fail."""
    busbw, link = d["busbw_gb_per_s"], d["link_gb_per_s"]
    measured = (f"busbw {busbw:.1f} GB/s at {d['size_bytes'] / 2**20:.0f} MiB, {d['ranks']} x "
                f"{d['backend']}" + (f" = {busbw / link:.0%} of the link" if link else ""))
    share = NCCL_EXPECTED_SHARE.get(d.get("link_kind") or "nvlink")
    if not d["correct"]:
        return measured + "; WRONG sums", f">= {share or 0.4:.0%} of {d['link']}", "fail"
    if not link or share is None:
        return (f"{measured}; no expectation: no nominal peak for this link", f"none: {d['link']}", "warn")
    expected = f">= {share * 100:.0f} % and <= {NCCL_CEILING:g}x of {d['link']}"
    got = busbw / link
    if got > NCCL_CEILING:
        return (f"{measured}: above {NCCL_CEILING:g}x the link's nominal peak, the clock missed work",
                expected, "fail")
    return measured, expected, "ok" if got >= share else ("warn" if got >= share / 4 else "fail")


def _plan_machine(m: Machine) -> PlanMachine:
    """The machine the plans are made for: this one, with the doctor's GPU count and name."""
    here = PlanMachine.here()
    return replace(here, gpus=m.gpus, gpu_name=m.name or here.gpu_name)


@contextlib.contextmanager
def _scratch_lab() -> Iterator[SimpleNamespace]:
    """A full-profile session whose store is a temporary folder: nothing reaches the lab's results."""
    with tempfile.TemporaryDirectory(prefix="lab_doctor_store_") as tmp:
        yield SimpleNamespace(profile=config.PROFILES["full"], store=ResultStore("full", root=Path(tmp)))


def measure_compile(m: Machine, device: str = "cuda") -> dict[str, Any]:
    """One ``torch.compile`` warm-up (Inductor/Triton) and a compiled step of the fast path."""
    dev = torch.device(device)
    trainer = fast_train.build_trainer(fast_train.TrainOptions(loader="device", compile=True), 8, dev)
    split = data.load_split(True, 256, "synthetic")
    loader = data.device_loader(split, dev, 128, seed=0)
    warm = fast_train.warm_up(trainer, loader, 1)
    before = fast_train.compiled_graphs()
    ep = trainer.epoch(loader)
    after = fast_train.compiled_graphs()
    return {"compile_seconds": warm, "loss": ep.loss,
            "graphs_in_timed_epoch": None if before is None or after is None else after - before}


def judge_compile(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    measured = f"compiled in {d['compile_seconds']:.0f} s; loss {d['loss']:.3f}"
    expected = "compiles; no recompilation inside the timed epoch; finite loss"
    ok = math.isfinite(d["loss"]) and d["graphs_in_timed_epoch"] in (0, None)
    return measured, expected, "ok" if ok else "fail"


#: How far a step's timings may stray from their invariants (fraction of the step, plus seconds):
#: timer reads and the probe's pairs are noisy, a timer on the wrong stream or device is not.
TIMING_TOLERANCE = (0.05, 1e-3)


def _num(d: dict[str, Any], key: str) -> float | None:
    v = d.get(key)
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else None


def _tolerance(d: dict[str, Any]) -> float:
    return TIMING_TOLERANCE[0] * (_num(d, "train_seconds") or 0.0) + TIMING_TOLERANCE[1]


def timing_violations(d: dict[str, Any]) -> list[str]:
    """The invariants a step's timing must keep, each broken one as a phrase (seconds, per epoch):
    data movement + compute + communication = training time; all-reduce time (c) <= training time.
    Missing figures are not checked."""
    t, tol = _num(d, "train_seconds"), _tolerance(d)
    out = []
    phases = [_num(d, k) for k in ("data_movement_seconds", "compute_seconds", "communication_seconds")]
    if t is not None and None not in phases and abs(sum(phases) - t) > tol:
        out.append(f"phases sum to {sum(phases):.4f} s, the training time is {t:.4f} s")
    c = _num(d, "allreduce_seconds")
    if c is not None and t is not None and c > t + tol:
        out.append(f"all-reduce time {c:.4f} s > training time {t:.4f} s")
    return out


def timing_expectations(d: dict[str, Any]) -> list[str]:
    """What a step's communication figures are expected to keep, each one missed beyond the noise as a
    phrase: 0 <= exposed communication (b) <= all-reduce time (c). An expectation, not a law: (b) also
    holds the bucket copies and synchronization that (c) does not, so with one bucket, or with NCCL
    slowing the compute kernels, (b) > (c) happens; over gloo the all-reduce thread takes turns with
    backward on the same cores (Table 2 says so), so (b) <= (c) is not expected there. The noise: the
    timers' tolerance, or :data:`~lab_utils.learn.spread.NOISE_SIGMAS` standard errors of (b)
    (``exposed_comm_noise_seconds``), whichever is larger."""
    b, c = _num(d, "exposed_comm_seconds"), _num(d, "allreduce_seconds")
    noise = max(_tolerance(d), NOISE_SIGMAS * (_num(d, "exposed_comm_noise_seconds") or 0.0))
    out = []
    if b is not None and b < -noise:
        out.append(f"exposed communication {b:.4f} s < 0 beyond the noise ({noise:.4f} s)")
    if b is not None and c is not None and b > c + noise and d.get("backend") != "gloo":
        out.append(f"exposed communication {b:.4f} s > all-reduce time {c:.4f} s beyond the noise "
                   f"({noise:.4f} s)")
    return out


#: What an experiment's row expects (shown when it is skipped).
EXPERIMENT_EXPECTED = ("the notebook's own plan at its smallest full-profile settings runs, each run's "
                       "timing keeps its invariants (0 <= exposed <= all-reduce expected: a warning "
                       "beyond the noise); no CUDA context in this process (the notebook's kernel)")
#: The keys of an aggregate record's metrics that the judge reads (timing invariants, loss, backend).
_JUDGED = ("train_seconds", "data_movement_seconds", "compute_seconds", "communication_seconds",
           "exposed_comm_seconds", "exposed_comm_noise_seconds", "allreduce_seconds", "backend",
           "train_loss", "loss", "test_loss")


def measure_experiment(experiment: Experiment, m: Machine, timeout_s: float = 240.0,
                       machine: PlanMachine | None = None) -> dict[str, Any]:
    """The notebook's own code: ``experiment.doctor(full settings)`` measured through
    :func:`lab_utils.engine.plan.measure` as the notebook does, into a scratch store, one launch group after
    another within ``timeout_s`` seconds; each aggregate record's status, reason and timing figures
    (seconds). This process stands in for the notebook's kernel: whether it had opened a CUDA context
    before the launches is recorded (on an EXCLUSIVE_PROCESS node that stops them)."""
    machine = machine or _plan_machine(m)
    settings = experiment.doctor(profiles.settings(experiment.settings, "full"))
    runs = make_plan(experiment, settings, machine, "full")
    deadline = time.monotonic() + timeout_s
    context = _cuda_initialized()
    out: list[dict[str, Any]] = []
    with _scratch_lab() as lab:
        for members in ([runs[i] for i in group] for group in plan.groups(runs)):
            left = deadline - time.monotonic()
            if left < 5:
                out += [{"label": r.name, "status": "skipped", "reason": "not run: the check's time limit"}
                        for r in members]
                continue
            bounded = [replace(r, timeout_s=min(r.timeout_s, left)) for r in members]
            try:
                got = plan.measure(lab, experiment, settings, force=True, verbose=False, machine=machine,
                                   runs=bounded)
            except LaunchError as e:
                out += [{"label": r.name, "status": "error", "reason": first_line(e)} for r in members]
                continue
            by_key = {rec.key: rec for rec in aggregates(got)}
            for r in members:
                rec = by_key.get(r.key)
                metrics = rec.metrics if rec is not None else {}
                out.append({"label": r.name, "status": rec.status if rec else "error",
                            "reason": rec.reason if rec else "no record",
                            **{k: metrics.get(k) for k in _JUDGED if k in metrics}})
    return {"experiment": experiment.name, "notebook": experiment.notebook, "kernel_context": context,
            "compute_modes": list(m.compute_modes), "runs": out}


def _cuda_initialized() -> bool:
    return bool(torch.cuda.is_initialized())


def judge_experiment(d: dict[str, Any], m: Machine) -> tuple[str, str, str]:
    """Every run that could run here ran ("ok"), with finite losses and its timing invariants
    (:func:`timing_violations`; a missed expectation, :func:`timing_expectations`, is a warning);
    runs that need more GPUs are rows that say so, not failures."""
    ran, skipped, broken, missed = [], [], [], []
    for r in d["runs"]:
        if r["status"] == "ok":
            problems = timing_violations(r) + [f"{k} not finite" for k in ("train_loss", "loss", "test_loss")
                                               if isinstance(r.get(k), float) and not math.isfinite(r[k])]
            seconds = r.get("train_seconds")
            ran.append(f"{r['label']}" + (f" {seconds:.2f} s" if isinstance(seconds, int | float) else ""))
            broken += [f"{r['label']}: {p}" for p in problems]
            missed += [f"{r['label']}: {p}" for p in timing_expectations(r)]
        elif r["status"] == "skipped" and not str(r.get("reason", "")).startswith("not run"):
            skipped.append(f"{r['label']} ({r['reason']})")
        else:
            broken.append(f"{r['label']}: {r['status']}: {r.get('reason')}")
    modes = sorted(set(d.get("compute_modes") or []))
    parts = [f"ran {', '.join(ran) or 'nothing'}"] + ([f"skipped {', '.join(skipped)}"] if skipped else [])
    if modes and modes != ["Default"]:
        parts.append(f"compute mode {', '.join(modes)}")
    verdict = "ok" if ran and not broken else "fail"
    if d.get("kernel_context"):
        parts.append("CUDA was initialised in this process (the notebook's kernel) before the launches")
        verdict = "fail"
    if broken:
        parts.append("FAILED " + "; ".join(broken))
    if missed:
        parts.append("NOT AS EXPECTED " + "; ".join(missed))
        verdict = "warn" if verdict == "ok" else verdict
    return "; ".join(parts), EXPERIMENT_EXPECTED, verdict


@dataclass(frozen=True)
class Check:
    """One row of the doctor: where it runs, its time limit, how it measures and judges."""

    name: str
    measure: Callable[..., dict[str, Any]]
    judge: Callable[[dict[str, Any], Machine], tuple[str, str, str]]
    expected: str                  # shown when skipped
    # "here" (no CUDA: this process), "child" (CUDA: a subprocess), "launch" (torchrun through the
    # launcher), "auto" (a child with GPUs, here without)
    where: str = "child"
    gpus: int = 1                  # GPUs it needs (0: runs anywhere)
    timeout_s: float = 120.0
    no_mig: bool = False           # cannot run on MIG slices


CHECKS: tuple[Check, ...] = (
    Check("versions", measure_versions, judge_versions, "driver, torch, CUDA, cuDNN, NCCL", "here", 0, 60),
    Check("mig", measure_mig, judge_mig, "whole GPUs", "here", 1, 60),
    Check("cuda_init", measure_cuda_init, judge_cuda_init, "each GPU starts, names agree", timeout_s=90),
    Check("event_vs_host_clock", measure_clock, judge_clock, "equal within 5 % + 0.5 ms", timeout_s=90),
    Check("timer_overhead", measure_timer_overhead, judge_timer_overhead, "< 100 us a phase", "auto", 0, 60),
    Check("oom_under_memory_fraction", measure_oom, judge_oom, "an 'oom' row, memory freed", timeout_s=90),
    Check("bf16", measure_bf16, judge_bf16, "native bf16, or its rows skipped", timeout_s=90),
    Check("int8_matmul", measure_int8_mm, judge_int8_mm, "cuBLAS int8 exact at 17 rows", timeout_s=90),
    Check("nccl_allreduce", measure_nccl, judge_nccl, "busbw >= 40 % and <= 2x of the link's nominal peak",
          "launch", 2, 240, no_mig=True),
    # each registered experiment's row, NN_name: its plan measured in this process (the launcher starts
    # its GPU work)
    *(Check(f"{e.notebook}_{e.name}", functools.partial(measure_experiment, e), judge_experiment,
            EXPERIMENT_EXPECTED, "launch", 1, 240.0)
      for e in sorted(registry.EXPERIMENTS, key=lambda e: e.notebook)),
    # last: a first Inductor/Triton compilation can take minutes; it must not crowd out the steps above
    Check("torch_compile", measure_compile, judge_compile, "compiles and steps", timeout_s=360),
)
BY_NAME = {c.name: c for c in CHECKS}


def skip_reason(check: Check, m: Machine) -> str | None:
    """``skipped: <why>`` when ``check`` cannot run on ``m``, else None."""
    if check.gpus and m.gpus == 0:
        return NO_GPU
    if check.gpus and m.no_kernels and check.where != "here":
        return "skipped: this torch has no kernels for this GPU (see versions)"
    if check.gpus > m.gpus:
        return f"skipped: needs {check.gpus} GPUs (this machine has {m.gpus})"
    if check.no_mig and m.mig:
        return "skipped: MIG slices (NCCL and DataParallel need whole GPUs)"
    return None


# --------------------------------------------------------------------------- running them


def run_child(cmd: list[str], timeout_s: float, out_file: Path, what: str = "") -> dict[str, Any]:
    """Run ``cmd`` (it writes JSON to ``out_file``) through :func:`lab_utils.engine.proc.run` (at
    ``timeout_s`` it and all it started are stopped: :class:`lab_utils.engine.proc.TimeLimit`); a failed
    child raises ``RuntimeError`` with its last error line."""
    res = proc.run(cmd, timeout_s, text=True, what=what or "the check")
    if res.returncode != 0 or not out_file.exists():
        lines = [ln for ln in (res.stderr or "").strip().splitlines() if ln.strip()]
        raise RuntimeError(lines[-1][:200] if lines else f"exit code {res.returncode}")
    return json.loads(out_file.read_text())


def _measure(check: Check, m: Machine, timeout_s: float) -> dict[str, Any]:
    if check.where == "here" or (check.where == "auto" and m.gpus == 0):
        return check.measure(m)
    if check.where == "launch":  # launcher.launch bounds the torchrun tree by timeout_s
        return check.measure(m, timeout_s=timeout_s)
    with tempfile.TemporaryDirectory(prefix="lab_doctor_") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, "-m", "lab_utils.app.doctor", "--child", check.name, "--out", str(out),
               "--profile", m.profile]
        return run_child(cmd, timeout_s, out, what=f"the {check.name} check")


def run_checks(m: Machine, checks: tuple[Check, ...] = CHECKS, budget_s: float = DEFAULT_BUDGET_S,
               measure: Callable[[Check, Machine, float], dict[str, Any]] = _measure,
               echo: Callable[[Row], None] | None = None) -> list[Row]:
    """Run ``checks`` on ``m`` in order within ``budget_s`` seconds; one :class:`Row` each."""
    deadline = time.monotonic() + budget_s
    rows = []
    for c in checks:
        why = skip_reason(c, m)
        left = deadline - time.monotonic()
        if why is None and left < 5:
            why = f"skipped: the doctor's time budget ({budget_s:.0f} s) is used up"
        t0 = time.monotonic()
        if why is not None:
            row = Row(c.name, "", c.expected, why)
        else:
            limit = min(c.timeout_s, left)
            budget = (f"skipped: the doctor's time budget ({budget_s:.0f} s) cut it short after "
                      f"{limit:.0f} s (its own limit is {c.timeout_s:.0f} s)")
            cut = limit < c.timeout_s   # a time-out now is the budget's, not the check's
            try:
                data = measure(c, m, limit)
                measured, expected, verdict = c.judge(data, m)
                row = Row(c.name, measured, expected, verdict, details=data)
            except proc.TimeLimit as e:
                row = Row(c.name, str(e), c.expected, budget if cut else "fail")
            except LaunchError as e:
                first = first_line(e)
                timed_out = "did not finish within" in first
                row = Row(c.name, f"launch failed: {first}", c.expected,
                          budget if cut and timed_out else "fail", details={"error": str(e)})
            except Exception as e:  # a broken check is a failed check, never a traceback
                row = Row(c.name, error_line(e), c.expected, "fail")
        row.seconds = time.monotonic() - t0
        rows.append(row)
        if echo is not None:
            echo(row)
    return rows


# --------------------------------------------------------------------------- output


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table: check, measured, expected, verdict, seconds."""
    def cell(text: str) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    lines = ["| check | measured | expected | verdict | seconds |", "|---|---|---|---|---:|"]
    for r in rows:
        lines.append(f"| {' | '.join(cell(x) for x in (r.check, r.measured, r.expected, r.verdict))} "
                     f"| {r.seconds:.1f} |")
    return "\n".join(lines)


def summary(rows: list[Row], seconds: float) -> str:
    failed = [r.check for r in rows if r.failed]
    return f"{len(rows)} checks in {seconds:.0f} s; " + (f"FAILED: {', '.join(failed)}" if failed
                                                          else "no check failed")


def write_report(rows: list[Row], m: Machine, seconds: float, root: Path) -> tuple[Path, Path]:
    """``doctor.md`` and ``doctor.json`` under ``root`` (``results/<profile>/``), each written atomically."""
    root.mkdir(parents=True, exist_ok=True)
    head = (f"# lab doctor: {m.gpus} GPU(s){' x ' + m.name if m.name else ''}, driver {m.driver or 'none'}, "
            f"profile {m.profile}\n\n{summary(rows, seconds)}\n\n")
    md, js = root / "doctor.md", root / "doctor.json"
    _atomic_write_text(md, head + table(rows) + "\n")
    payload = {"machine": asdict(m), "software": hardware.software_versions(), "seconds": seconds,
               "failed": [r.check for r in rows if r.failed], "rows": [asdict(r) for r in rows]}
    _atomic_write_text(js, json.dumps(payload, indent=2, default=str) + "\n")
    return md, js


def main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils doctor [--profile P] [--budget S] [--only NAMES]``; 1 if a check failed."""
    p = argparse.ArgumentParser(prog="python -m lab_utils doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", default=None, help="the report goes to results/<profile>/ (default: auto)")
    p.add_argument("--budget", type=float, default=DEFAULT_BUDGET_S, help="seconds for all checks (600)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(BY_NAME)}")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)   # one check, in a child process
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", default=None, help=argparse.SUPPRESS)  # a notebook step on another device
    a = p.parse_args(argv)
    if a.child:
        return _child(a.child, a.out, a.profile, a.device)
    checks = CHECKS
    if a.only:
        names = [n.strip() for n in a.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise LabError(f"Unknown doctor check(s) {unknown}; choose from: {', '.join(BY_NAME)}.")
        checks = tuple(BY_NAME[n] for n in names)
    if not a.budget > 0:
        raise LabError(f"--budget must be a positive number of seconds, got {a.budget!r}.")
    t0 = time.monotonic()
    m = read_machine(a.profile)
    print(f"lab doctor: {m.gpus} GPU(s){' (' + m.name + ')' if m.name else ''}, driver {m.driver or 'none'}, "
          f"{len(checks)} checks within {a.budget:.0f} s", flush=True)
    if m.problem:  # the versions row fails with it; said first, in one sentence
        print(f"error: {m.problem}", flush=True)

    def echo(row: Row) -> None:
        print(f"  {row.check:<30} {row.verdict:<8} {row.measured}"[:160], flush=True)

    rows = run_checks(m, checks, a.budget, echo=echo)
    seconds = time.monotonic() - t0
    md, js = write_report(rows, m, seconds, config.results_dir(m.profile))
    print(f"\n{table(rows)}\n\n{summary(rows, seconds)}. Report: {md} and {js.name}")
    return 1 if any(r.failed for r in rows) else 0


def _child(name: str, out: str | None, profile: str | None, device: str | None) -> int:
    """Run one check's measurement here and write its JSON to ``out``."""
    check = BY_NAME.get(name)
    if check is None or out is None:
        print(f"error: unknown doctor check {name!r} or no --out", file=sys.stderr)
        return 2
    m = read_machine(profile)
    Path(out).write_text(json.dumps(check.measure(m, **({"device": device} if device else {})), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
