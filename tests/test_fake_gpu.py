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

from lab_utils.core import dist as labdist


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
             "nccl": "Cuda failure 2 'out of memory'"}
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
