"""Issue 49: numbers that came out wrong on a GPU while every CPU test passed, each defect run here.

Every test here failed on the code before its fix (e53e80e) and passes after it; the fake GPU
(tests/fake_gpu.py) stands in for the device: NCCL's own stream for the collectives, a first-call cost
per (shape, dtype, layout), exclusive-process mode, ``CUDA_VISIBLE_DEVICES`` and an nvidia-smi that
answers only what the lab asks. The doctor's verdicts are run for an A100, an H100 and a V100 PCIe.
"""

from __future__ import annotations

import datetime
import json
import re
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fake_gpu import FakeGPU, topo_matrix

from lab_utils.app import doctor, doctor_checks, doctor_experiments
from lab_utils.engine import dist as labdist
from lab_utils.engine import launcher, memory, plan
from lab_utils.engine.records import Record
from lab_utils.learn import timing
from lab_utils.learn.errors import LaunchError

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
V100_PCIE = "Tesla V100-PCIE-32GB"
# (name, compute capability major, fp32 peak TFLOP/s, tf32 peak or None, fake topology, PCIe link)
GPUS = {
    "A100": (A100, 8, 19.5, 156.0, None, (4, 16)),
    "H100": (H100, 9, 67.0, 495.0, None, (5, 16)),
    "V100 PCIe": (V100_PCIE, 7, 14.0, None, topo_matrix(2, "PIX"), (3, 16)),
}


def machine(name: str, gpus: int = 2) -> doctor_checks.Machine:
    return doctor_checks.Machine(gpus=gpus, names=[name] * gpus, mig=[], driver="550.127.05", problem=None,
                          profile="full")


# --------------------------------------------------------------------------- 1. int8 on a V100


def test_the_doctor_skips_int8_where_cublas_has_none_instead_of_failing(fake_gpu, monkeypatch):
    """cuBLASLt int8 on sm_70 raises CUBLAS_STATUS_NOT_SUPPORTED: notebook 07 says so in its rows; the
    doctor's int8 row did not catch it and failed `make doctor` on a V100."""
    gpu = fake_gpu(count=1, name=V100_PCIE, major=7).tensors_on_device(monkeypatch)

    def no_int8(a, b):
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasLtMatmul(ltHandle, "
                           "computeDesc.descriptor(), &alpha_val, mat1_ptr, Adesc.descriptor(), ...)`")

    m = doctor_checks.read_machine("full")
    [row] = doctor.run_checks(m, (doctor.BY_NAME["int8_matmul"],), measure=lambda c, m, limit: c.measure(m))
    assert row.verdict == "ok" and row.measured.startswith("17 rows: exact")   # the CPU's _int_mm here
    monkeypatch.setattr(torch, "_int_mm", no_int8)
    [row] = doctor.run_checks(m, (doctor.BY_NAME["int8_matmul"],), measure=lambda c, m, limit: c.measure(m))
    assert row.verdict == "skipped: cuBLAS int8 unavailable on sm_70", (row.verdict, row.measured)
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in row.measured and not row.failed
    assert gpu.initialized


# --------------------------------------------------------------------------- 2. serve's own errors under NCCL


def test_an_error_in_serve_itself_ends_an_nccl_rank_without_tearing_the_group_down(monkeypatch, tmp_path):
    """Rank 0's append to the records file fails (a full disk) while rank 1 waits in a collective:
    under NCCL destroy_process_group() would block until the run's time limit. The error goes through
    the same fast exit as a configuration's: the failure file, one line, os._exit."""
    from lab_utils.engine import harness

    events = []

    class Ended(BaseException):   # os._exit: nothing after it runs (here: the finally blocks would)
        pass

    def end_rank(message, code=1):
        events.append(("end", message))
        raise Ended

    def full_disk(out, records):
        raise OSError(28, "No space left on device")

    ctx = labdist.DistContext(rank=0, world_size=2, backend="nccl", device=torch.device("cuda", 0))
    monkeypatch.setattr(harness, "init_distributed", lambda *a, **k: ctx)
    monkeypatch.setattr(harness, "execute", lambda worker, job, ctx: iter([[Record("x", {"a": 1})]]))
    monkeypatch.setattr(harness, "append_records", full_disk)
    monkeypatch.setattr(labdist, "end_rank", end_rank)
    monkeypatch.setattr(harness.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(harness.dist, "barrier", lambda *a, **k: events.append(("barrier",)))
    monkeypatch.setattr(harness.dist, "destroy_process_group", lambda *a, **k: events.append(("destroy",)))
    monkeypatch.delenv("LAB_RANK_LOG_DIR", raising=False)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"experiment": "x", "profile": "quick", "configs": [{"a": 1}],
                               "folder": str(tmp_path), "out": str(tmp_path / "records.jsonl")}))
    with pytest.raises(Ended):
        harness.serve(harness, [str(job)])
    assert events[0][0] == "end", events                       # before any teardown or barrier
    assert "OSError on rank 0 of 2: [Errno 28] No space left on device" in events[0][1]
    failure = json.loads((tmp_path / "failure-rank0.json").read_text())
    assert failure["status"] == "error" and "No space left on device" in failure["reason"]


# --------------------------------------------------------------------------- 3. the waterfall's warm-up


def test_every_waterfall_row_warms_the_shapes_its_epoch_meets(monkeypatch):
    """cuDNN's benchmark cache is keyed by shape, dtype and layout (the fake: a first-call cost). 80 images
    in batches of 32 end with a batch of 16: its shapes must be warmed in every row, not only the compiled
    one, or spec, channels_last and bf16 pay the search inside their timed epoch and device_loader and
    fused_sgd (whose keys the row before them filled) get the credit."""
    from lab_utils.engine import profiles
    from lab_utils.engine.harness import Job
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n08_speed_limits import experiment as fastpath
    from lab_utils.experiments.n08_speed_limits import worker
    from lab_utils.experiments.n08_speed_limits.fast_train import TrainOptions
    from lab_utils.experiments.shared import data

    gpu = FakeGPU(first_call_seconds=0.5).first_call_costs(monkeypatch)   # torch.cuda itself not patched:
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)   # the CPU's loaders, on the fake's clock
    s = profiles.settings(fastpath.Settings, "quick", width=2, train_images=80, batch_size=32, num_workers=0,
                          warmup_steps=1, compile=False, dataset="synthetic",
                          steps=("spec", "device_loader", "channels_last", "bf16", "fused_sgd"))
    runs = [r for r in make_plan(fastpath.WATERFALL_EXPERIMENT, s, Machine(gpus=0, cores=2), "quick")
            if r.skip is None]
    split = data.load_split(True, 80, "synthetic")
    job = Job("bench_train", "quick", [r.config for r in runs], {"seed": 0})
    rows = {r.config["step"]: worker.timed_epoch(TrainOptions.from_config(r.config), r.config, job, split,
                                                 torch.device("cpu")) for r in runs}
    assert list(rows) == ["spec", "device_loader", "channels_last", "bf16", "fused_sgd"]
    assert {step: m["epoch_seconds"] for step, m in rows.items()} == dict.fromkeys(rows, 0.0)
    assert rows["spec"]["warmup_seconds"] > 0 and rows["channels_last"]["warmup_seconds"] > 0
    assert rows["bf16"]["warmup_seconds"] > 0


def test_notebook_08_says_the_warm_up_is_timed_separately_for_every_row():
    import nbformat

    path = Path(__file__).resolve().parent.parent / "labs" / "08_speed_limits.ipynb"
    nb = nbformat.read(path, as_version=4)
    text = " ".join(" ".join(c.source.split()) for c in nb.cells if c.cell_type == "markdown")
    assert "last, partial batch" in text and "every row" in text.lower() and "timed separately" in text


# --------------------------------------------------------------------------- 5. the doctor's clock


@pytest.mark.parametrize("gpu_name", list(GPUS))
def test_the_doctors_clock_is_judged_against_the_fp32_matmul_peak(fake_gpu, gpu_name):
    """torch.mm in fp32 runs true fp32 unless torch.backends.cuda.matmul.allow_tf32: a rate above the fp32
    peak (but below TF32's) means the clock missed work. Before, the A100's and H100's ceiling was TF32's
    (8x and 7x too loose) and the V100 PCIe's the SXM2's."""
    name, major, fp32, tf32, topo, _ = GPUS[gpu_name]
    gpu = fake_gpu(count=1, name=name, major=major)
    m = doctor_checks.read_machine("full")

    def clock_row(tflops: float):
        seconds = 0.020   # the workload: 20 ms of queued device work with tflops x 20 ms of FLOPs
        fakes = {"workload": lambda: gpu.launch(seconds), "flops": tflops * 1e12 * seconds,
                 "clock": gpu.clock}
        [row] = doctor.run_checks(m, (doctor.BY_NAME["event_vs_host_clock"],),
                                  measure=lambda c, m, limit: c.measure(m, **fakes))
        return row

    assert torch.backends.cuda.matmul.allow_tf32 is False      # torch's default
    ok = clock_row(0.8 * fp32)
    assert ok.verdict == "ok" and f"({0.8 * fp32:.1f} TFLOP/s fp32)" in ok.measured
    missed = clock_row(1.1 * fp32)
    assert missed.verdict == "fail" and "the clock missed work" in missed.measured, missed.measured
    assert f"| event_vs_host_clock | events 20.00 ms, host clock 20.00 ms ({1.1 * fp32:.1f}" in doctor.table(
        [missed])
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True            # then TF32 is the ceiling, where there is one
        assert clock_row(1.1 * fp32).verdict == ("ok" if tf32 else "fail")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


# --------------------------------------------------------------------------- 6. the doctor's NCCL ceiling


@pytest.mark.parametrize("gpu_name", list(GPUS))
def test_the_doctors_nccl_check_fails_a_busbw_above_twice_the_link(fake_gpu, monkeypatch, gpu_name):
    """A timer that stops before NCCL's asynchronous work ends reports a busbw above any link: above
    2x the nominal per-direction peak the row fails ("the clock missed work"). The link is read from the
    fake node's nvidia-smi (NVLink for the A100 and H100, PCIe gen3 x16 for the V100 PCIe)."""
    from lab_utils.learn import ring

    name, major, _, _, topo, pcie = GPUS[gpu_name]
    fake_gpu(count=2, name=name, major=major, topo=topo, pcie=pcie)
    link = {"A100": 300.0, "H100": 450.0, "V100 PCIe": 0.985 * 16}[gpu_name]
    busbw = []

    def measured(lab, experiment, settings, runs, **kw):   # the benchmark's records at a chosen busbw
        out = []
        for r in runs:
            algbw = busbw[0] / (2 * (r.processes - 1) / r.processes)
            seconds = r.config["size_bytes"] / (algbw * 1e9)
            out.append(Record(experiment.name, r.config, {
                "busbw_gb_per_s": ring.busbw_gb_per_s(ring.algbw_gb_per_s(r.config["size_bytes"], seconds),
                                                      r.processes), "correct": True}, profile="full"))
        return out

    monkeypatch.setattr(plan, "measure", measured)
    m = doctor_checks.read_machine("full")

    def nccl_row(share: float):
        busbw[:] = [share * link]
        [row] = doctor.run_checks(m, (doctor.BY_NAME["nccl_allreduce"],),
                                  measure=lambda c, m, limit: c.measure(m, timeout_s=limit))
        return row

    good = nccl_row(0.8)
    assert good.verdict == "ok" and good.details["link_gb_per_s"] == pytest.approx(link), good.measured
    assert good.details["link_kind"] == ("pcie" if topo else "nvlink")
    assert nccl_row(1.5).verdict == "ok"                       # NVLS on NVSwitch nodes can pass 1x
    missed = nccl_row(2.5)
    assert missed.verdict == "fail" and "the clock missed work" in missed.measured, missed.measured
    assert "<= 2x" in missed.expected


# --------------------------------------------------------------------------- 7. the loader's kernels


def test_a_device_loaders_kernels_are_timed_as_data_loading(fake_gpu, monkeypatch):
    """next() of a device-resident loader launches its crop, flip and normalization and returns: the
    phase must wait for them, or they fall into no phase and the phases no longer add up to the epoch."""
    gpu = fake_gpu()
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)

    def loader():
        for _ in range(3):
            gpu.launch(0.005)        # the batch's augmentation kernels
            yield "batch"

    timer = timing.PhaseTimer(torch.device("cuda", 0))
    start = gpu.clock.now
    for _ in timer.iterate(loader()):
        with timer.phase("compute"):
            gpu.launch(0.020)
    timing.synchronize("cuda:0")
    assert timer.seconds("data_loading") == pytest.approx(0.015)
    assert timer.seconds("data_loading") + timer.seconds("compute") == pytest.approx(gpu.clock.now - start)


# --------------------------------------------------------------------------- 8. the visible GPUs' links


def test_the_link_is_read_for_the_gpus_cuda_visible_devices_exposes(fake_gpu, monkeypatch):
    """nvidia-smi lists every GPU of the node; CUDA_VISIBLE_DEVICES=2,3 are the node's GPUs 2 and 3, joined
    by PCIe gen3 x8, not GPUs 0 and 1 (NVLink): the topology and the PCIe width are read for them."""
    from lab_utils.experiments.n04_allreduce import experiment as comm

    topo = ("\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
            "GPU0\t X \tNV12\tSYS\tSYS\t0-31\t0\n"
            "GPU1\tNV12\t X \tSYS\tSYS\t0-31\t0\n"
            "GPU2\tSYS\tSYS\t X \tPIX\t32-63\t1\n"
            "GPU3\tSYS\tSYS\tPIX\t X \t32-63\t1\n")
    gpu = fake_gpu(count=4, name=A100, topo=topo, pcie_links=((4, 16), (4, 16), (3, 8), (4, 16)))
    assert comm.detect_link_peak(2).kind == "nvlink"           # without CUDA_VISIBLE_DEVICES: GPUs 0 and 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert torch.cuda.device_count() == 2
    link = comm.detect_link_peak()
    assert (link.kind, link.gb_per_s) == ("pcie", pytest.approx(0.985 * 8))   # the slower of the two
    assert "PCIe gen3 x8" in link.description
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu.gpu_uuid(1)},{gpu.gpu_uuid(0)}")
    assert comm.detect_link_peak().gb_per_s == 300.0           # UUIDs, in CUDA's order
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    assert comm.detect_link_peak().gb_per_s == pytest.approx(0.985 * 8)   # PCIe across the sockets (SYS)


# --------------------------------------------------------------------------- 9. out of memory at a handle


@pytest.mark.parametrize("message, which", [
    ("CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`", "cuBLAS"),
    ("cuDNN error: CUDNN_STATUS_NOT_INITIALIZED", "cuDNN"),
])
def test_out_of_memory_at_a_librarys_handle_is_an_oom_row_that_says_which(message, which):
    """The first matmul or convolution after a batch filled the GPU: cuBLAS's and cuDNN's handles cannot
    be made, and they say NOT_INITIALIZED. That is the sweep's oom row, not an error row."""
    with memory.catch_oom() as oom:
        raise RuntimeError(message)
    assert oom and oom.reason.startswith(f"OOM ({which}: its handle could not be created, no memory left): ")
    assert memory.mentions_out_of_memory(f"[rank1]: RuntimeError: {message}")


# --------------------------------------------------------------------------- 10. NCCL's start-up


def test_every_launch_asks_nccl_for_its_warnings_and_a_dump_on_timeout(monkeypatch, tmp_path):
    seen = {}

    class Started(Exception):
        pass

    def start(cmd, env=None, **kw):
        seen.update(env)
        raise Started

    monkeypatch.setattr(launcher.proc, "start", start)
    monkeypatch.delenv("NCCL_DEBUG", raising=False)
    monkeypatch.delenv("TORCH_NCCL_DUMP_ON_TIMEOUT", raising=False)
    with pytest.raises(Started):
        launcher.launch("x", {"experiment": "x", "profile": "quick", "configs": []}, log_dir=tmp_path)
    assert (seen["NCCL_DEBUG"], seen["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("WARN", "1")
    assert seen["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl_trace_rank_")
    with pytest.raises(Started):   # the user's own settings win
        launcher.launch("x", {"experiment": "x", "profile": "quick", "configs": []}, log_dir=tmp_path,
                        env={"NCCL_DEBUG": "INFO", "TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert (seen["NCCL_DEBUG"], seen["TORCH_NCCL_DUMP_ON_TIMEOUT"]) == ("INFO", "0")


def test_joining_nccl_is_bounded_and_the_rank_says_where_it_hung(fake_gpu, one_rank, monkeypatch, tmp_path):
    """A rendezvous or communicator initialization that never returns: past LAB_NCCL_INIT_TIMEOUT_S the
    rank writes its failure file (where it hung, which GPU) and ends, instead of waiting for the run's
    time limit with nothing in its log."""
    from lab_utils.engine import watchdog

    fake_gpu(count=2)
    ended = threading.Event()

    def hangs(backend, **kwargs):       # init_process_group("nccl") stuck in C++ until the process ends
        ended.wait(30)
        raise RuntimeError("the process was ended")

    def exit_(code):
        ended.set()

    monkeypatch.setattr(labdist.dist, "init_process_group", hangs)
    monkeypatch.setattr(watchdog.os, "_exit", exit_)
    monkeypatch.setattr(watchdog.faulthandler, "dump_traceback", lambda **kw: None)
    monkeypatch.setenv("LAB_NCCL_INIT_TIMEOUT_S", "0.5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="the process was ended"):
        labdist.init_distributed("nccl", folder=str(tmp_path))
    assert ended.is_set()
    failure = json.loads((tmp_path / "failure-rank0.json").read_text())
    assert failure["status"] == "error" and failure["reason"].startswith(
        "joining NCCL (rendezvous and communicator initialization) on rank 0 of 1, GPU cuda:1 did not "
        "finish within 0.5 s")


def test_a_run_stopped_at_its_time_limit_says_where_each_rank_was(monkeypatch, tmp_path):
    """The ranks mark where they are (joining the group, configuration i of n, the final barrier); a run
    stopped at its time limit says it in its error and in the row's reason."""
    script = tmp_path / "rank.py"
    script.write_text(
        "import json, sys, time\nfrom pathlib import Path\n"
        "job = json.loads(Path(sys.argv[1]).read_text())\n"
        "Path(job['folder'], 'stage-rank0.txt').write_text('in configuration 2 of 3')\n"
        "Path(job['folder'], 'stage-rank1.txt').write_text('joining the process group')\n"
        "time.sleep(60)\n")
    monkeypatch.setattr(launcher, "torchrun_command",
                        lambda module, args, nproc, **kw: [sys.executable, str(script), *args])
    with pytest.raises(LaunchError) as e:
        launcher.launch("x", {"experiment": "x", "profile": "quick", "configs": [{}]}, nproc=2, timeout_s=2,
                        log_dir=tmp_path / "logs")
    where = "rank 0 in configuration 2 of 3; rank 1 joining the process group"
    assert f"did not finish within 2 s and was stopped ({where})" in str(e.value)
    assert e.value.failure["reason"] == f"did not finish within 2 s: {where}"


def test_serve_marks_where_the_rank_is(monkeypatch, tmp_path):
    from lab_utils.engine import harness

    stages = []
    ctx = labdist.DistContext()
    monkeypatch.setattr(harness, "init_distributed", lambda *a, **k: stages.append(_stage(tmp_path)) or ctx)

    def run_config(config, job, ctx, state):
        stages.append(_stage(tmp_path))
        return []

    worker = SimpleNamespace(__name__="w", run_config=run_config)
    monkeypatch.delenv("LAB_RANK_LOG_DIR", raising=False)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"experiment": "x", "profile": "quick", "configs": [{}, {}],
                               "folder": str(tmp_path), "out": str(tmp_path / "r.jsonl")}))
    assert harness.serve(worker, [str(job)]) == 0
    assert stages == ["joining the process group (NCCL: creating its communicator)",
                      "in configuration 1 of 2", "in configuration 2 of 2"]
    assert _stage(tmp_path) == "in the final barrier (waiting for the other ranks)"


def _stage(folder: Path) -> str:
    return (folder / "stage-rank0.txt").read_text()


# --------------------------------------------------------------------------- 11. NCCL's default timeout


def test_the_collective_timeouts_quoted_are_the_pinned_torchs():
    """engine/dist.py said NCCL's collective timeout defaults to 30 minutes; torch's constant is 10 (gloo's
    30): the sentence is checked against torch.distributed.constants."""
    from torch.distributed import constants

    doc = " ".join(labdist.failure_ends_rank.__doc__.split())
    found = re.search(r"by default (\d+) minutes under NCCL, (\d+) under gloo", doc)
    assert found, doc
    nccl, gloo = (datetime.timedelta(minutes=int(v)) for v in found.groups())
    assert (nccl, gloo) == (constants.default_pg_nccl_timeout, constants.default_pg_timeout)


# --------------------------------------------------------------------------- issue 52 C7: an expectation


def test_exposed_beyond_the_all_reduce_is_a_warning_beyond_the_noise_not_a_failure():
    """(b) also holds the bucket copies and synchronization that (c) does not: with one bucket, or NCCL
    slowing the compute kernels, (b) > (c) happens. The doctor warns when it is beyond the noise (the
    timers' tolerance, or 2 standard errors of (b)); broken invariants still fail."""
    m = machine("G")
    run = {"label": "DDP 2 x 32", "status": "ok", "train_seconds": 1.0, "data_movement_seconds": 0.1,
           "compute_seconds": 0.8, "communication_seconds": 0.1, "exposed_comm_seconds": 0.1,
           "allreduce_seconds": 0.4, "backend": "nccl"}

    def judge(**change):
        return doctor_experiments.judge_experiment({"runs": [{**run, **change}]}, m)

    assert judge()[2] == "ok"
    measured, _, verdict = judge(exposed_comm_seconds=0.6)
    assert verdict == "warn" and "NOT AS EXPECTED" in measured and "beyond the noise" in measured
    assert judge(exposed_comm_seconds=-0.2)[2] == "warn"
    assert judge(exposed_comm_seconds=0.6, exposed_comm_noise_seconds=0.15)[2] == "ok"   # within 2 s.e.
    assert judge(compute_seconds=0.3)[2] == "fail"                                       # phases: a law
    assert judge(compute_seconds=0.3, exposed_comm_seconds=0.6)[2] == "fail"


# --------------------------------------------------------------------------- the link tables' data sheets


# NVLink per GPU and direction, decimal GB/s: the data sheet's total (both directions) / 2.
NVLINK_DATA_SHEETS = {
    "NVIDIA H100 NVL": 300.0,          # NVLink bridge: 600 GB/s
    "NVIDIA H100 PCIe": 300.0,         # NVLink bridge: 600 GB/s
    "NVIDIA H100 80GB HBM3": 450.0,    # SXM5, NVLink 4: 900 GB/s
    "NVIDIA H200": 450.0,              # SXM: 900 GB/s
    "NVIDIA H200 NVL": 450.0,          # 2- or 4-way NVLink bridge: 900 GB/s
    "NVIDIA A100-SXM4-80GB": 300.0,    # NVLink 3: 600 GB/s
    "Tesla V100-SXM2-32GB": 150.0,     # NVLink 2: 300 GB/s
}
# PCIe per lane and direction, decimal GB/s: GT/s x line encoding (8b/10b to gen2, 128b/130b from gen3) / 8
PCIE_LANES = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938}


@pytest.mark.parametrize("name", list(NVLINK_DATA_SHEETS))
def test_link_peaks_are_the_data_sheets_per_direction_figures(name):
    from lab_utils.experiments.n04_allreduce import experiment as comm

    assert comm._nominal_link_peak(name, "nvlink").gb_per_s == NVLINK_DATA_SHEETS[name]
    if name == "NVIDIA H100 NVL":   # once: every PCIe generation, at 16 lanes
        for gen, lane in PCIE_LANES.items():
            assert comm._nominal_link_peak(name, "pcie", gen, 16).gb_per_s == pytest.approx(16 * lane), gen
    assert comm._nominal_link_peak("NVIDIA L40S", "nvlink").gb_per_s is None   # no NVLink: no number
