"""The CUDA-only branches of the lab, run on this CPU machine against tests/fake_gpu.py.

Each test runs branches listed in tests/gpu_branches.py (the inventory) and asserts what the
code does with the fake's values: the argument types torch requires (a device *with* an
index, a ``float`` fraction), the device or backend chosen, the row or text written, the
time measured on the fake's clock. The last tests keep the inventory equal to the code.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import gpu_branches as inventory
import pytest
import torch
import torch.distributed as dist
from store_helpers import lab_for
from torch import nn

from lab_utils.engine import dist as labdist
from lab_utils.engine import hardware, memory, profiles
from lab_utils.engine.store import Record
from lab_utils.learn import devices, evaluation, loop, timing
from lab_utils.learn.errors import LabError

A100 = "NVIDIA A100-SXM4-80GB"
TESTS = Path(__file__).resolve().parent


# --------------------------------------------------------------------------- device queries


def test_device_queries_name_count_and_default_device(fake_gpu):
    gpu = fake_gpu(count=2, name=A100)
    assert hardware.gpu_count() == 2 and devices.default_device() == torch.device("cuda")
    assert [(g.index, g.name, g.memory_bytes) for g in hardware.gpus()] == [(0, A100, 80 * 2 ** 30),
                                                                             (1, A100, 80 * 2 ** 30)]
    gpu.initialized = False
    s = hardware.hardware_summary()
    assert s == {"device_type": "cuda", "device_name": A100, "device_count": 2,
                 "cpu_cores": hardware.cpu_cores()}
    assert hardware.hardware_summary("cuda:1", 1)["device_count"] == 1
    assert hardware.device_name() == A100 and not gpu.initialized      # named by nvidia-smi -L: no context
    gpu.name = "NVIDIA A100 80GB PCIe"                                  # GPU 1 another model (nvidia-smi -L)
    (Path(hardware.shutil.which("nvidia-smi")).parent / "smi_list.txt").write_text(
        f"GPU 0: {A100} (UUID: GPU-0)\nGPU 1: {gpu.name} (UUID: GPU-1)\n")
    assert hardware.device_name("cuda:1") == gpu.name and not gpu.initialized
    gpu.name = A100
    gpu.initialized = True
    assert hardware.device_name("cuda:1") == A100                       # torch's name once CUDA is up
    machine = hardware.describe_machine()
    assert [g["name"] for g in machine["gpus"]] == [A100] * 2 and "GPU1" in machine["interconnect"]
    assert hardware.classify_interconnect(machine["interconnect"], 2) == "nvlink"


def test_device_name_asks_torch_once_cuda_is_up(fake_gpu, monkeypatch):
    """nvidia-smi lists GPUs in PCI order, CUDA (CUDA_DEVICE_ORDER=FASTEST_FIRST by default) in its own:
    once CUDA is initialised here torch's name is the one of the device the code uses."""
    gpu = fake_gpu(count=2, name=A100)
    monkeypatch.setattr(hardware, "visible_gpu_names", lambda text=None: ["NVIDIA A100 80GB PCIe", A100])
    assert hardware.device_name("cuda:0") == "NVIDIA A100 80GB PCIe" and not gpu.initialized   # no context
    gpu.initialized = True
    assert hardware.device_name("cuda:0") == A100


def test_visible_gpu_names_follow_cuda_visible_devices(fake_gpu, monkeypatch):
    fake_gpu(count=4, name=A100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert hardware.visible_gpu_names() == [A100, A100]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7")
    assert hardware.visible_gpu_names() == [None]
    listing = ("GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-aaaa)\n"
               "  MIG 3g.20gb     Device  0: (UUID: MIG-1111)\n"
               "  MIG 1g.5gb      Device  1: (UUID: MIG-2222)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-2222,GPU-bbbb")
    mig = "NVIDIA A100-SXM4-40GB MIG "
    assert hardware.visible_gpu_names(listing) == [mig + "1g.5gb", "NVIDIA H100 80GB HBM3"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert hardware.visible_gpu_names(listing) == [mig + "3g.20gb", mig + "1g.5gb", "NVIDIA H100 80GB HBM3"]


def test_a_session_on_a_gpu_node(fake_gpu, capsys):
    from lab_utils.engine import session

    fake_gpu(count=2)
    lab = session.start("quick")
    assert lab.device == torch.device("cuda") and lab.gpu_count == 2
    assert "device: cuda x2" in capsys.readouterr().out
    from lab_utils.engine.environment import gpu_node_problem

    assert gpu_node_problem() is None   # torch sees the GPUs: nothing to refuse


# --------------------------------------------------------------------------- timing


def test_timers_synchronize_so_a_phase_includes_its_queued_device_work(fake_gpu, monkeypatch):
    """A kernel launch returns at once; the phase must still last as long as the device works."""
    gpu = fake_gpu(count=2)
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)
    timer = timing.PhaseTimer(torch.device("cuda", 1))
    with timer.phase("compute"):
        gpu.launch(0.300, device=1)           # returns immediately, like a kernel launch
    assert timer.seconds("compute") == pytest.approx(0.300)
    assert gpu.synchronize_calls[-2:] == [1, 1]   # both ends, on the timer's device
    on_gpu0 = timing.PhaseTimer(torch.device("cuda", 0))
    with on_gpu0.phase("compute"):
        gpu.launch(0.200, device=1)           # GPU 1's work: a timer of GPU 0 does not wait for it
    assert on_gpu0.seconds("compute") == pytest.approx(0.0)
    gpu.synchronize(1)
    nested = timing.NestedTimers("cuda")
    with nested("epoch"), nested("forward"):
        gpu.launch(0.05)
    assert nested.stats["epoch/forward"].total_seconds == pytest.approx(0.05)
    timing.synchronize(None)   # no device: nothing to wait for
    n = len(gpu.synchronize_calls)
    timing.synchronize("cpu")
    assert len(gpu.synchronize_calls) == n


class OnTheGPU:
    """A CPU DDP model as a GPU rank's timer sees it: its parameters on cuda:``index``."""

    def __init__(self, ddp, index: int = 0):
        self.ddp, self.index = ddp, index

    def parameters(self):
        yield SimpleNamespace(device=torch.device("cuda", self.index))

    def register_comm_hook(self, state, hook):
        self.ddp.register_comm_hook(state=state, hook=hook)


@pytest.mark.parametrize("index", [0, 1])
def test_allreduce_timer_reads_cuda_events_in_seconds(fake_gpu, one_rank, monkeypatch, index):
    """The DDP communication hook's clock on a GPU: CUDA events (ms) turned into seconds, after a
    synchronization of the rank's GPU. The model is on the CPU (gloo computes the sums); the timer takes
    its CUDA branch and each bucket's all-reduce takes 3 ms on the fake's NCCL stream, queued behind the
    compute stream's work and timed from the bucket's readiness to the end of the collective (its
    callback's event is reached then), on GPU 0 and on a rank's GPU 1 (known answers)."""
    from lab_utils.learn.comm_hooks import AllReduceTimer

    gpu = fake_gpu(count=2, collective_seconds=0.003).nccl_streams(monkeypatch)
    labdist.init_distributed("gloo")
    torch.cuda.set_device(index)          # what init_distributed does on a rank of GPU `index`
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    ddp = nn.parallel.DistributedDataParallel(model)

    timer = AllReduceTimer(OnTheGPU(ddp, index))
    assert (timer.cuda, timer.device) == (True, torch.device("cuda", index))
    model[0].weight.register_hook(lambda g: gpu.launch(0.002) or g)   # backward work before the bucket
    timer.begin_step()
    gpu.launch(0.010)                                                   # forward
    ddp(torch.ones(2, 4)).sum().backward()
    gpu.launch(0.004)                                                   # the tail DDP waits for
    timer.end_backward()
    step = timer.finish_step()
    assert gpu.synchronize_calls[-1] == index and gpu.collectives == ["all_reduce"]
    # the bucket was ready when the first layer's gradient was (0.012 s after the start); its
    # all-reduce ran 3 ms on the NCCL stream; the tail is the 4 ms after it: seconds, not milliseconds
    assert step.buckets == 1
    assert step.allreduce_busy_seconds == pytest.approx(0.003, abs=1e-9)
    assert step.allreduce_sum_seconds == pytest.approx(0.003, abs=1e-9)
    assert step.exposed_tail_seconds == pytest.approx(0.004, abs=1e-9)


def test_a_barrier_on_nccl_names_the_gpu_by_index(fake_gpu, one_rank, monkeypatch):
    """NCCL's barrier needs ``device_ids=[index]`` (an int): without it NCCL guesses a device."""
    from lab_utils.learn import comm_probe

    gpu = fake_gpu(count=2).gloo_for_nccl(monkeypatch)
    labdist.init_distributed("auto")
    assert gpu.nccl_requests[-1]["backend"] == "nccl"
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")   # what the NCCL group answers
    calls = []
    real = dist.barrier
    monkeypatch.setattr(dist, "barrier", lambda **kw: calls.append(kw) or real())
    comm_probe._barrier(torch.device("cuda", 1))
    comm_probe._barrier(torch.device("cuda"))      # no index: the current device
    torch.cuda.set_device(1)                       # a rank on GPU 1
    comm_probe._barrier(torch.device("cuda"))
    assert calls == [{"device_ids": [1]}, {"device_ids": [0]}, {"device_ids": [1]}]
    assert all(isinstance(i, int) for c in calls for i in c["device_ids"])


# --------------------------------------------------------------------------- distributed


def test_choose_backend_answers_nccl_with_a_gpu_per_rank(fake_gpu):
    fake_gpu(count=2)
    assert labdist.choose_backend("auto", 2) == "nccl"
    assert labdist.choose_backend("auto", 4) == "gloo"    # two ranks would share a GPU
    assert labdist.choose_backend("gloo", 2) == "gloo"


def test_init_distributed_joins_nccl_on_its_own_gpu(fake_gpu, one_rank, monkeypatch):
    """gloo stands in for NCCL (the request is recorded); the code takes its CUDA branch."""
    gpu = fake_gpu(count=2).gloo_for_nccl(monkeypatch)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ctx = labdist.init_distributed(device="cuda")
    assert (ctx.backend, ctx.device, gpu.current) == ("nccl", torch.device("cuda", 1), 1)
    assert gpu.nccl_requests == [{"backend": "nccl", "device_id": torch.device("cuda", 1)}]
    assert dist.get_backend() == "gloo"          # what really runs here
    dist.destroy_process_group()
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(LabError, match="LOCAL_RANK 2 but only 2 GPUs are visible"):
        labdist.init_distributed("nccl")


def test_init_distributed_without_torchrun_on_a_gpu(fake_gpu, monkeypatch):
    fake_gpu()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    ctx = labdist.init_distributed(group_of_one=False)
    assert ctx.device == torch.device("cuda") and ctx.backend is None and not ctx.ddp
    assert labdist.init_distributed(device="cpu", group_of_one=False).device == torch.device("cpu")


# --------------------------------------------------------------------------- memory


def test_memory_cap_and_cleanup_on_a_gpu(fake_gpu):
    gpu = fake_gpu(count=2)
    assert memory.resolve_cuda_device("cuda") == torch.device("cuda", 0)
    assert memory.resolve_cuda_device(1) == torch.device("cuda", 1)
    torch.cuda.set_device(1)                                      # a rank on GPU 1: "cuda" is its GPU
    assert memory.resolve_cuda_device("cuda") == torch.device("cuda", 1)
    torch.cuda.set_device(0)
    value, dev = memory.set_memory_fraction(1, "cuda:1")          # an int 1 is given to torch as 1.0
    assert (value, dev) == (1.0, torch.device("cuda", 1)) and gpu.fraction_calls == [(1.0, 1)]
    with pytest.raises(ValueError, match="specified index"):
        torch.cuda.set_per_process_memory_fraction(0.5, torch.device("cuda"))  # resolve_cuda_device avoids it
    gpu.allocate(2 ** 30)
    gpu.release(2 ** 30)
    assert torch.cuda.memory_reserved(0) == 2 ** 30
    memory.free_device_memory("cpu")
    assert gpu.empty_cache_calls == 0
    memory.free_device_memory("cuda")
    assert gpu.empty_cache_calls == 1 and torch.cuda.memory_reserved(0) == 0
    gpu.initialized = False
    memory.free_device_memory()       # CUDA never initialized in this process: no context opened for it
    assert gpu.empty_cache_calls == 1 and not gpu.initialized


def test_peak_memory_is_read_and_reset_on_the_gpu(fake_gpu):
    gpu = fake_gpu(count=2)
    gpu.allocate(3 * 2 ** 30, 1)
    gpu.release(2 * 2 ** 30, 1)
    dev = torch.device("cuda", 1)
    assert devices.peak_memory(dev) == 3 * 2 ** 30 and isinstance(devices.peak_memory(dev), int)
    devices.reset_peak_memory(dev)
    assert devices.peak_memory(dev) == 2 ** 30 and devices.peak_memory(torch.device("cpu")) is None


def test_the_sweep_worker_caps_the_gpu_memory(fake_gpu, monkeypatch):
    """Notebook 01's worker on a (fake) GPU, before it trains: torch gets a float fraction and an indexed
    device, the smaller of memory_fraction and memory_cap_bytes over the GPU's 80 GiB; no cap, no call."""
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n01_batch_sweep import worker

    gpu = fake_gpu(count=1, name=A100)

    class Training(Exception):
        pass

    def training(**kw):
        raise Training

    monkeypatch.setattr(worker, "apply_training_backends", training)   # the first step after the cap
    ctx = SimpleNamespace(device=torch.device("cuda"))
    cfg = {"batch_size": 2, "cudnn_benchmark": True, "memory_fraction": 0.5, "memory_cap_bytes": 20 * 2 ** 30}
    for fraction, cap in ((0.5, 20 * 2 ** 30), (None, 20 * 2 ** 30), (0.25, None), (None, None)):
        with pytest.raises(Training):
            worker.run_config({**cfg, "memory_fraction": fraction, "memory_cap_bytes": cap},
                              Job("batch_sweep", "full", []), ctx, None)
    assert gpu.fraction_calls == [(0.25, 0)] * 3
    assert all(isinstance(f, float) for f, _ in gpu.fraction_calls)


def test_loaders_pin_memory_when_a_gpu_is_there(fake_gpu):
    from lab_utils.experiments.shared import data

    fake_gpu()
    loaders = data.make_loaders(batch_size=4, num_workers=0, train_images=8, test_images=8,
                                dataset="synthetic")
    assert loaders.train.pin_memory and loaders.test.pin_memory
    split = data.ArraySplit(*data.synthetic_arrays(8, True), synthetic=True)
    assert data.spec_loader(split, 4, 0).pin_memory


# --------------------------------------------------------------------------- experiments' plans on GPUs


def test_fast_path_choices_on_a_gpu(fake_gpu):
    from lab_utils.experiments.n08_speed_limits import fast_train
    from lab_utils.experiments.n08_speed_limits import tables as fastpath_tables

    fake_gpu(name=A100)
    assert fast_train.resolved_sgd("default", torch.device("cuda")) == "foreach"
    assert fast_train.resolved_sgd("default", torch.device("cpu")) == "for-loop"
    rec = Record("fastpath_trace", {"step": "fast", "device": "cuda", "trace_steps": 3}, profile="full",
                 metrics={"description": "d", "trace_path": "/x/results/full/traces/fastpath_fast.json"})
    notes = fastpath_tables.trace_notes([rec])
    assert "self time = GPU kernel time" in notes[1] and "GPU total kernel time" in notes[1]
    assert "results/full/traces/fastpath_fast.json" in notes[2]


def test_comm_plans_on_gpus(fake_gpu):
    """Notebook 04's plans for this (fake) GPU node: NCCL with a rank per GPU and every GPU of the node, a
    rank count it lacks a row that says so, the compute step launched; one GPU: gloo CPU processes."""
    from dataclasses import replace

    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n04_allreduce import experiment as comm

    gpu = fake_gpu(count=8)
    s = replace(profiles.settings(comm.Settings, "quick"), bench_ranks=(2, 16))

    def ranks():
        runs = make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, s, Machine.here(), "quick")
        return {(r.processes, r.config["backend"], r.device, r.skip) for r in runs}

    assert ranks() == {(2, "nccl", "cuda", None), (8, "nccl", "cuda", None),
                       (16, "nccl", "cuda", "needs 16 GPUs")}
    [step] = make_plan(comm.COMPUTE_STEP_EXPERIMENT, s, Machine.here(), "quick")
    assert (step.device, step.in_process, step.config["device_type"]) == ("cuda", False, "cuda")
    gpu.count = 1
    assert {r[:3] for r in ranks()} == {(2, "gloo", "cpu"), (16, "gloo", "cpu")}  # NCCL cannot share a GPU
    gpu.count = 2
    link = comm.detect_link_peak()
    assert link.gb_per_s == 300.0 and "NVLink" in link.description


def test_gpt_device_peak_on_a_gpu(fake_gpu):
    from lab_utils.experiments.n06_gpt_ddp.worker import device_peak

    fake_gpu(name="NVIDIA H100 80GB HBM3", major=9)
    assert device_peak(torch.device("cuda", 0), "bf16") == ("NVIDIA H100 80GB HBM3", 989e12, "bf16")
    name, peak, precision = device_peak(torch.device("cuda", 0), "fp32")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    assert (precision, peak) == (("tf32", 495e12) if tf32 else ("fp32", 67e12))


def test_large_batch_and_accounting_on_gpus(fake_gpu):
    """Notebook 05's plans for this (fake) 2-GPU node: the large runs on 2 GPUs x 2 accumulation steps with
    NCCL, and it says so; the ledger on the GPUs; one GPU: the ledger on 2 gloo processes."""
    from lab_utils.engine.machine import Machine
    from lab_utils.experiments.n05_large_batch import experiment as lb

    gpu = fake_gpu(count=2, name=A100)
    full = profiles.settings(lb.Settings, "full")
    plan = lb.plan_devices(full, Machine.here())
    assert (plan.large_devices, plan.backend, plan.accumulation_steps, plan.device) == (2, "nccl", 2, "cuda")
    assert "this machine has 2 GPU(s)" in plan.note
    runs = lb.plan(full, Machine.here(), "full")
    assert [r.processes for r in runs] == [1, 2, 2, 2, 2] and {r.device for r in runs} == {"cuda"}
    [ledger] = lb.plan_accounting(full, Machine.here(), "full")
    assert (ledger.processes, ledger.device, ledger.config["backend"]) == (2, "cuda", "nccl")
    gpu.count = 1
    [one] = lb.plan_accounting(full, Machine.here(), "full")
    assert (one.processes, one.device, one.config["backend"]) == (2, "cpu", "gloo")


def test_the_large_batch_table_says_gpu(fake_gpu):
    """Runs on (fake) 4 GPUs, NCCL records: 'N x GPU' rows, and the full layout is 'as asked'."""
    from lab_utils.engine.machine import Machine
    from lab_utils.experiments.n05_large_batch import experiment as lb
    from lab_utils.experiments.n05_large_batch import tables as lbt

    fake_gpu(count=4)
    s = profiles.settings(lb.Settings, "full")
    recs = [Record(lb.EXPERIMENT, r.config, status="skipped", reason="not run here")
            for r in lb.plan(s, Machine.here(), "full")]
    t = lbt.large_batch_table(recs, s)
    assert list(t["devices"]) == ["1 x GPU"] + ["4 x GPU"] * 4
    assert list(t["vs assignment"]) == ["as asked"] * 5


def test_asking_for_cuda_without_a_gpu_is_one_sentence():
    from lab_utils.experiments.n08_speed_limits import tables as fastpath_tables

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(LabError, match="--device cuda was asked for but no CUDA device is visible"):
        labdist.init_distributed(device="cuda")
    with pytest.raises(LabError, match="device='cuda' was asked for but torch sees no GPU"):
        fastpath_tables._machine("cuda")


def test_quantization_variants_on_a_gpu(fake_gpu, int_mm_on_cpu):
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n07_quantization import quant_model as QM

    fake_gpu(name=A100)
    runs = make_plan(Q.QUANTIZATION_EXPERIMENT, profiles.settings(Q.Settings, "quick"), profile="quick")
    assert sorted({r.device for r in runs}) == ["cpu", "cuda"]
    fp32 = Q.check_variant("fp32", "cuda")
    assert fp32.ok and fp32.kernel == "cuBLAS fp32 GEMM (true fp32)"     # torch's default for matmuls
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert Q.check_variant("fp32", "cuda").kernel == "cuBLAS fp32 GEMM (TF32 allowed)"
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert Q.check_variant("bf16", "cuda").kernel == "cuBLAS bf16 GEMM (tensor cores)"
    ao = Q.check_variant("ao_dynamic_int8", "cuda")
    assert not ao.ok and "CPU only" in ao.reason
    dyn = Q.check_variant("torchao_int8_dynamic", "cuda")
    if dyn.ok:   # torchao installed
        assert "torch._int_mm (cuBLAS)" in dyn.kernel
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    kept = QM.float_layers(GPT(gpt_config("tiny", vocab_size=65)), "torchao_int8_dynamic", "cuda")
    assert kept == {"lm_head": "(N=65) kept in fp32: int8 mm needs N % 8 == 0"}


def test_scaling_plans_and_rows_on_gpus(fake_gpu):
    """Notebooks 02 and 03 planned for a 2-GPU node: DataParallel (one process over the GPUs) and DDP (NCCL,
    a rank per GPU) side by side, 4 devices a row "needs 4 GPUs" that keeps its NCCL label (not gloo CPU
    processes, although 4 would fit), Table 2 with DataParallel's rows; a CPU machine: DDP alone on gloo."""
    from dataclasses import replace

    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n02_scaling import experiment as scaling
    from lab_utils.experiments.n03_compute_vs_comm.experiment import COMPUTE_VS_COMM_EXPERIMENT

    fake_gpu(count=2, name=A100)
    s = replace(profiles.settings(scaling.Settings, "quick", dataset="synthetic"), devices=(1, 2, 4),
                batch_sizes=(32,), run_batch_sizes=(32,), max_cpu_processes=4, comm_devices=(2,))
    node = Machine(gpus=2, gpu_name=A100, cores=16, bf16=True)
    DP, DDP = scaling.DP, scaling.DDP
    assert scaling.place(DP, 2, node, s) == scaling.Placement(DP, 2, scaling.DP_BACKEND, "cuda")
    assert scaling.place(DDP, 2, node, s) == scaling.Placement(DDP, 2, "nccl", "cuda")
    assert scaling.place(DDP, 4, node, s) == scaling.Placement(DDP, 4, None, None, "needs 4 GPUs")
    assert scaling.methods_here(node) == (DP, DDP)

    def rows(experiment, machine):
        return [(r.experiment, r.config["method"], r.config["devices"], r.config["backend"],
                 r.config["device_type"], r.device, r.processes, r.skip)
                for r in make_plan(experiment, s, machine, "quick")]

    one = scaling.DP_BACKEND
    assert rows(scaling.SCALING_EXPERIMENT, node) == [
        ("scaling", DP, 1, one, "cuda", "cuda", 1, None), ("scaling", DP, 2, one, "cuda", "cuda", 1, None),
        ("scaling", DP, 4, one, "cuda", "cuda", 1, "needs 4 GPUs"),
        ("scaling", DDP, 1, "nccl", "cuda", "cuda", 1, None),
        ("scaling", DDP, 2, "nccl", "cuda", "cuda", 2, None),
        ("scaling", DDP, 4, "nccl", "cuda", "cuda", 4, "needs 4 GPUs")]
    assert rows(COMPUTE_VS_COMM_EXPERIMENT, node) == [
        ("scaling", DDP, 1, "nccl", "cuda", "cuda", 1, None),
        ("scaling", DP, 2, one, "cuda", "cuda", 1, None),
        ("compute_vs_comm", DDP, 2, "nccl", "cuda", "cuda", 2, None)]
    cpu = Machine(gpus=0, cores=4)
    assert scaling.methods_here(cpu) == (DDP,)
    assert {r[1:] for r in rows(scaling.SCALING_EXPERIMENT, cpu)} == {
        (DDP, n, "gloo", "cpu", "cpu", n, None) for n in (1, 2, 4)}
    assert [r[1] for r in rows(COMPUTE_VS_COMM_EXPERIMENT, cpu)] == [DDP, DDP]


def test_worker_records_name_the_gpu(fake_gpu):
    """A DDP run on NCCL is keyed and recorded as a GPU run: ``device_type`` cuda in its config (the reuse
    key) and the GPU's name in the record's hardware; on gloo, a CPU run."""
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n02_scaling import ddp_worker as ddp

    fake_gpu(count=2, name=A100)
    ctx = labdist.DistContext(rank=0, world_size=2, backend="nccl", device=torch.device("cuda", 0))
    args = ddp.RunConfig(devices=2, backend="nccl", batch_size=8, epochs=1, width=2, train_images=32,
                         test_images=16).validate()
    config = args.config()
    assert config["device_type"] == "cuda" and config["backend"] == "nccl"
    assert ddp.RunConfig(devices=2, backend="gloo", batch_size=8).config()["device_type"] == "cpu"
    epoch = {"epoch": 1, "steps": 1, "images": 16, "epoch_seconds": 1.0, "train_seconds": 0.5,
             "elapsed_seconds": 1.0, "sample_order_head": []}
    gathered = [{"rank": r, "epochs": [epoch], "startup_seconds": 0.1, "comm_probe": None, "threads": 1}
                for r in (0, 1)]
    summary = {"n_params": 10, "steps_per_epoch": 1, "global_batch": 16, "accumulation_steps": 1,
               "batches_per_epoch": 1, "peak_lr": 0.1, "warmup_steps": 0, "worker_seconds": 1.0}
    rec = ddp.build_records(config, Job("scaling", "quick", [config]), args, ctx, gathered, summary)[0]
    assert rec.config["device_type"] == "cuda"
    assert rec.hardware["device_name"] == A100 and rec.hardware["backend"] == "nccl"
    assert "threads_per_process" not in rec.hardware


def test_the_ledger_record_names_the_gpu(fake_gpu):
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n05_large_batch import accounting_worker as comm_accounting

    fake_gpu(count=2, name=A100)
    ctx = labdist.DistContext(rank=0, world_size=2, backend="nccl", device=torch.device("cuda", 0))
    config = {"width": 2, "batch_size": 2, "steps": 1, "devices": 2, "backend": "nccl"}
    rec = comm_accounting.build_record(config, Job("comm_accounting", "quick", [config]), ctx,
                                       [{"model_bytes": {"parameters": 1}}] * 2)
    assert rec.hardware["device_name"] == A100 and rec.hardware["device_count"] == 2
    assert rec.config == config and rec.profile == "quick"


def test_allreduce_worker_waits_for_the_gpu(fake_gpu):
    from lab_utils.experiments.n04_allreduce import allreduce_worker as allreduce_bench

    gpu = fake_gpu(count=2)
    allreduce_bench._sync(torch.device("cuda", 1))
    allreduce_bench._sync(torch.device("cpu"))
    assert gpu.synchronize_calls == [1]


def test_bench_timers_default_sizes_on_a_gpu(fake_gpu, monkeypatch, capsys):
    """The benchmark's GPU rows and clock are chosen (the step itself is stopped: no device memory here):
    the spec ResNet-18 at batch 128 and 8, the small GPT at 64 and 4, on the wall clock."""
    from lab_utils.app import bench_timers

    fake_gpu()
    seen = []

    def measure(row, device, sizes, pairs, seconds, clock):
        seen.append((row.model, row.batch_size, sizes.resnet_width, sizes.gpt_size, clock))
        raise RuntimeError("stop: no device memory in the fake")

    monkeypatch.setattr(bench_timers, "measure", measure)
    with pytest.raises(RuntimeError, match="stop"):
        bench_timers.main([])
    assert seen == [("resnet", 128, 64, "small", time.perf_counter)]
    assert bench_timers.rows(bench_timers.GPU_SIZES) == [bench_timers.Row("resnet", 128), bench_timers.Row(
        "resnet", 8), bench_timers.Row("gpt", 64), bench_timers.Row("gpt", 4)]
    assert "clock: wall time" in capsys.readouterr().out


def test_bench_timers_arms_end_when_the_gpus_step_does(fake_gpu, monkeypatch):
    """Each arm of `bench timers` (the timed and the plain step) returns only when the step's kernels have
    run on the GPU: a step that queues 0.25 s of work there takes 0.25 s of the (fake) host clock, so the
    paired ratio compares two whole steps, not a step and a launch."""
    from lab_utils.app import bench_timers

    gpu = fake_gpu()

    class OnTheFakeGPU(nn.Linear):   # no device memory in the fake: the model stays where it is
        def to(self, *args, **kwargs):
            return self

    monkeypatch.setattr(bench_timers, "ResNet18", lambda width: OnTheFakeGPU(2, 2))
    monkeypatch.setattr(bench_timers, "train_steps", lambda *a, **k: gpu.launch(0.25, 0))
    timed, plain, _ = bench_timers.arms(bench_timers.Row("resnet", 2), torch.device("cuda", 0),
                                        bench_timers.CPU_SIZES)
    for arm in (plain, timed):
        start = gpu.clock.now
        arm()
        assert gpu.clock.now - start == pytest.approx(0.25), arm.__name__
        assert gpu.busy_until <= gpu.clock.now


# --------------------------------------------------------------------------- plans made for a GPU node


def test_the_machine_here_names_its_gpus_and_their_bf16(fake_gpu):
    """Machine.here on a (fake) 2-GPU node: the count, the GPU's name and native bf16 from nvidia-smi (no
    CUDA context opened); once CUDA is up, bf16 is torch's answer. A GPU machine's runs go to cuda."""
    from lab_utils.engine import machine

    gpu = fake_gpu(count=2, name=A100)   # compute capability 8.0
    here = machine.Machine.here()
    assert (here.gpus, here.gpu_name, here.bf16) == (2, A100, True) and not gpu.initialized
    assert here.device == "cuda" and here.describe() == f"2 x {A100}"
    assert machine.Machine(gpus=4).describe() == "4 x GPU"
    gpu.initialized = True
    assert machine._native_bf16() is True
    gpu.major = 7                        # CUDA up on a Volta: torch says no (nvidia-smi's files say 8.0)
    assert machine._native_bf16() is False
    assert machine.Machine(cores=2).device == "cpu" and machine.Machine(cores=2).describe() == "CPU, 2 cores"


def test_gpt_runs_are_placed_on_the_gpus():
    """Notebook 06 on a 2-GPU node: 1 and 2 ranks on the GPUs, 4 a row that says the node has 2 (not gloo
    CPU processes, although the cores would allow them); without GPUs, gloo CPU processes."""
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n06_gpt_ddp import experiment as gpt

    node = Machine(gpus=2, gpu_name=A100, cores=16, bf16=True)
    assert gpt.place(1, node, 4) == ("cuda", None) and gpt.place(2, node, 4) == ("cuda", None)
    assert gpt.place(4, node, 4) == ("cuda", "needs 4 GPUs (this machine has 2)")
    assert gpt.place(2, Machine(cores=4), 2) == ("cpu", None)
    runs = make_plan(gpt.SCALING_EXPERIMENT, profiles.settings(gpt.Settings, "quick"), node, "quick")
    assert {(r.processes, r.device, r.config["device_type"], r.threads) for r in runs if r.skip is None} \
        == {(1, "cuda", "cuda", None), (2, "cuda", "cuda", None)}
    assert {r.skip for r in runs if r.processes == 4} == {"needs 4 GPUs (this machine has 2)"}


def test_the_sweep_plan_on_a_gpu():
    """Notebook 01 on a GPU: launched (not in the kernel), no CPU thread pin, the GPU's name in the key,
    memory_fraction accepted; on a CPU memory_fraction is one sentence."""
    from dataclasses import replace

    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n01_batch_sweep import experiment as sweep

    s = replace(profiles.settings(sweep.Settings, "quick", dataset="synthetic"), memory_fraction=0.5)
    runs = make_plan(sweep.SWEEP_EXPERIMENT, s, Machine(gpus=1, gpu_name=A100, cores=16, bf16=True), "quick")
    assert runs and all((r.device, r.in_process, r.threads) == ("cuda", False, None) for r in runs)
    assert all(r.config["device"] == A100 and r.config["memory_fraction"] == 0.5
               and "cpu_threads" not in r.config for r in runs)
    with pytest.raises(LabError, match="memory_fraction limits a GPU's memory"):
        make_plan(sweep.SWEEP_EXPERIMENT, s, Machine(cores=4), "quick")


def test_quantization_plans_on_a_gpu(fake_gpu, results_dir):
    """Notebook 07 on a GPU node: every variant on the CPU and on the GPU (launched), and the fallback GPT
    trained on the GPU through the launcher, never in the kernel; a CPU machine: the CPU alone."""
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n07_quantization import experiment as quantize

    fake_gpu(count=1, name=A100)
    s = profiles.settings(quantize.Settings, "quick")
    node = Machine(gpus=1, gpu_name=A100, cores=16, bf16=True)
    runs = make_plan(quantize.QUANTIZATION_EXPERIMENT, s, node, "quick")
    assert [(r.config["variant"], r.in_process) for r in runs if r.device == "cuda"] == \
        [(v, False) for v in s.variants]
    assert {r.device for r in make_plan(quantize.QUANTIZATION_EXPERIMENT, s, Machine(cores=4), "quick")} \
        == {"cpu"}
    [fallback] = make_plan(quantize.FALLBACK_EXPERIMENT, s, node, "quick")
    assert (fallback.device, fallback.config["device_type"], fallback.in_process) == ("cuda", "cuda", False)


def test_fast_path_plans_on_a_gpu():
    """Notebook 08 on GPUs: the device-resident loader without a CPU thread cap; the bf16 steps a row on a
    GPU without native bf16, measured on one with it (and on a CPU)."""
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan
    from lab_utils.experiments.n08_speed_limits import experiment as fastpath

    s = profiles.settings(fastpath.Settings, "quick", dataset="synthetic")
    volta = Machine(gpus=1, gpu_name="Tesla V100-SXM2-32GB", cores=16, bf16=False)
    ampere = Machine(gpus=1, gpu_name=A100, cores=16, bf16=True)
    loaders = make_plan(fastpath.LOADER_EXPERIMENT, s, ampere, "quick")
    assert [(r.config["pipeline"], r.device, r.in_process) for r in loaders] == [("spec", "cuda", False),
                                                                                   ("device", "cuda", False)]
    assert loaders[1].config["cpu_threads"] is None
    assert make_plan(fastpath.LOADER_EXPERIMENT, s, Machine(cores=4), "quick")[1].config["cpu_threads"] == 1

    def why(machine):
        return {name: reason for name, _, _, reason in fastpath.waterfall(s, machine, "quick")}

    assert why(volta)["bf16"] == "this GPU has no bf16 (needs Ampere or newer)"
    assert why(ampere)["bf16"] is None and why(Machine(cores=4))["bf16"] is None


def test_a_run_on_gpus_names_them_and_is_never_run_in_the_kernel(fake_gpu, store):
    """A run on GPUs: without them here, its hardware has no name (a plan made for another machine); with
    them, the GPU's name and count (the reuse check's). A plan that marks a GPU run in_process is refused
    with one sentence before anything runs."""
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import Experiment, Run, measure

    run = Run("x", {"a": 1}, device="cuda", processes=2)
    assert run.hardware() == {"device_type": "cuda", "device_name": None, "device_count": 2}
    fake_gpu(count=2, name=A100)
    assert run.hardware() == hardware.hardware_summary("cuda", 2) and run.hardware()["device_name"] == A100
    bad_run = Run("x", {"a": 1}, device="cuda", in_process=True, label="the bad run")
    bad = Experiment("x", "99", SimpleNamespace, lambda s, m, p: [bad_run])
    with pytest.raises(LabError, match=r"^The plan marks the bad run in_process on a GPU: [^\n]*\.$"):
        measure(lab_for(store, "cuda", 2), bad, SimpleNamespace(), verbose=False, machine=Machine(gpus=2))


def test_a_worker_without_a_process_group_drives_the_gpus(fake_gpu, monkeypatch, tmp_path):
    """DataParallel's one process (no process group): serve gives its job the GPU as the device."""
    import json

    from lab_utils.engine import harness

    fake_gpu(count=2, name=A100)
    seen = []

    def execute(worker, job, ctx):
        seen.append(ctx.device)
        return iter([])

    monkeypatch.setattr(harness, "execute", execute)
    monkeypatch.delenv("LAB_RANK_LOG_DIR", raising=False)
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"experiment": "scaling", "profile": "quick", "configs": [],
                               "options": {"process_group": False}}))
    assert harness.serve(harness, [str(job)]) == 0
    assert seen == [torch.device("cuda")]


# --------------------------------------------------------------------------- the inventory


def test_every_cuda_branch_is_in_the_inventory_and_nothing_else():
    """tests/gpu_branches.py lists exactly the decision sites the scanner finds in lab_utils/."""
    found = {s.key for s in inventory.scan()}
    listed = {b.key for b in inventory.INVENTORY}
    assert not found - listed, "not in the inventory: " + "; ".join(map(str, sorted(found - listed)))
    assert not listed - found, "no longer in the code: " + "; ".join(map(str, sorted(listed - found)))
    assert len(listed) == len(inventory.INVENTORY)


def test_every_branch_names_an_existing_test_or_a_reason_and_a_doctor_check():
    from lab_utils.app import doctor

    for b in inventory.INVENTORY:
        if b.test:
            file, _, name = b.test.partition("::")
            path = TESTS / file
            assert path.exists() and f"def {name}(" in path.read_text(), b.test
        else:
            assert b.reason in inventory.REASONS and b.doctor in doctor.BY_NAME, b
        assert b.what, b


def test_every_mutant_is_planted_in_its_site_and_every_site_has_one_or_a_doctor_check():
    """tests/gpu_mutants.py against the code: each mutant names an inventoried, tested CUDA-only site, its
    original text occurs exactly once in that file (so tools/mutants.py plants it there), and every
    CUDA-only site has a mutant, or no test and a doctor check."""
    from gpu_mutants import MUTANTS

    sites = {b.key: b for b in inventory.INVENTORY}
    for m in MUTANTS:
        assert m.site in sites, f"{m.ident}: not an inventoried site {m.site}"
        b = sites[m.site]
        assert b.cuda_only and b.test, f"{m.ident}: its site is not a tested CUDA-only site"
        text = (inventory.PKG / m.file).read_text()
        assert text.count(m.original) == 1, f"{m.ident}: its original occurs {text.count(m.original)} times"
        assert m.mutated != m.original and m.models, m.ident
        for t in inventory.tests_of(m):
            file, _, name = t.partition("::")
            assert f"def {name}(" in (TESTS / file).read_text(), f"{m.ident}: no test {t}"
    assert len({m.ident for m in MUTANTS}) == len(MUTANTS)
    mutated = {m.site for m in MUTANTS}
    for b in inventory.INVENTORY:
        if b.cuda_only:
            assert (b.key in mutated) if b.test else bool(b.doctor), f"{b.key}: no mutant and no doctor check"


def test_the_target_is_met_and_the_markdown_is_current():
    """At least 95 % of the mutants killed at the last `make mutants` (a mutant changed since counts as not
    killed), and tests/GPU_BRANCHES.md is what the inventory, the mutants and the verdicts give."""
    c = inventory.mutant_counts()
    assert c["killed"] >= 0.95 * c["mutants"], (c, "run `make mutants`")
    md = (TESTS / "GPU_BRANCHES.md").read_text()
    assert md == inventory.markdown(), "regenerate: python tests/gpu_branches.py > tests/GPU_BRANCHES.md"


@pytest.mark.parametrize("branch", [b for b in inventory.INVENTORY if b.cuda_only and not b.test],
                         ids=lambda b: f"{b.file}:{b.function}#{b.occurrence}")
def test_a_site_left_to_the_doctor_is_run_by_its_check(branch, monkeypatch, tmp_path, fake_gpu):
    """The doctor check a site is left to really runs that site's code: it launches the site's worker, or
    calls its function in-process (on this CPU the check is stopped there, with a launcher that records
    what it starts)."""
    import importlib

    from lab_utils.app import doctor, doctor_checks, doctor_experiments
    from lab_utils.engine import launcher

    class Reached(Exception):
        pass

    check = doctor.BY_NAME[branch.doctor]
    module = "lab_utils." + branch.file.removesuffix(".py").replace("/", ".")
    reached = []

    def launch(mod, args, nproc=2, **kw):
        if mod == module:
            reached.append(mod)
            raise Reached
        rec = Record("doctor", {"record": "aggregate", "size_bytes": 1},
                     {"busbw_gb_per_s": 1.0, "correct": True, "world_size": 2})
        return launcher.LaunchResult(records=[rec], log_dir=tmp_path, wall_seconds=0.0)

    # what lab_utils.engine.plan.measure launches through (experiment rows)
    def stream(mod, job, nproc=2, **kw):
        yield from launch(mod, job, nproc, **kw).records

    monkeypatch.setattr(launcher, "launch", launch)
    monkeypatch.setattr(launcher, "stream", stream)
    # not a torchrun worker (lab_utils.experiments.*.*worker): run in-process: stop at the site's function
    if not module.endswith("worker"):
        mod = importlib.import_module(module)
        top = branch.function.split(".")[0]

        def called(*a, **k):
            reached.append(top)
            raise Reached

        monkeypatch.setattr(mod, top, called)
    m = doctor_checks.Machine(gpus=2, names=["G", "G"], mig=[], driver="1", problem=None, profile="full")
    # a registered experiment's row:
    if getattr(check.measure, "func", None) is doctor_experiments.measure_experiment:
        fake_gpu(count=2)  # its plan names the GPUs (nvidia-smi, no CUDA context) for the reuse check
    with pytest.raises(Reached):
        check.measure(m, **({"timeout_s": 60} if check.where == "launch" else {"device": "cpu"}))
    assert reached


def test_the_scanner_finds_flags_negations_and_nested_functions(tmp_path):
    code = '''
import torch
def f(device, x):
    cuda = device.type == "cuda"
    nb = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    if device.type != "cuda":
        return 1
    y = 2
    def inner():
        if cuda:
            return 3
    return x.to(device, non_blocking=nb) if x else [g for g in range(3) if gpus]
'''
    (tmp_path / "m.py").write_text(code)
    sites = {(s.function, s.condition, s.kind): s for s in inventory.scan(tmp_path)}
    assert set(sites) == {("f", "cuda", "if"), ("f", "device.type != 'cuda'", "if"), ("f", "gpus", "expr"),
                          ("f", "torch.cuda.is_available()", "flag"), ("f.inner", "cuda", "if"),
                          ("f", "torch.cuda.synchronize()", "sync")}
    assert sites[("f", "cuda", "if")].arm_line == 7
    negated = sites[("f", "device.type != 'cuda'", "if")]
    assert negated.arm_line == 10 and negated.negated


def test_the_scanner_finds_the_lines_whose_effect_exists_only_on_a_gpu(tmp_path):
    """Issue 49: synchronizes, event records, peak resets, device indices and peak-table rows are sites
    wherever they are, an if's arm or not; a record() of something else is not."""
    code = '''
import torch
PEAK_TFLOPS = [("X1", {"fp32": 1.0}), ("X2", {"fp32": 2.0})]
_LANE_GB_PER_S = {1: 0.25}
PEAK_FRACTION = 0.3
def timer(device, local_rank, ledger):
    synchronize(device)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    torch.cuda.reset_peak_memory_stats(device)
    dev = torch.device("cuda", local_rank)
    torch.cuda.set_device(dev)
    run(device_ids=[local_rank])
    _sync(device)
    synchronize(device)
def other(ledger):
    ledger.record()
    torch.device("cuda")
'''
    (tmp_path / "m.py").write_text(code)
    sites = {(s.function, s.condition, s.occurrence): s.kind for s in inventory.scan(tmp_path)}
    assert sites == {
        ("<module>", "PEAK_TFLOPS['X1']", 1): "peak", ("<module>", "PEAK_TFLOPS['X2']", 1): "peak",
        ("<module>", "_LANE_GB_PER_S[1]", 1): "peak",
        ("timer", "synchronize(device)", 1): "sync", ("timer", "synchronize(device)", 2): "sync",
        ("timer", "_sync(device)", 1): "sync", ("timer", "ev.record()", 1): "event",
        ("timer", "torch.cuda.reset_peak_memory_stats(device)", 1): "reset",
        ("timer", "torch.device('cuda', local_rank)", 1): "device",
        ("timer", "torch.cuda.set_device(dev)", 1): "device",
        ("timer", "device_ids=[local_rank]", 1): "device"}


def test_host_to_device_copies_are_non_blocking_on_a_gpu(fake_gpu, monkeypatch):
    """The training loop, the evaluation loop and the fast path copy host batches with non_blocking=True on
    a GPU (from pinned memory the copy then overlaps the previous step). The fake GPU's tensor factories
    let the loops run with device cuda on CPU tensors and record each copy's flag."""
    from lab_utils.experiments.n08_speed_limits import fast_train

    gpu = fake_gpu().tensors_on_device(monkeypatch)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(4, 3, 2, 2), torch.randint(0, 3, (4,))) for _ in range(2)]
    dev = torch.device("cuda", 0)
    rec = loop.run_epoch(model, batches, opt, dev)
    assert rec.steps == 2 and gpu.copies == [(0, True)] * 4          # x and y of each batch
    gpu.copies.clear()
    ev = evaluation.evaluate(model, batches, dev)
    assert ev.images == 8 and gpu.copies == [(0, True)] * 4
    gpu.copies.clear()
    fast_train.to_device(*batches[0], dev, channels_last=False)
    assert gpu.copies == [(0, True)] * 2
    gpu.copies.clear()
    loop.run_epoch(model, batches, opt, torch.device("cpu"))
    assert gpu.copies == []                                          # the CPU: no copy to a GPU


# --------------------------------------------------------------------------- GPU lines (issue 49): timed work


class Busy(nn.Module):
    """A model whose forward queues ``seconds`` of work on the fake GPU's current stream (its kernels)."""

    def __init__(self, gpu, seconds: float, features: int = 12, classes: int = 3):
        super().__init__()
        self.gpu, self.seconds = gpu, seconds
        self.fc = nn.Linear(features, classes)

    def forward(self, x):
        self.gpu.launch(self.seconds)
        return self.fc(x.flatten(1))


def _batches(n: int, batch: int = 4, features: int = 12) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, features, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(n)]


def test_phase_timers_time_exactly_the_device_work_inside(fake_gpu, one_rank, monkeypatch):
    """A phase on a rank's GPU 1 holds its own queued work, none queued before it (1 s pending on that
    GPU), the all-reduce NCCL runs on its own stream inside it (a device synchronize waits for every
    stream), and each loader batch's kernels (iterate)."""
    gpu = fake_gpu(count=2, collective_seconds=0.004).nccl_streams(monkeypatch)
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)
    labdist.init_distributed("gloo")
    torch.cuda.set_device(1)
    timer = timing.PhaseTimer(torch.device("cuda", 1))
    gpu.launch(1.0)                                   # earlier work still running on the rank's GPU
    with timer.phase("compute"):
        gpu.launch(0.020)
    assert timer.seconds("compute") == pytest.approx(0.020)
    with timer.phase("communication"):               # an all-reduce in flight: NCCL's stream
        dist.all_reduce(torch.ones(3), async_op=True)
    assert timer.seconds("communication") == pytest.approx(0.004)

    def loader():
        for _ in range(2):
            gpu.launch(0.005)                         # the batch's augmentation kernels
            yield "batch"

    gpu.launch(0.5)                                   # the last step's work, not the loader's
    for _ in timer.iterate(loader()):
        gpu.launch(0.5)                               # each step's, not the next batch's either
    assert timer.seconds("data_loading") == pytest.approx(0.010)
    nested = timing.NestedTimers(torch.device("cuda", 1))
    gpu.launch(2.0)
    with nested("epoch"):
        gpu.launch(0.1)
    assert nested.stats["epoch"].total_seconds == pytest.approx(0.1)


def test_an_epoch_and_an_evaluation_time_exactly_their_device_work(fake_gpu, monkeypatch):
    """The fast path's epoch (timed=False: synchronized at its two ends only) and the evaluation loop on
    a GPU: 10 ms of kernels per forward, 1 s of earlier work pending; their seconds are the forwards'."""
    gpu = fake_gpu().tensors_on_device(monkeypatch)
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)
    torch.manual_seed(0)
    model = Busy(gpu, 0.010)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dev = torch.device("cuda", 0)
    gpu.launch(1.0)
    rec = loop.run_epoch(model, _batches(3), opt, dev, timed=False)
    assert rec.epoch_seconds == pytest.approx(0.030)
    gpu.launch(1.0)
    ev = evaluation.evaluate(model, _batches(2), dev)
    assert ev.seconds == pytest.approx(0.020)


def test_an_epoch_reports_each_gpus_peak_of_that_epoch(fake_gpu, monkeypatch):
    """DataParallel on GPUs 0 and 1: each GPU's peak is reset before the epoch, so an earlier 5 GiB
    peak on GPU 1 is not this epoch's 1 GiB."""
    gpu = fake_gpu(count=2).tensors_on_device(monkeypatch)
    gpu.allocate(5 * 2 ** 30, 1)
    gpu.release(5 * 2 ** 30, 1)                       # an earlier batch's peak on GPU 1
    torch.manual_seed(0)
    dp = nn.DataParallel(nn.Linear(12, 3), device_ids=[0, 1])

    def forward(x):                                   # each replica's activations (no CUDA here)
        held = [gpu.tensor(2 ** 29, 0), gpu.tensor(2 ** 30, 1)]
        del held
        return dp.module(x)

    dp.forward = forward
    rec = loop.run_epoch(dp, _batches(2), torch.optim.SGD(dp.parameters(), lr=0.1), torch.device("cuda", 0))
    assert rec.peak_memory_bytes_per_device == [2 ** 29, 2 ** 30]


def test_dataparallel_gets_the_gpus_it_is_given(fake_gpu, monkeypatch):
    """Notebook 02's DataParallel row on 2 of a node's 4 GPUs: the model is replicated on GPUs 0 and 1,
    not on every visible GPU."""
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n02_scaling import ddp_worker as ddp
    from lab_utils.experiments.n02_scaling import dp_worker as dataparallel

    fake_gpu(count=4).tensors_on_device(monkeypatch)
    assert devices.wrap_data_parallel(nn.Linear(2, 2), device_ids=[0, 1]).device_ids == [0, 1]
    given = []

    class Wrapped(Exception):
        pass

    def wrap(model, device_ids=None):
        given.append(device_ids)
        raise Wrapped

    monkeypatch.setattr(dataparallel, "wrap_data_parallel", wrap)
    args = ddp.RunConfig(devices=2, backend="nccl", batch_size=2, epochs=1, width=2, train_images=8,
                         test_images=8, dataset="synthetic", num_workers=0)
    with pytest.raises(Wrapped):
        dataparallel.run_config(dataparallel.dp_config(args), Job("scaling", "quick", []), None, None)
    assert given == [[0, 1]]


def test_the_compute_step_times_its_steps_alone(fake_gpu, monkeypatch):
    """Notebook 04's compute step on a GPU: 10 ms of kernels per step, 1 s of earlier work pending and a
    warm-up step queued before the clock starts: 10 ms a step."""
    from lab_utils.experiments.n04_allreduce import compute_step_worker as compute_step

    gpu = fake_gpu().tensors_on_device(monkeypatch)
    monkeypatch.setattr(compute_step.time, "perf_counter", gpu.clock)
    monkeypatch.setattr(compute_step, "ResNet18", lambda width: Busy(gpu, 0.010, 3 * 32 * 32, 10))
    gpu.launch(1.0)
    seconds = compute_step.measure_compute_step_seconds(8, 4, "cuda:0", steps=3, warmup=1)
    assert seconds == pytest.approx(0.010)


def test_the_warm_up_times_its_steps_alone(fake_gpu, monkeypatch):
    from lab_utils.experiments.n08_speed_limits import fast_train

    gpu = fake_gpu().tensors_on_device(monkeypatch)
    monkeypatch.setattr(fast_train.time, "perf_counter", gpu.clock)
    model = Busy(gpu, 0.010)
    trainer = fast_train.Trainer(model, model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 fast_train.TrainOptions(), torch.device("cuda", 0))
    gpu.launch(1.0)
    assert fast_train.warm_up(trainer, _batches(3), 2) == pytest.approx(0.020)
    gpu.launch(1.0)
    assert fast_train.warm_up(trainer, _batches(3), 1, remainder=2) == pytest.approx(0.030)   # + 2 steps


def test_the_loader_benchmark_times_its_batches_alone(fake_gpu, monkeypatch):
    """Notebook 08's loader benchmark on a GPU: each batch's kernels (5 ms) are its time; the untimed first
    batch and earlier work are not."""
    from lab_utils.experiments.n08_speed_limits import worker as fastpath

    gpu = fake_gpu()
    monkeypatch.setattr(fastpath.time, "perf_counter", gpu.clock)

    class Loader:
        def __iter__(self):
            for _ in range(4):
                gpu.launch(0.005)
                yield torch.zeros(8, 1), torch.zeros(8)

    gpu.launch(1.0)
    m = fastpath.time_loader(Loader(), torch.device("cuda", 0))
    assert (m["loader_images"], m["passes"]) == (32, 1)
    assert m["seconds"] == pytest.approx(0.020) and m["loader_images_per_s"] == pytest.approx(1600.0)


def test_a_waterfall_rows_peak_memory_is_its_epochs(fake_gpu, monkeypatch):
    """The warm-up (compilation, the allocator's growth) may peak higher than the timed epoch: the row's
    peak_memory_bytes is the epoch's, after a reset."""
    from lab_utils.engine.harness import Job
    from lab_utils.experiments.n08_speed_limits import worker as fastpath
    from lab_utils.experiments.n08_speed_limits.fast_train import TrainOptions
    from lab_utils.learn.epoch_record import EpochRecord

    gpu = fake_gpu(name=A100)
    held = []

    def warm_up(trainer, loader, steps, remainder=0):
        held.append(gpu.tensor(6 * 2 ** 30))          # the warm-up's temporary peak
        held.clear()
        return 1.0

    class Trainer:
        onednn_workaround = None

        def epoch(self, loader):
            gpu.tensor(2 ** 30)                       # the epoch's activations
            return EpochRecord(epoch=1, images=64, steps=2, epoch_seconds=0.5, train_seconds=None,
                               data_loading_seconds=0.0, data_movement_seconds=0.0, compute_seconds=0.0,
                               communication_seconds=0.0, images_per_s=None, loss=2.3, accuracy=0.1,
                               peak_memory_bytes=None, lr=0.1)

    monkeypatch.setattr(fastpath, "warm_up", warm_up)
    monkeypatch.setattr(fastpath, "_trainer_and_loader", lambda *a: (Trainer(), None))
    c = {"width": 4, "batch_size": 32, "warmup_steps": 1, **TrainOptions(loader="device").as_config()}
    m = fastpath.timed_epoch(TrainOptions(loader="device"), c, Job("bench_train", "quick", [c]), [0] * 64,
                             torch.device("cuda", 0))   # a split of 64 images
    assert m["peak_memory_bytes"] == 2 ** 30


def test_allreduce_worker_times_its_all_reduces_on_the_ranks_gpu(fake_gpu, one_rank, monkeypatch):
    """The benchmark on a rank of GPU 1: 4 ms per all-reduce on its NCCL stream, the warm-up's excluded."""
    from lab_utils.experiments.n04_allreduce import allreduce_worker as allreduce_bench

    gpu = fake_gpu(count=2, collective_seconds=0.004).gloo_for_nccl(monkeypatch)
    monkeypatch.setattr(allreduce_bench.time, "perf_counter", gpu.clock)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    ctx = labdist.init_distributed("nccl")
    assert ctx.device == torch.device("cuda", 1)
    m = allreduce_bench.measure_size(2 ** 20, 5, 3, ctx.device, 0, 1)
    assert m["time_us"] == pytest.approx(4000.0) and m["time_us_min_rank"] == pytest.approx(4000.0)
    assert m["algbw_gb_per_s"] == pytest.approx(2 ** 20 / 0.004 / 1e9)


def test_interleaved_decoding_times_each_model_alone(fake_gpu, monkeypatch):
    """Notebook 07's decoding times on a GPU: each model's kernels (10 ms, 30 ms) are its repetition's time,
    whatever ran before it."""
    from lab_utils.experiments.n07_quantization import quant_timing

    gpu = fake_gpu().tensors_on_device(monkeypatch)
    cost = {"fp32": 0.010, "int8": 0.030}
    monkeypatch.setattr(quant_timing, "greedy_decode", lambda m, p, n, b: gpu.launch(cost[m]))
    gpu.launch(1.0)
    prompts = torch.zeros(1, 4, dtype=torch.long)
    out = quant_timing.time_interleaved({"fp32": "fp32", "int8": "int8"}, prompts, 2, 8, "cuda:0", warmup=1,
                                        repeats=3, clock=gpu.clock)
    assert out["fp32"].seconds == pytest.approx([0.010] * 3)
    assert out["int8"].seconds == pytest.approx([0.030] * 3)


def test_a_hand_made_replicas_step_is_timed_from_the_barrier_to_its_end(fake_gpu, one_rank, monkeypatch):
    """Notebook 09's timed step on a GPU: the barrier's all-reduce (5 ms on NCCL's stream) is over before
    the clock starts, and the step's kernels (10 ms) are in it."""
    from lab_utils.experiments.n09_build_ddp import worker as handmade_ddp

    gpu = fake_gpu(count=1, collective_seconds=0.005).gloo_for_nccl(monkeypatch)
    monkeypatch.setattr(handmade_ddp.time, "perf_counter", gpu.clock)
    ctx = labdist.init_distributed("nccl")
    replica = SimpleNamespace(step=lambda batch, device: gpu.launch(0.010) or torch.zeros(()))
    seconds, _ = handmade_ddp.Replica.timed_step(replica, None, ctx.device)
    assert seconds == pytest.approx(0.010)


def test_the_no_sync_probe_on_a_gpu_measures_the_exposed_all_reduce(fake_gpu, one_rank, monkeypatch):
    """(b) and (c) where the answer is known: a forward of 10 ms, one bucket whose all-reduce takes 3 ms on
    NCCL's stream after it, nothing to hide it behind: sync steps 13 ms, no_sync steps 10 ms, (b) = (c) =
    3 ms, no overlap."""
    from lab_utils.learn.comm_hooks import AllReduceTimer
    from lab_utils.learn.comm_probe import probe_exposed_comm

    gpu = fake_gpu(collective_seconds=0.003).nccl_streams(monkeypatch)
    monkeypatch.setattr(timing.time, "perf_counter", gpu.clock)
    labdist.init_distributed("gloo")
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(Busy(gpu, 0.010))
    timer = AllReduceTimer(OnTheGPU(ddp))
    probe = probe_exposed_comm(ddp, _batches(4), timer, warmup=1)
    assert probe.sync_step_seconds == pytest.approx(0.013)
    assert probe.nosync_step_seconds == pytest.approx(0.010)
    assert probe.exposed_per_step_seconds == pytest.approx(0.003)
    assert probe.allreduce_per_step_seconds == pytest.approx(0.003) and probe.buckets == 1
    assert probe.overlap_per_step_seconds == pytest.approx(0.0, abs=1e-9)


def test_memory_use_resets_the_measured_gpus_peak(fake_gpu):
    """Notebook 09's memory of an implementation on a rank's GPU 1 (GPU 0 current): the 8 MiB spike of the
    build is not the measured step's peak (1 MiB kept + 3 MiB of temporaries)."""
    from lab_utils.experiments.n09_build_ddp import replica_memory

    gpu = fake_gpu(count=2)
    dev = torch.device("cuda", 1)

    def build():
        spike = gpu.tensor(8 * 2 ** 20, 1)
        del spike
        return [gpu.tensor(2 ** 20, 1)]

    def step(held):
        temporary = gpu.tensor(3 * 2 ** 20, 1)
        del temporary

    use, _ = replica_memory.memory_use(build, step, dev)
    assert (use.held_bytes, use.peak_bytes) == (2 ** 20, 4 * 2 ** 20) and torch.cuda.current_device() == 0
