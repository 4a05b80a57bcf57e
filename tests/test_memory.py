"""lab_utils.engine.memory: out-of-memory detection, cleanup outside the handler, and the GPU
memory cap (simulated on CPU by recording what torch.cuda would be called with)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from lab_utils.engine import memory
from lab_utils.learn.errors import LabError

# --------------------------------------------------------------------------- is_out_of_memory


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
])
def test_out_of_memory_is_recognised(exc):
    assert memory.is_out_of_memory(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (8x10 and 5x3)"),
    RuntimeError("CUDNN_STATUS_NOT_SUPPORTED"),
    ValueError("out of memory"),           # not an allocator's exception type
    KeyError("CUDA out of memory"),
])
def test_other_errors_are_not_out_of_memory(exc):
    assert not memory.is_out_of_memory(exc)


def test_the_cpu_allocator_failure_is_out_of_memory():
    try:
        torch.empty(1 << 62, dtype=torch.uint8)
    except RuntimeError as e:
        assert memory.is_out_of_memory(e)


def test_oom_reason_keeps_the_first_line_only():
    exc = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB\nmore details " + "x" * 500)
    assert memory.oom_reason(exc) == "OOM: CUDA out of memory. Tried to allocate 2 GiB"
    assert len(memory.oom_reason(RuntimeError("y" * 1000))) == len("OOM: ") + 300
    assert memory.oom_reason(torch.OutOfMemoryError()) == "OOM: OutOfMemoryError"


def test_log_text_of_a_failed_rank():
    assert memory.mentions_out_of_memory("rank 1: torch.OutOfMemoryError: CUDA out of memory.")
    assert memory.mentions_out_of_memory("RuntimeError: cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
    assert not memory.mentions_out_of_memory("RuntimeError: NCCL error: unhandled system error")


NCCL_OOM_LOG = (
    "[rank1]: Traceback (most recent call last):\n"
    "[rank1]: torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
    "ProcessGroupNCCL.cpp:3356, unhandled cuda error (run with NCCL_DEBUG=INFO for details), "
    "NCCL version 2.30.7\n"
    "[rank1]: ncclUnhandledCudaError: Call to CUDA function failed.\n[rank1]: Last error:\n"
    "[rank1]: Cuda failure 2 'out of memory'\n")


NO_HANDLE = "its handle could not be created, no memory left"


@pytest.mark.parametrize("style, which", [("allocator", None), ("cudnn_find", "cuDNN: no algorithm fits"),
                                          ("cudnn_algo", "cuDNN: no algorithm fits"),
                                          ("nccl", "NCCL: a CUDA allocation failed"),
                                          ("cublas_init", f"cuBLAS: {NO_HANDLE}"),
                                          ("cudnn_init", f"cuDNN: {NO_HANDLE}")])
def test_cudnn_and_nccl_out_of_memory_are_rows_that_say_which(fake_gpu, style, which):
    """With cudnn.benchmark on, cuDNN reports memory it cannot get as "no engine / no valid algorithm";
    NCCL as "Cuda failure 2 'out of memory'" on a later line. Both are out of memory (a sweep's oom
    row, not a crash), and the reason names which (the fake GPU raises each as torch, cuDNN and NCCL do)."""
    gpu = fake_gpu(total_memory=8 * 2 ** 30, oom_style=style)
    with memory.catch_oom() as oom:
        gpu.allocate(9 * 2 ** 30)
    assert oom, style
    if which is None:
        assert oom.reason.startswith("OOM: CUDA out of memory. Tried to allocate 9.00 GiB")
    else:
        assert oom.reason.startswith(f"OOM ({which}): ")
    if style == "nccl":   # the line that says so, not NCCL's first line
        assert oom.reason == "OOM (NCCL: a CUDA allocation failed): Cuda failure 2 'out of memory'"
        assert memory.mentions_out_of_memory(NCCL_OOM_LOG)
    for other in ("Cuda failure 1 'invalid argument'", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED"):
        assert not memory.is_out_of_memory(RuntimeError(other)) and not memory.mentions_out_of_memory(other)


# --------------------------------------------------------------------------- catch_oom


def _fails_holding(refs: list, exc: BaseException):
    activations = torch.ones(256, 256)  # lives only in this frame and in the traceback
    refs.append(weakref.ref(activations))
    raise exc


def test_catch_oom_drops_the_frames_of_the_failed_call():
    refs: list = []
    with memory.catch_oom() as oom:
        _fails_holding(refs, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"))
    assert oom and oom.reason == "OOM: CUDA out of memory. Tried to allocate 1 GiB"
    # After the with statement nothing holds the tensor: not the exception, not its
    # traceback, not the catch_oom object (it kept the reason string only).
    memory.free_device_memory("cpu")
    assert refs[0]() is None
    assert not hasattr(oom, "exception") and vars(oom) == {"reason": oom.reason}


def test_cleanup_inside_except_would_still_see_the_tensor():
    """Why the cleanup belongs after the handler: inside it the traceback keeps the frame."""
    refs: list = []
    try:
        _fails_holding(refs, torch.OutOfMemoryError("CUDA out of memory."))
    except torch.OutOfMemoryError:
        gc.collect()
        alive_in_handler = refs[0]() is not None
    assert alive_in_handler
    gc.collect()
    assert refs[0]() is None


def test_catch_oom_lets_other_errors_through_and_is_false_without_error():
    with pytest.raises(RuntimeError, match="shapes"), memory.catch_oom():
        raise RuntimeError("shapes do not match")
    with memory.catch_oom() as oom:
        pass
    assert not oom and oom.reason is None


# --------------------------------------------------------------------------- memory fraction


@pytest.fixture
def fake_cuda(monkeypatch):
    """Record the arguments torch.cuda.set_per_process_memory_fraction is called with."""
    calls: list[tuple] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device=None: calls.append((fraction, device)))
    return calls


@pytest.mark.parametrize("device", [None, "cuda", torch.device("cuda")])
def test_a_device_without_index_gets_the_current_one(fake_cuda, device):
    assert memory.set_memory_fraction(0.25, device) == (0.25, torch.device("cuda", 3))
    (fraction, dev), = fake_cuda
    assert isinstance(dev, torch.device) and dev.type == "cuda" and dev.index == 3
    assert type(fraction) is float and fraction == 0.25


def test_an_indexed_device_and_an_int_fraction(fake_cuda):
    memory.set_memory_fraction(1, "cuda:1")   # torch itself raises TypeError for the int 1
    memory.set_memory_fraction(0.5, 2)
    assert fake_cuda == [(1.0, torch.device("cuda", 1)), (0.5, torch.device("cuda", 2))]
    assert all(type(f) is float for f, _ in fake_cuda)


@pytest.mark.parametrize("fraction", [0, 0.0, -0.1, 1.5, float("nan"), True, "0.5", None])
def test_bad_fractions_are_a_lab_error(fake_cuda, fraction):
    with pytest.raises(LabError, match="memory_fraction"):
        memory.set_memory_fraction(fraction, "cuda")
    assert fake_cuda == []


def test_a_cpu_device_is_a_lab_error(fake_cuda):
    with pytest.raises(LabError, match="CUDA device"):
        memory.set_memory_fraction(0.5, "cpu")
    assert fake_cuda == []
