"""Measuring DDP's gradient communication, (c): a timing comm hook. All times are in seconds.

DDP puts gradients into *buckets* (about 25 MB each) and all-reduces a bucket as soon as its gradients
are computed, while ``backward`` goes on with earlier layers; at the end of ``backward`` it waits for
every bucket. Part of the communication is hidden behind computation (*overlap*), only the rest makes a
step longer (*exposed*, (b): :mod:`lab_utils.learn.comm_probe`).

(c) **total all-reduce time** (:class:`AllReduceTimer`, a DDP comm hook): per bucket, from its gradients
    being ready (on GPU a CUDA event on the compute stream: the device *finished* them) to its all-reduce
    completing (a callback on the future: on GPU an event behind the NCCL kernel, on gloo a
    ``perf_counter`` in gloo's thread), so queueing behind earlier buckets and waiting for the other ranks
    are in it; (c) is the *union* of these intervals (:class:`StepComm`). The hook divides by the world
    size and all-reduces like DDP's default one, without blocking: the overlap is preserved.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (``(start, end)`` pairs, any order), overlaps counted once."""
    total, covered = 0.0, -math.inf  # covered: the right end of the union so far
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        total += max(0.0, end - max(start, covered))
        covered = max(covered, end)
    return total


@dataclass
class StepComm:
    """Communication of one synchronized step, from the hook. Seconds."""

    buckets: int
    allreduce_busy_seconds: float   # union of the buckets' [ready, done] intervals: method (c)
    allreduce_sum_seconds: float    # sum of the buckets' intervals
    exposed_tail_seconds: float     # last bucket ready -> backward() returned: an in-step estimate of (b)

    def as_dict(self) -> dict:
        return asdict(self)


class AllReduceTimer:
    """A DDP communication hook that all-reduces each bucket (like the default) and times it. Registered
    before the first forward; per step: ``begin_step()``, forward and backward, ``end_backward()``, then
    ``finish_step()`` (a :class:`StepComm`, zeros under ``no_sync``)."""

    def __init__(self, ddp_model: nn.parallel.DistributedDataParallel, group=None):
        self.group = group
        self.world_size = dist.get_world_size(group)
        dev = next(ddp_model.parameters()).device
        self.cuda = dev.type == "cuda"
        self.device = dev
        self._ref = None
        self._ready: list = []
        self._done: list = []
        self._backward_end = None
        ddp_model.register_comm_hook(state=None, hook=self._hook)

    # -- clock: CUDA events on GPU, perf_counter on CPU
    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _since_ref(self, stamp) -> float:
        if self.cuda:
            return self._ref.elapsed_time(stamp) / 1e3  # ms -> s
        return stamp - self._ref

    def _allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start the bucket's all-reduce (the sum over ranks, in place) without waiting; the Future completes
        with ``[tensor]``. A test may replace it (a collective of a known duration)."""
        return dist.all_reduce(tensor, group=self.group, async_op=True).get_future()

    def _hook(self, state, bucket):  # no annotations: DDP checks them and ours would be strings
        """Called by DDP with a ready bucket (``dist.GradBucket``); returns a Future of the result."""
        tensor = bucket.buffer()
        idx = len(self._ready)
        self._ready.append(self._stamp())
        self._done.append(None)
        tensor.div_(self.world_size)
        fut = self._allreduce(tensor)

        def _finished(f: torch.futures.Future) -> torch.Tensor:
            self._done[idx] = self._stamp()
            return f.value()[0]

        return fut.then(_finished)

    def begin_step(self) -> None:
        """Mark the start of a step (the reference all times are measured from)."""
        self._ready, self._done = [], []
        self._backward_end = None
        self._ref = self._stamp()

    def end_backward(self) -> None:
        """Call right after ``loss.backward()`` returned (DDP has waited for every bucket)."""
        self._backward_end = self._stamp()

    def finish_step(self) -> StepComm:
        """The step's communication figures (synchronizes the device first)."""
        if self._ref is None or self._backward_end is None:
            raise RuntimeError("call begin_step() before the forward and end_backward() after backward()")
        if self.cuda:  # every event (compute stream and the callbacks' streams) must have completed
            torch.cuda.synchronize(self.device)
        if not self._ready:
            return StepComm(0, 0.0, 0.0, 0.0)
        ready = [self._since_ref(s) for s in self._ready]
        done = [self._since_ref(s) if s is not None else math.nan for s in self._done]
        end = self._since_ref(self._backward_end)
        done = [end if math.isnan(d) else d for d in done]
        intervals = list(zip(ready, done))
        return StepComm(
            buckets=len(ready),
            allreduce_busy_seconds=union_length(intervals),
            allreduce_sum_seconds=sum(max(0.0, d - r) for r, d in intervals),
            exposed_tail_seconds=max(0.0, end - max(ready)),
        )


def ddp_bucket_bytes(ddp_model: nn.parallel.DistributedDataParallel) -> list[int] | None:
    """The bytes of each gradient bucket DDP all-reduces per step, in the order it starts them (the first
    holds the last layers' gradients, ready first; the last one, ready when backward ends, can never
    hide): the reducer's buckets as they are now (DDP rebuilds them in the order of the first backward),
    else what its logging data reports. None where this torch shows neither (both are private APIs)."""
    try:
        buckets = ddp_model.reducer._get_zeros_like_grad_buckets()
        return [int(b.buffer().numel() * b.buffer().element_size()) for b in buckets]
    except (AttributeError, RuntimeError, TypeError):
        pass
    get = getattr(ddp_model, "_get_ddp_logging_data", None)
    try:
        data = get() if callable(get) else {}
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")
        return [int(b) for b in str(sizes).split(",")] if sizes else None
    except (RuntimeError, ValueError, TypeError, AttributeError):
        return None
