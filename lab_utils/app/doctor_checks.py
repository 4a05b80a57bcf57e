"""The doctor's checks of the node itself (:mod:`lab_utils.app.doctor` runs them): what it knows before
any check (:class:`Machine`, read without opening a CUDA context), then for each check a ``measure_*``
(plain values, in a child process for CUDA work) and a ``judge_*`` (measured, expected, verdict):
versions, MIG, CUDA's first kernel, the clock, the timers' overhead, out of memory, bf16, int8
matmuls, NCCL's bandwidth, ``torch.compile``."""

from __future__ import annotations

import contextlib
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from lab_utils.engine import config, cuda_builds, hardware, memory, plan, profiles
from lab_utils.engine.environment import gpu_node_problem, software_stack
from lab_utils.engine.machine import Machine as PlanMachine
from lab_utils.engine.store import ResultStore
from lab_utils.experiments.n04_allreduce import experiment as comm
from lab_utils.experiments.n08_speed_limits import fast_train
from lab_utils.experiments.shared import data
from lab_utils.learn import timing
from lab_utils.learn.errors import first_line


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
    machine = plan_machine(m)
    full = profiles.settings(comm.Settings, "full")
    settings = replace(comm.doctor_settings(full), max_bytes=max_bytes, timeout_s=timeout_s)
    runs = [r for r in comm.plan_bench(settings, machine, "full") if r.skip is None]
    most = max(r.processes for r in runs)
    runs = [r for r in runs if r.processes == most]
    planned = runs[0].config["backend"]
    if backend:
        runs = [replace(r, config={**r.config, "backend": backend}, options={**r.options, "backend": backend},
                        device="cuda" if backend == "nccl" else "cpu") for r in runs]
    with scratch_lab() as lab:
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


def plan_machine(m: Machine) -> PlanMachine:
    """The machine the plans are made for: this one, with the doctor's GPU count and name."""
    here = PlanMachine.here()
    return replace(here, gpus=m.gpus, gpu_name=m.name or here.gpu_name)


@contextlib.contextmanager
def scratch_lab() -> Iterator[SimpleNamespace]:
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
