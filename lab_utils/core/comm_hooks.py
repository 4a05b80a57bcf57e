"""Measuring DDP's gradient communication: a timing comm hook and a ``no_sync`` probe.

``DistributedDataParallel`` puts gradients into *buckets* (about 25 MB each) and starts
an all-reduce for a bucket as soon as all of its gradients are computed, while
``backward`` goes on computing the gradients of earlier layers. At the end of
``backward`` DDP waits until every bucket's all-reduce is done. So part of the
communication is hidden behind computation (*overlap*) and only the rest makes a step
longer (*exposed* communication). This module measures both:

(b) **exposed communication** (:func:`probe_exposed_comm`): the same steps (forward +
    loss + backward, no optimizer step) timed with gradient synchronization and under
    ``ddp.no_sync()``, alternating, after a barrier each. ``exposed = mean(step with
    sync) - mean(step under no_sync)``. It includes everything synchronization adds to
    a step: the all-reduce time not hidden behind backward, waiting for the slowest
    rank (a barrier precedes each step, so mostly the arrival skew inside the step),
    copying gradients into and out of buckets, and the BatchNorm buffer broadcast DDP
    does at the next forward after a synchronized step.

(c) **total all-reduce time** (:class:`AllReduceTimer`, a DDP communication hook): for
    each bucket, the time from the moment its gradients are ready (the hook is called;
    on GPU a CUDA event recorded on the compute stream, so it marks when the device
    has *finished* those gradients) to the moment its all-reduce has completed (a
    callback on the all-reduce's future: on GPU an event recorded on a stream that
    waits for the NCCL kernel; on CPU/gloo a ``perf_counter`` taken in gloo's thread
    when the work completes). A bucket's time therefore includes queueing behind
    earlier buckets' all-reduces and waiting for the other ranks to reach the same
    bucket, plus the reduction itself. ``allreduce_busy_seconds`` is the *union* of
    these intervals (time during which at least one all-reduce is in flight), which
    is what the lab calls (c); ``allreduce_sum_seconds`` adds the buckets' intervals
    (larger when they overlap each other). The hook divides by the world size and
    all-reduces, exactly like DDP's default hook, and does not block: the overlap with
    backward is preserved.

The hook also splits each synchronized step: ``exposed_tail_seconds`` is the time
from the last bucket becoming ready to ``backward()`` returning, i.e. the wait for
all-reduces that were still running when the gradient computation had finished (an
in-step estimate of (b) that needs no extra steps). The DDP worker reports it as the
*communication* phase of its per-rank breakdown.

**Overlap** = (c) - (b): all-reduce time that was hidden behind backward computation;
``overlap_fraction`` = overlap / (c). With perfect overlap (b) is 0; with none, (b) is
(c) (plus the small synchronization costs above, so (b) <= (c) holds within noise).
On a CPU (gloo) the all-reduce runs in a gloo thread that competes with backward for the
same core, so with several buckets the "hidden" all-reduce slows the computation down and
(b) can exceed (c) by up to that computation's time (``tests/test_ddp.py`` measures this:
with one bucket (b) = (c) within noise, with several the bound is looser on CPU).

Neither figure includes DDP's one-off parameter broadcast at construction, nor the
metric reductions of the training loop; those are counted by the worker separately.
All times are in seconds.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from lab_utils.core.timing import synchronize


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (``(start, end)`` pairs, any order), overlaps counted once."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted((s, e) for s, e in intervals if e > s):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


@dataclass
class StepComm:
    """Communication of one synchronized step, from the hook. Seconds."""

    buckets: int
    allreduce_busy_seconds: float   # union of the buckets' [ready, done] intervals: method (c)
    allreduce_sum_seconds: float    # sum of the buckets' intervals
    exposed_tail_seconds: float     # last bucket ready -> backward() returned

    def as_dict(self) -> dict:
        return asdict(self)


class AllReduceTimer:
    """A DDP communication hook that all-reduces each bucket (like the default) and times it.

    Usage::

        timer = AllReduceTimer(ddp_model)      # registers the hook (before the first forward)
        timer.begin_step()
        loss = loss_fn(ddp_model(x), y); loss.backward()
        timer.end_backward()
        step = timer.finish_step()             # StepComm; waits for the device on GPU

    A step in which the hook was not called (under ``no_sync``) gives zeros.
    """

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

    def _hook(self, state, bucket):  # no annotations: DDP checks them and ours would be strings
        """Called by DDP with a ready bucket (``dist.GradBucket``); returns a Future of the result."""
        tensor = bucket.buffer()
        idx = len(self._ready)
        self._ready.append(self._stamp())
        self._done.append(None)
        tensor.div_(self.world_size)
        fut = dist.all_reduce(tensor, group=self.group, async_op=True).get_future()

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


@dataclass
class CommProbe:
    """Exposed communication (b) and all-reduce time (c) on the same steps, per step, seconds.

    ``exposed_per_step_seconds`` is clamped at 0 (a negative difference is noise);
    ``exposed_raw_per_step_seconds`` keeps the raw difference and ``noise_seconds`` the
    standard error of the mean paired difference.
    """

    steps: int
    sync_step_seconds: float
    nosync_step_seconds: float
    exposed_raw_per_step_seconds: float
    exposed_per_step_seconds: float
    noise_seconds: float
    allreduce_per_step_seconds: float       # (c): union of bucket intervals, mean over sync steps
    allreduce_sum_per_step_seconds: float
    exposed_tail_per_step_seconds: float    # in-step estimate of (b) from the hook
    buckets: int
    overlap_per_step_seconds: float         # max(0, (c) - (b))
    overlap_fraction: float | None          # overlap / (c); None when (c) is 0

    def as_dict(self) -> dict:
        return asdict(self)


def overlap_figures(exposed: float, allreduce: float) -> tuple[float, float | None]:
    """``(overlap seconds, overlap fraction)`` from exposed (b) and total all-reduce (c) time.

    overlap = max(0, c - b); fraction = overlap / c, clipped to [0, 1]; None when c is 0.
    """
    overlap = max(0.0, allreduce - max(exposed, 0.0))
    if allreduce <= 0:
        return overlap, None
    return overlap, min(1.0, overlap / allreduce)


def _barrier(device: torch.device) -> None:
    if not dist.is_initialized():
        return
    if device.type == "cuda" and dist.get_backend() == "nccl":
        dist.barrier(device_ids=[device.index if device.index is not None else torch.cuda.current_device()])
    else:
        dist.barrier()
    synchronize(device)


def probe_exposed_comm(ddp_model: nn.parallel.DistributedDataParallel, batches: Sequence[tuple],
                       timer: AllReduceTimer, loss_fn: Callable | None = None,
                       warmup: int = 1) -> CommProbe:
    """Time the same batches with and without gradient sync; see the module docstring.

    ``batches`` are ``(x, y)`` already on the model's device. Each batch is run twice
    (sync and ``no_sync``, the order alternating between batches), after a barrier and
    a device synchronization, with ``zero_grad`` before and no optimizer step, so the
    model's parameters do not change (BatchNorm running statistics do). The first
    ``warmup`` batches are run but not counted. Every rank must call this with the same
    number of batches.
    """
    if len(batches) <= warmup:
        raise ValueError(f"probe_exposed_comm needs more than {warmup} batches, got {len(batches)}")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    device = timer.device
    sync_t, nosync_t, steps = [], [], []

    def one(x, y, sync: bool) -> float:
        for p in ddp_model.parameters():
            p.grad = None
        _barrier(device)
        t0 = time.perf_counter()
        if sync:
            timer.begin_step()
            loss_fn(ddp_model(x), y).backward()
            timer.end_backward()
        else:
            with ddp_model.no_sync():
                loss_fn(ddp_model(x), y).backward()
        synchronize(device)
        dt = time.perf_counter() - t0
        if sync:
            steps.append(timer.finish_step())
        return dt

    for i, (x, y) in enumerate(batches):
        if i % 2 == 0:
            s = one(x, y, True)
            n = one(x, y, False)
        else:
            n = one(x, y, False)
            s = one(x, y, True)
        if i >= warmup:
            sync_t.append(s)
            nosync_t.append(n)
        else:
            steps.clear()
    for p in ddp_model.parameters():
        p.grad = None
    diffs = [s - n for s, n in zip(sync_t, nosync_t)]
    raw = statistics.fmean(diffs)
    noise = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
    busy = statistics.fmean(s.allreduce_busy_seconds for s in steps)
    exposed = max(0.0, raw)
    overlap, fraction = overlap_figures(exposed, busy)
    return CommProbe(
        steps=len(diffs),
        sync_step_seconds=statistics.fmean(sync_t),
        nosync_step_seconds=statistics.fmean(nosync_t),
        exposed_raw_per_step_seconds=raw,
        exposed_per_step_seconds=exposed,
        noise_seconds=noise,
        allreduce_per_step_seconds=busy,
        allreduce_sum_per_step_seconds=statistics.fmean(s.allreduce_sum_seconds for s in steps),
        exposed_tail_per_step_seconds=statistics.fmean(s.exposed_tail_seconds for s in steps),
        buckets=max(s.buckets for s in steps),
        overlap_per_step_seconds=overlap,
        overlap_fraction=fraction,
    )


def derived_comm(t1_seconds: float, tn_seconds: float, devices: int) -> tuple[float, float]:
    """The assignment's method (a): ``compute = T(1)/N``, ``communication = T(N) - T(1)/N``.

    It assumes the N devices split the one-device work perfectly and that everything
    else is communication; a negative value (T(N) < T(1)/N, super-linear) is returned
    as is, because it shows the assumption failing.
    """
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    compute = t1_seconds / devices
    return compute, tn_seconds - compute


NOISE_FLAG = "noise >= effect: not a result"
NOISE_SIGMAS = 2.0  # an effect counts when it exceeds 2 standard errors (about a 95 % interval)


def noise_flag(effect: float | None, noise: float | None, sigmas: float = NOISE_SIGMAS) -> str:
    """:data:`NOISE_FLAG` when ``sigmas`` x ``noise`` (a standard error, same units) is as large as
    ``|effect|``; "" when the effect stands out, or when there is no noise estimate to judge by.

    A row whose noise is as large as the effect it shows is not a result: repeat the
    measurement, or report the spread instead of the number.
    """
    if effect is None or noise is None:
        return ""
    try:
        e, n = abs(float(effect)), float(noise)
    except (TypeError, ValueError):
        return ""
    if math.isnan(e) or math.isnan(n):
        return ""
    return NOISE_FLAG if sigmas * n >= e else ""
