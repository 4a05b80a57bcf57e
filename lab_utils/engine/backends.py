"""cuDNN and matmul settings: applied by every training path, stated in every record.

Two runs of the same model at the same batch size are only comparable when they use the
same convolution and matmul algorithms. With ``torch.backends.cudnn.benchmark = True``
cuDNN times the candidate algorithms for each new input shape on its first call and keeps
the fastest (which is why every timed epoch or step comes after untimed warm-up work); with
``False`` it takes a heuristic's choice, often slower. Hence every path that trains calls
:func:`apply_training_backends` first (TF32 switches left at torch's defaults), and every
record's ``backends`` field holds :func:`backend_settings`. :func:`pinned_threads` is the one
way a path sets torch's CPU thread count for a block.

``torch`` is imported inside the functions, so that importing the store stays cheap for the CLI.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lab_utils.learn.errors import check_positive_int


def _read(get: Callable[[], Any]) -> Any:
    """A setting's value; torch raises when legacy and new TF32 switches were mixed."""
    try:
        return get()
    except (RuntimeError, AttributeError) as e:  # the record says why instead of failing
        return f"unreadable: {type(e).__name__}"


def backend_settings() -> dict[str, Any]:
    """The cuDNN and float32-matmul settings in force in this process (``*_allow_tf32``: TF32 tensor
    cores for fp32 convolutions and cuBLAS matmuls, Ampere and later)."""
    import torch

    b = torch.backends
    return {
        "cudnn_benchmark": _read(lambda: bool(b.cudnn.benchmark)),
        "cudnn_deterministic": _read(lambda: bool(b.cudnn.deterministic)),
        "cudnn_allow_tf32": _read(lambda: bool(b.cudnn.allow_tf32)),
        "matmul_allow_tf32": _read(lambda: bool(b.cuda.matmul.allow_tf32)),
        "float32_matmul_precision": _read(torch.get_float32_matmul_precision),
    }


def apply_training_backends(cudnn_benchmark: bool = True) -> dict[str, Any]:
    """Set ``torch.backends.cudnn.benchmark`` (default ``True``: autotuned convolutions; harmless on a
    CPU); return :func:`backend_settings`."""
    import torch

    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    return backend_settings()


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` torch intra-op threads (None: leave torch's setting), then restore
    the previous count; yields the count in effect. The quick profile's DDP workers run
    ``cpu_threads`` per process, so the in-process paths pin theirs alike to stay comparable."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        check_positive_int(threads, "threads")
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        if threads is not None:
            torch.set_num_threads(before)
