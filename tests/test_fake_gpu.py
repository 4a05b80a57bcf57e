"""The fake GPU (tests/fake_gpu.py) behaves like a GPU where the lab's bugs would hide.

Each test states a property of real CUDA / torch / NCCL that a bug in the lab would run into
(syncing the wrong device, an event on another device, a cap on reserved bytes, cuDNN's and
NCCL's words for out of memory, NCCL refusing a CPU tensor) and checks that the fake has it,
so that the tests built on it can fail for those bugs.
"""

from __future__ import annotations

import subprocess

import pytest
import torch
import torch.distributed as dist
from fake_gpu import ARCHS_CU126, GIB, MIB, OOM_STYLES, FakeGPU

from lab_utils.engine import dist as labdist
from lab_utils.learn.errors import LabError


def test_each_device_has_its_own_streams_and_synchronize_waits_for_one_device(fake_gpu):
    gpu = fake_gpu(count=2)
    gpu.launch(0.5, device=1)
    gpu.launch(0.1, device=0)
    t0 = gpu.clock.now
    torch.cuda.synchronize(0)                       # GPU 0's 0.1 s only
    assert gpu.clock.now - t0 == pytest.approx(0.1)
    torch.cuda.synchronize(1)
    assert gpu.clock.now - t0 == pytest.approx(0.5)
    side = torch.cuda.Stream(1)                     # a second stream on GPU 1 runs independently
    with torch.cuda.stream(side):
        assert torch.cuda.current_device() == 1 and torch.cuda.current_stream() is side
        gpu.launch(0.3)
    assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(1) is not side
    main = torch.cuda.current_stream(1)
    main.wait_stream(side)                          # later work on the main stream waits for side's
    gpu.launch(0.1, device=1)
    assert main.busy_until == pytest.approx(side.busy_until + 0.1)


def test_events_belong_to_their_stream_and_device(fake_gpu):
    gpu = fake_gpu(count=2)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    gpu.launch(0.2, device=0)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) == pytest.approx(200.0)          # milliseconds
    other = torch.cuda.Event(enable_timing=True)
    other.record(torch.cuda.current_stream(1))                      # recorded on GPU 1
    with pytest.raises(RuntimeError, match="invalid resource handle"):
        start.elapsed_time(other)
    side = torch.cuda.Stream(0)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(side)
    gpu.launch(0.4, device=0)                                       # on the default stream, not side
    b.record(side)
    assert a.elapsed_time(b) == pytest.approx(0.0)                  # side had nothing queued
    late = torch.cuda.Event(enable_timing=True)
    gpu.launch(1.0)
    late.record()
    with pytest.raises(RuntimeError, match="device not ready"):
        start.elapsed_time(late)
    with pytest.raises(RuntimeError, match="enable_timing"):
        torch.cuda.Event().elapsed_time(end)


def test_reserved_memory_and_a_cap_on_it(fake_gpu):
    gpu = fake_gpu(total_memory=100 * MIB)
    small = [gpu.tensor(600 * 1024) for _ in range(3)]              # one 2 MiB segment holds three
    assert torch.cuda.memory_reserved() == 2 * MIB and torch.cuda.memory_allocated() == 3 * 600 * 1024
    medium = gpu.tensor(2 * MIB)                                    # medium blocks come in 20 MiB segments
    assert torch.cuda.memory_reserved() == 22 * MIB
    del medium, small
    assert torch.cuda.memory_allocated() == 0 and torch.cuda.memory_reserved() == 22 * MIB  # cached
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() == 0 and torch.cuda.max_memory_reserved() == 22 * MIB
    # Fragmentation: 8 MiB is allocated under a 30 MiB cap, yet 14 MiB more do not fit, because the
    # cap holds reserved bytes: the freed 8 MiB are cached in a segment a 14 MiB block does not fit in.
    torch.cuda.set_per_process_memory_fraction(0.3)
    a, b = gpu.tensor(8 * MIB), gpu.tensor(8 * MIB)                # both in one 20 MiB segment
    del a
    assert (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) == (8 * MIB, 20 * MIB)
    with pytest.raises(torch.OutOfMemoryError, match="GPU 0 has a total capacity of 0.10 GiB") as e:
        gpu.tensor(14 * MIB)
    assert "0.01 GiB is reserved by PyTorch but unallocated" in str(e.value)
    del b
    assert gpu.tensor(14 * MIB) is not None                         # the empty segment is given back first


@pytest.mark.parametrize("style", sorted(OOM_STYLES))
def test_every_out_of_memory_error_on_request(fake_gpu, style):
    gpu = fake_gpu(total_memory=8 * GIB, oom_style=style)
    with pytest.raises(Exception) as e:
        gpu.allocate(9 * GIB)
    expected = {"allocator": torch.OutOfMemoryError, "nccl": torch.distributed.DistBackendError}
    assert type(e.value) is expected.get(style, RuntimeError)
    words = {"allocator": "CUDA out of memory. Tried to allocate 9.00 GiB",
             "cudnn_find": "FIND was unable to find an engine", "cudnn_algo": "Unable to find a valid cuDNN",
             "nccl": "Cuda failure 2 'out of memory'", "cublas_init": "CUBLAS_STATUS_NOT_INITIALIZED",
             "cudnn_init": "CUDNN_STATUS_NOT_INITIALIZED"}
    assert words[style] in str(e.value)
    assert torch.cuda.memory_allocated() == 0                      # nothing was held


def test_nccl_collectives_refuse_cpu_tensors(fake_gpu, one_rank, monkeypatch):
    gpu = fake_gpu(count=2).gloo_for_nccl(monkeypatch)
    ctx = labdist.init_distributed("nccl")
    assert ctx.device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="Tensors must be CUDA"):
        dist.all_reduce(torch.ones(2))                               # a CPU tensor: NCCL says no
    t = torch.tensor([1.0, 2.0], device=ctx.device)                  # made on the GPU
    dist.all_reduce(t)
    assert gpu.device_of(t) == 0 and t.tolist() == [1.0, 2.0]
    moved = torch.ones(3).to(ctx.device, non_blocking=True)
    dist.broadcast(moved, 0)
    assert gpu.collectives == ["all_reduce", "broadcast"] and gpu.device_of(torch.ones(1)) is None


def test_nvidia_smi_reports_compute_capability_and_mode_and_torch_its_build(tmp_path, monkeypatch):
    gpu = FakeGPU(count=2, name="Tesla V100-SXM2-16GB", major=7, compute_mode="Exclusive_Process")
    gpu.patch(monkeypatch)
    gpu.install_nvidia_smi(tmp_path, monkeypatch)
    query = ["nvidia-smi", "--query-gpu=index,compute_cap,compute_mode", "--format=csv,noheader"]
    out = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout
    assert out.splitlines() == ["0, 7.0, Exclusive_Process", "1, 7.0, Exclusive_Process"]
    assert torch.cuda.get_arch_list() == list(ARCHS_CU126) and not gpu.initialized


# --------------------------------------------------------------------------- NCCL's streams (issue 49)


def test_a_collective_runs_on_the_nccl_stream_and_the_host_does_not_wait(fake_gpu, one_rank, monkeypatch):
    """ProcessGroupNCCL queues a collective on its own stream, after the current stream's work, and
    returns; work.wait(), a Future's wait() and then() order streams, not the host; only a synchronize
    (or NCCL's barrier) blocks the host."""
    gpu = fake_gpu(count=2, collective_seconds=0.005).gloo_for_nccl(monkeypatch)
    ctx = labdist.init_distributed("nccl")
    t = torch.ones(4, device=ctx.device)
    start = gpu.clock.now
    gpu.launch(0.010)                                          # compute queued before the all-reduce
    work = dist.all_reduce(t, async_op=True)
    assert gpu.clock.now == start and not work.is_completed()  # returned at once
    assert gpu.nccl_stream(0).busy_until == pytest.approx(start + 0.015)   # after the compute
    assert work.wait() and gpu.clock.now == start              # wait(): the current stream waits
    assert torch.cuda.current_stream().busy_until == pytest.approx(start + 0.015)
    fut = dist.all_reduce(t, async_op=True).get_future()

    def finished(f):
        end = torch.cuda.Event(enable_timing=True)
        end.record()                                           # on the callback's stream
        return end, f.value()

    end, value = fut.then(finished).wait()                     # a real (completed) torch Future
    assert end.at == pytest.approx(start + 0.020) and value == [t] and gpu.clock.now == start
    dist.all_reduce(t)                                         # synchronous: the stream waits, not the host
    assert gpu.clock.now == start
    torch.cuda.synchronize(0)
    assert gpu.clock.now == pytest.approx(start + 0.025)       # three collectives of 5 ms after 10 ms
    gpu.launch(0.002)
    dist.barrier(device_ids=[0])                               # NCCL's barrier blocks the host
    assert gpu.clock.now == pytest.approx(start + 0.032)
    assert gpu.collectives == ["all_reduce"] * 3 + ["barrier"]


def test_a_collective_timed_without_a_synchronize_reads_short(fake_gpu, one_rank, monkeypatch):
    """The bug the NCCL stream models: the all-reduce benchmark's clock stopped without synchronizing
    the device reads the launch, not the all-reduce (before the fake had NCCL streams both read 0)."""
    from lab_utils.experiments.n04_allreduce import allreduce_worker as allreduce_bench

    gpu = fake_gpu(count=1, collective_seconds=0.004).gloo_for_nccl(monkeypatch)
    monkeypatch.setattr(allreduce_bench.time, "perf_counter", gpu.clock)
    ctx = labdist.init_distributed("nccl")
    good = allreduce_bench.measure_size(2 ** 20, 5, 2, ctx.device, 0, 1)
    assert good["time_us"] == pytest.approx(4000.0) and good["correct"]
    monkeypatch.setattr(allreduce_bench, "_sync", lambda device: None)   # the bug
    with pytest.raises(LabError, match="time in seconds must be a finite number above 0, got 0.0"):
        allreduce_bench.measure_size(2 ** 20, 5, 2, ctx.device, 0, 1)   # 0 s per all-reduce


# --------------------------------------------------------------------------- first-call costs


def test_the_first_call_of_each_shape_dtype_and_layout_costs_time_once(fake_gpu):
    """cuDNN's benchmark search and the allocator's first blocks: paid once per (shape, dtype, layout)."""
    gpu = fake_gpu(first_call_seconds=0.25)
    conv = torch.nn.Conv2d(3, 4, 3)
    start = gpu.clock.now
    conv(torch.ones(2, 3, 8, 8))
    conv(torch.ones(2, 3, 8, 8))                               # the same key: free
    assert gpu.clock.now - start == pytest.approx(0.25)
    conv(torch.ones(1, 3, 8, 8))                               # a partial batch: a new shape
    conv(torch.ones(2, 3, 8, 8).contiguous(memory_format=torch.channels_last))   # a new layout
    with torch.autocast("cpu", dtype=torch.bfloat16):
        conv(torch.ones(2, 3, 8, 8))                           # a new dtype (autocast's)
    assert gpu.clock.now - start == pytest.approx(1.0) and len(gpu.first_calls) == 4


def test_a_warm_up_that_misses_a_shape_shows_in_the_timed_epoch(fake_gpu, monkeypatch):
    """The bug the first-call cost models: the fast path's warm-up without the last, partial batch puts
    that shape's search in the timed epoch (the fast path warms it: tests/test_gpu_numbers.py)."""
    from lab_utils.experiments.n08_speed_limits import fast_train
    from lab_utils.experiments.shared import data

    gpu = fake_gpu(first_call_seconds=0.5)
    monkeypatch.setattr(fast_train.time, "perf_counter", gpu.clock)
    trainer = fast_train.build_trainer(fast_train.TrainOptions(loader="device"), 2, "cpu")
    loader = data.device_loader(data.ArraySplit(*data.synthetic_arrays(12, True), synthetic=True),
                                torch.device("cpu"), 8, seed=0)
    fast_train.warm_up(trainer, loader, 1)                     # the bug: the 4-image batch is not warmed
    assert trainer.epoch(loader).epoch_seconds > 0
    fast_train.warm_up(trainer, loader, 1, remainder=4)
    assert trainer.epoch(loader).epoch_seconds == 0.0


# --------------------------------------------------------------------------- processes, visible devices, MIG


def test_exclusive_process_mode_refuses_a_second_context_on_an_occupied_gpu(fake_gpu):
    """CUDA's EXCLUSIVE_PROCESS: one context per GPU. The bug it models: a notebook kernel that opened a
    context on GPU 0 before launching its ranks (the rank on GPU 0 then cannot start)."""
    from fake_gpu import BUSY

    gpu = fake_gpu(count=2, compute_mode="Exclusive_Process")
    with gpu.process("rank 0"):
        torch.cuda.set_device(0)                               # nobody holds GPU 0: fine
    torch.cuda.get_device_properties(0)                        # this process (the kernel) opens GPU 0
    with gpu.process("rank 1"):
        torch.cuda.set_device(1)                               # another GPU: fine
        torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="busy or unavailable") as e, gpu.process("rank 0"):
        torch.cuda.set_device(0)
    assert str(e.value) == BUSY and gpu.contexts == {0} and gpu.process_name == "this process"
    shared = fake_gpu(count=1)                                 # the default mode shares a GPU
    shared._lazy_init()
    with shared.process("rank 0"):
        torch.cuda.set_device(0)
    with pytest.raises(RuntimeError, match="busy"):
        fake_gpu(count=1, compute_mode="Prohibited")._lazy_init()


def test_device_count_follows_cuda_visible_devices_and_mig_is_one_device_per_process(fake_gpu, monkeypatch):
    gpu = fake_gpu(count=4)
    assert torch.cuda.device_count() == 4
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert torch.cuda.device_count() == 2 and gpu.visible() == [2, 3]
    with pytest.raises(RuntimeError, match="invalid device ordinal"):
        torch.cuda.get_device_properties(2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{gpu.gpu_uuid(3)[:12]},0,9,1")   # stops at the bad entry
    assert gpu.visible() == [3, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not torch.cuda.is_available()
    mig = fake_gpu(count=2, name="NVIDIA A100-SXM4-40GB", mig="3g.20gb")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert torch.cuda.device_count() == 1                      # two slices listed, one enumerated
    assert torch.cuda.get_device_name(0) == "NVIDIA A100-SXM4-40GB MIG 3g.20gb"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{mig.mig_uuid(1)},{mig.mig_uuid(0)}")
    assert mig.visible() == [1]


def test_two_mig_slices_are_not_two_gpus_for_the_lab(fake_gpu):
    """The bug one MIG device per process models: counting nvidia-smi's slices as GPUs would plan NCCL
    between two slices, which CUDA never shows one process together."""
    from lab_utils.engine.machine import Machine

    fake_gpu(count=2, name="NVIDIA A100-SXM4-40GB", mig="3g.20gb")
    assert Machine.here().gpus == 1 and labdist.choose_backend("auto", 2) == "gloo"


# --------------------------------------------------------------------------- nvidia-smi's queries


def test_nvidia_smi_answers_every_query_the_lab_sends_and_no_other(fake_gpu):
    """Every ``--query-gpu`` the lab's code contains is one the fake answers; an unknown one exits 2 and
    fails the test at teardown (the fixture), instead of printing a banner the parser half-reads."""
    import re
    from pathlib import Path

    from fake_gpu import SMI_QUERIES

    from lab_utils.engine import cuda_builds, hardware

    pkg = Path(hardware.__file__).resolve().parent.parent
    sent = {q for f in pkg.rglob("*.py") for q in re.findall(r'"(--query-gpu=[^"]+)"', f.read_text())}
    answered = {q.split()[0] for q in SMI_QUERIES}
    assert sent and sent <= answered, sent - answered
    gpu = fake_gpu(count=2, pcie=(3, 16))
    assert cuda_builds.query_driver().gpus[1].compute_mode == "Default"
    assert len(hardware.smi_devices()) == 2 and "GPU1" in hardware.interconnect()
    out = hardware.nvidia_smi("--query-gpu=index,pcie.link.gen.max,pcie.link.width.max",
                              "--format=csv,noheader,nounits")
    assert out.splitlines() == ["0, 3, 16", "1, 3, 16"]
    gpu.check_smi_queries()
    assert hardware.nvidia_smi("--query-gpu=pcie.link.gen.max", "--format=csv") is None   # unknown: exit 2
    with pytest.raises(AssertionError, match="--query-gpu=pcie.link.gen.max --format=csv"):
        gpu.check_smi_queries()
    (gpu._smi_dirs[0] / "unknown_queries.txt").unlink()        # (this test's own unknown query)
