"""cuDNN and matmul settings: applied by every training path, stated in every record.

Two runs of the same model at the same batch size are only comparable when they use the
same convolution and matmul algorithms. With ``torch.backends.cudnn.benchmark = True``
cuDNN times the candidate algorithms for each new input shape on its first call and keeps
the fastest; with ``False`` it takes a heuristic's choice, which is often slower. So a
sweep that sets it and a scaling run that does not would time different kernels for the
same configuration. Hence:

- :func:`apply_training_backends` is called at the start of every path that trains
  (the batch-size sweep, DataParallel, the DDP worker, the GPT trainer, the fast path,
  the per-step compute measurement). It sets ``cudnn.benchmark`` (``True`` unless a
  caller, e.g. the sweep's ``cudnn_benchmark`` setting, asks otherwise) and leaves the
  TF32 switches at torch's defaults, which :func:`backend_settings` records.
- :func:`backend_settings` reads the settings in force; :class:`lab_utils.store.Record`
  fills its ``backends`` field with it when a record is built, so every record says
  which settings its numbers were measured under.

:func:`pinned_threads` is the one way a path sets torch's CPU thread count for a block (the
sweep, DataParallel, the fast path's benchmarks, the in-process GPT run), restoring it after.

The first steps after a new shape include cuDNN's autotuning, which is why every timed
epoch or step in the lab comes after untimed warm-up work.

``torch`` is imported inside the functions, as in :mod:`lab_utils.store`, so that
importing the result store stays cheap for the command line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from lab_utils.core.config import check_positive_int


def _read(get: Callable[[], Any]) -> Any:
    """A setting's value; torch raises when legacy and new TF32 switches were mixed."""
    try:
        return get()
    except (RuntimeError, AttributeError) as e:  # the record says why instead of failing
        return f"unreadable: {type(e).__name__}"


def backend_settings() -> dict[str, Any]:
    """The cuDNN and float32-matmul settings in force in this process.

    Keys: ``cudnn_benchmark`` (autotuned convolution algorithms), ``cudnn_deterministic``,
    ``cudnn_allow_tf32`` (TF32 tensor cores for fp32 convolutions, Ampere and later),
    ``matmul_allow_tf32`` (TF32 for fp32 cuBLAS matmuls) and
    ``float32_matmul_precision`` (``highest`` / ``high`` / ``medium``).
    """
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
    """Set the backend settings every training path uses; return :func:`backend_settings`.

    Sets ``torch.backends.cudnn.benchmark`` to ``cudnn_benchmark`` (default ``True``:
    autotuned convolutions, the fastest algorithm for each shape). Harmless on a CPU.
    """
    import torch

    torch.backends.cudnn.benchmark = bool(cudnn_benchmark)
    return backend_settings()


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[int]:
    """Run the block with ``threads`` torch intra-op threads (None: leave torch's setting), then
    restore the previous count. Yields the count in effect inside the block.

    The DDP workers of the quick profile run ``cpu_threads`` threads per process
    (``OMP_NUM_THREADS`` through the launcher); DataParallel runs in the notebook's process,
    whose default is one thread per core. Pinning it the same way keeps their timings comparable.
    """
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
