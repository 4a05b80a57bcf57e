"""The memory of one replica (notebook 09): the bytes a hand-made DDP holds between steps and its peak
in a step, and the optimizer state it keeps. Bytes.

:func:`memory_use` measures them on a GPU with torch's allocator counters, on a CPU by counting tensor
storages (:class:`TensorBytes`); :func:`optimizer_state_bytes` counts what an optimizer keeps.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors an optimizer keeps between steps (SGD: one momentum buffer per parameter;
    Adam: two moments and a step count)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t))


@dataclass(frozen=True)
class MemoryUse:
    """Bytes of one implementation on one rank, counted from before it was built: ``held_bytes`` after
    its warm-up steps (what it keeps between steps: the model, its gradients, the optimizer state, its
    own buffers), ``peak_bytes`` the most allocated at once during one more step (that, plus the step's
    activations and temporaries)."""

    held_bytes: int
    peak_bytes: int


def memory_use(build: Callable[[], Any], step: Callable[[Any], Any], device: torch.device,
               warm_steps: int = 2) -> tuple[MemoryUse, Any]:
    """``build()`` an implementation, run ``warm_steps`` of ``step(it)`` (the optimizer state exists
    after the first, DDP's rebuilt buckets after the second), then one measured step; its
    :class:`MemoryUse` and the implementation. Every tensor allocated meanwhile is counted, so nothing
    else may allocate and keep tensors during the call; what an earlier implementation left for the
    garbage collector is collected first.

    On a GPU: ``torch.cuda.memory_allocated`` before and after, ``max_memory_allocated`` over the
    measured step after ``reset_peak_memory_stats``. On a CPU, where torch keeps no such counter, the
    tensors are counted (:class:`TensorBytes`). Neither sees a collective's own buffers inside gloo or
    NCCL (not tensors of this process's ops)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        it = build()
        for _ in range(warm_steps):
            step(it)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)
        step(it)
        torch.cuda.synchronize(device)
        return MemoryUse(held, torch.cuda.max_memory_allocated(device) - start), it
    with TensorBytes() as count:
        it = build()
        for _ in range(warm_steps):
            step(it)
        held = count.reset_peak()
        step(it)
    return MemoryUse(held, count.peak), it


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as count:``: the bytes of every tensor storage an op creates inside, from
    its creation until it is freed: ``count.allocated`` now, ``count.peak`` the most at once (after any
    op) since entering or :meth:`reset_peak`. A storage's end is a weak reference's callback, which runs
    on whatever thread frees it (gloo's, when it holds a collective's tensor last). A storage an op only
    writes into (in place, ``out=``) was made before and is not counted; nor is memory inside an op."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = self.peak = 0
        self._alive: dict[int, Any] = {}   # storage address -> its weak reference (kept alive here)

    def reset_peak(self) -> int:
        """Start a new peak from what is allocated now; returns that."""
        self.peak = self.allocated
        return self.allocated

    def _freed(self, key: int, nbytes: int, _ref: Any) -> None:
        if self._alive.pop(key, None) is not None:
            self.allocated -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in inputs or key in self._alive or st.nbytes() == 0:
                continue
            self._alive[key] = weakref.ref(st, partial(self._freed, key, st.nbytes()))
            self.allocated += st.nbytes()
        self.peak = max(self.peak, self.allocated)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nest of lists, tuples and dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []
