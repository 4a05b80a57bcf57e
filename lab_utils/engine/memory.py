"""Device memory: running out of it, cleaning up after it, and capping it on purpose.

Out of memory is an expected result in this lab (the batch-size sweep grows the batch
until it no longer fits), so every path that can hit it handles it the same way, here:

- :func:`is_out_of_memory` says whether an exception is an allocation failure:
  ``torch.OutOfMemoryError``, or a ``RuntimeError`` carrying one of :data:`OOM_MARKERS` (cuDNN,
  cuBLAS, NCCL, raw CUDA and CPU allocators). Anything else is a bug and propagates.
- :func:`catch_oom` is the one way to catch it: it swallows an out-of-memory exception and
  keeps only its ``reason``. The cleanup then runs *after* the ``with`` statement, never in an
  ``except`` block: there the traceback holds every frame of the failed call, with the batch,
  the activations and the half-built autograd graph, so ``empty_cache()`` cannot free them.
- :func:`free_device_memory` is that cleanup: ``gc.collect()`` (the dropped model's reference
  cycles), then ``torch.cuda.empty_cache()`` so the next attempt starts from an empty allocator.

The usual shape::

    with catch_oom() as oom:
        metrics = train(...)
    if oom:                          # outside the with: the traceback is gone
        model = optimizer = None     # drop what the caller still holds
        free_device_memory(device)
        return oom_record(oom.reason)

:func:`set_memory_fraction` caps the GPU memory this process may use
(``torch.cuda.set_per_process_memory_fraction``), so that the OOM path can be reached on
purpose with a small model.
"""

from __future__ import annotations

import gc
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any

import torch

from lab_utils.learn.errors import LabError


@dataclass(frozen=True)
class OomMarker:
    """Text (a regular expression) that means "out of memory" in an error message or a rank's log, and
    ``which`` allocation failed, for messages that do not say so themselves (None: the text does)."""

    pattern: str
    which: str | None = None


#: Every way an allocation failure is reported, as the failing library words it.
OOM_MARKERS: tuple[OomMarker, ...] = (
    OomMarker("OutOfMemoryError"),                   # the exception's name in a traceback
    OomMarker("CUDA out of memory"),                 # torch.OutOfMemoryError from the caching allocator
    OomMarker("CUDA error: out of memory"),          # cudaErrorMemoryAllocation from a raw CUDA call
    # cuDNN 9 (cudnn_graph.h): a device or host allocation failure is a sub-code of INTERNAL_ERROR
    OomMarker("CUDNN_STATUS_INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED"),
    OomMarker("CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED"),
    OomMarker("CUDNN_STATUS_ALLOC_FAILED"),          # cuDNN 8 could not allocate its workspace
    OomMarker("CUBLAS_STATUS_ALLOC_FAILED"),         # cuBLAS could not allocate its workspace / handle
    # a library's handle made at its first call on a full GPU: cublasCreate and cudnnCreate fail with
    # NOT_INITIALIZED when the context cannot get the memory they need (a batch that filled the GPU
    # before the first matmul or convolution)
    OomMarker("CUBLAS_STATUS_NOT_INITIALIZED", "cuBLAS: its handle could not be created, no memory left"),
    OomMarker("CUDNN_STATUS_NOT_INITIALIZED", "cuDNN: its handle could not be created, no memory left"),
    # cudnn.benchmark (notebooks 01 and 02 push into OOM with it on): when every convolution engine
    # or algorithm needs more workspace than is left, torch says it found none (cuDNN v8/v9 API and
    # the legacy API's algorithm search)
    OomMarker("FIND was unable to find an engine to execute this computation", "cuDNN: no algorithm fits"),
    OomMarker("Unable to find a valid cuDNN algorithm", "cuDNN: no algorithm fits"),
    # NCCL's own buffers (ncclUnhandledCudaError ... "Last error: Cuda failure 2 'out of memory'")
    OomMarker(r"Cuda failure (\d+ )?'out of memory'", "NCCL: a CUDA allocation failed"),
    OomMarker("can't allocate memory"),              # the CPU allocator (DefaultCPUAllocator)
)
_OOM = [(re.compile(m.pattern), m) for m in OOM_MARKERS]


def oom_marker(text: str) -> OomMarker | None:
    """The first :data:`OOM_MARKERS` entry ``text`` carries, or None."""
    return next((m for rx, m in _OOM if rx.search(text)), None)


def mentions_out_of_memory(text: str) -> bool:
    """True when ``text`` (an error message or a rank's log) reports an allocation failure."""
    return oom_marker(text) is not None


def is_out_of_memory(exc: BaseException) -> bool:
    """True for ``torch.OutOfMemoryError``, or a ``RuntimeError`` (NCCL's ``DistBackendError`` is
    one) whose message carries one of :data:`OOM_MARKERS`; never another type (a ``ValueError``
    that mentions memory is still a bug)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and mentions_out_of_memory(str(exc))


def oom_reason(exc: BaseException, limit: int = 300) -> str:
    """``"OOM: <the message's line that says so>"`` (at most ``limit`` characters of it), for a row;
    ``"OOM (<which>): ..."`` for a message that does not say which allocation failed (cuDNN's "no
    algorithm", NCCL's "Cuda failure"). The first line when no line carries a marker."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    line, marker = next(((ln, m) for ln in lines if (m := oom_marker(ln))), (lines[0], None))
    line = line.strip()
    line = line[: limit - 3] + "..." if len(line) > limit else line
    return f"OOM ({marker.which}): {line}" if marker is not None and marker.which else f"OOM: {line}"


class catch_oom:  # lower case: used like a function, ``with catch_oom() as oom``
    """Swallow an out-of-memory exception raised in the ``with`` body; let others propagate.

    ``bool(oom)``: memory ran out; ``oom.reason``: the row's reason (:func:`oom_reason`), the only
    thing kept, so the failed call's frames and tensors can be freed after the ``with``.
    """

    def __init__(self) -> None:
        self.reason: str | None = None

    def __bool__(self) -> bool:
        return self.reason is not None

    def __enter__(self) -> catch_oom:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if exc is None or not is_out_of_memory(exc):
            return False
        self.reason = oom_reason(exc)
        return True


def free_device_memory(device: torch.device | str | None = None) -> None:
    """Collect garbage, then give the CUDA caching allocator's free blocks back.

    Call it after the references to the model, optimizer and batch are dropped and
    outside any ``except`` block (see the module docstring). ``device`` ``None`` or a
    CUDA device empties the cache when CUDA has been initialized; a CPU device only
    collects garbage.
    """
    gc.collect()
    on_cuda = device is None or torch.device(device).type == "cuda"
    if on_cuda and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- memory cap


def resolve_cuda_device(device: torch.device | str | int | None = None) -> torch.device:
    """A CUDA device *with* an index: ``cuda`` and ``None`` become the current device.

    ``torch.cuda.set_per_process_memory_fraction`` (and other per-device calls) reject
    ``torch.device("cuda")`` with a ``ValueError`` because it names no device.
    """
    if isinstance(device, bool):
        raise LabError(f"Expected a CUDA device such as 'cuda' or 'cuda:0', got {device!r}.")
    if isinstance(device, int):
        device = torch.device("cuda", device)
    dev = torch.device("cuda") if device is None else torch.device(device)
    if dev.type != "cuda":
        raise LabError(f"A GPU memory fraction needs a CUDA device, got {str(dev)!r}; "
                       "on the CPU use memory_cap_bytes instead.")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def check_memory_fraction(fraction: object) -> float:
    """``fraction`` as a Python ``float`` in (0, 1] (torch raises ``TypeError`` for an int or a numpy
    scalar); a :class:`LabError` naming the fix otherwise."""
    if isinstance(fraction, bool) or not isinstance(fraction, numbers.Real):
        raise LabError(f"memory_fraction must be a number in (0, 1], got {fraction!r}; "
                       "e.g. 0.5 for half of the GPU.")
    value = float(fraction)
    if not math.isfinite(value) or not 0 < value <= 1:
        raise LabError(f"memory_fraction must be in (0, 1], got {fraction!r}; e.g. 0.5 for half of the GPU.")
    return value


def set_memory_fraction(fraction: object, device: torch.device | str | int | None = None
                        ) -> tuple[float, torch.device]:
    """Cap this process's CUDA caching allocator at ``fraction`` of ``device``'s memory (``1.0``
    lifts it); the one caller of ``torch.cuda.set_per_process_memory_fraction``. Returns
    ``(fraction, device)`` as passed to torch, so the caller can lift the same cap later."""
    value = check_memory_fraction(fraction)
    dev = resolve_cuda_device(device)
    torch.cuda.set_per_process_memory_fraction(value, dev)
    return value, dev


def main(argv: list[str] | None = None) -> int:
    """``python -m lab_utils.engine.memory LOG``: exit 0 when the log reports out of memory, else 1
    (also, with one line saying why, when it cannot be read). The SLURM job scripts call it so
    that they recognise an allocation failure by :data:`OOM_MARKERS`, not by a grep of their own."""
    import sys

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m lab_utils.engine.memory LOG_FILE", file=sys.stderr)
        return 2
    try:
        with open(args[0], encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        print(f"cannot read {args[0]}: {e.strerror}", file=sys.stderr)
        return 1
    return 0 if mentions_out_of_memory(text) else 1


if __name__ == "__main__":
    raise SystemExit(main())
