"""Measuring DDP's gradient communication: a timing comm hook and a ``no_sync`` probe.

DDP puts gradients into *buckets* (about 25 MB each) and all-reduces a bucket as soon as its
gradients are computed, while ``backward`` goes on with earlier layers; at the end of ``backward``
it waits for every bucket. Part of the communication is hidden behind computation (*overlap*),
only the rest makes a step longer (*exposed*). All times are in seconds.

(b) **exposed communication** (:func:`probe_exposed_comm`): the same steps (forward, loss,
    backward) timed as a training step runs them and under ``ddp.no_sync()``, alternating, after a
    barrier each: ``mean(sync) - mean(no_sync)``. It includes all that synchronization adds to a
    training step: the all-reduce not hidden behind backward, the arrival skew of the ranks, the
    copies into and out of buckets, and the BatchNorm buffer broadcast at the start of the forward.
    DDP broadcasts the buffers only in a forward that follows a synchronized one
    (``require_forward_param_sync``, set at the end of a synchronized forward and cleared at the end
    of a ``no_sync`` one): every training step without accumulation broadcasts. The probe sets that
    flag before each step (on for a synchronized step, off under ``no_sync``), so that each arm does
    what its kind of step does in training; left to the order of the steps (sync, no_sync, no_sync,
    sync, ...), half of each arm would broadcast and the broadcast would cancel out of (b).

(c) **total all-reduce time** (:class:`AllReduceTimer`, a DDP comm hook): per bucket, from its
    gradients being ready (on GPU a CUDA event on the compute stream: the device *finished*
    them) to its all-reduce completing (a callback on the future: on GPU an event behind the
    NCCL kernel, on gloo a ``perf_counter`` in gloo's thread), so queueing behind earlier buckets
    and waiting for the other ranks are in it. ``allreduce_busy_seconds``, the *union* of these
    intervals, is (c); ``allreduce_sum_seconds`` adds them. The hook divides by the world size
    and all-reduces like DDP's default one, without blocking: the overlap is preserved.
    ``exposed_tail_seconds``, last bucket ready -> ``backward()`` returned, is an in-step
    estimate of (b); the DDP worker reports it as its *communication* phase.

**Overlap** = (c) - (b); ``overlap_fraction`` = overlap / (c). (b) <= (c) is an expectation, not a
law: (b) also holds what (c) does not (the bucket copies, the buffer broadcast, the ranks' arrival
skew), so with one bucket (nothing to overlap) or a tiny all-reduce (b) exceeds (c) by those; on a
GPU, NCCL's kernels take SMs and memory bandwidth from the compute they overlap, which also counts
in (b); on a CPU, gloo's thread competes with backward for the cores, so with several buckets (b)
can exceed (c) by up to that computation (``tests/test_ddp.py`` measures it). Neither figure
includes DDP's parameter broadcast at construction nor the loop's metric reductions.
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

from lab_utils.learn.spread import NOISE_SIGMAS, within_noise
from lab_utils.learn.timing import synchronize


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
    exposed_tail_seconds: float     # last bucket ready -> backward() returned

    def as_dict(self) -> dict:
        return asdict(self)


class AllReduceTimer:
    """A DDP communication hook that all-reduces each bucket (like the default) and times it.

    Registered before the first forward; per step: ``begin_step()``, forward and backward,
    ``end_backward()``, then ``finish_step()`` (a :class:`StepComm`, zeros under ``no_sync``).
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

    def _allreduce(self, tensor: torch.Tensor) -> torch.futures.Future:
        """Start the bucket's all-reduce (the sum over ranks, in place) without waiting for it; the
        Future completes with ``[tensor]`` when it is done. A test may replace it (a collective of a
        known duration)."""
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


@dataclass
class CommProbe:
    """Exposed communication (b) and all-reduce time (c) on the same steps, per step, seconds;
    (b) is clamped at 0, the raw difference kept, ``noise_seconds`` its standard error."""

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
    """``(max(0, c - b), that / c clipped to [0, 1] or None when c is 0)`` from exposed (b) and
    total all-reduce (c) seconds."""
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


def _as_in_training(ddp_model: nn.parallel.DistributedDataParallel, sync: bool) -> None:
    """Make the next forward sync DDP's buffers as a training step of that kind does: a synchronized step
    follows a synchronized one (buffers broadcast), a ``no_sync`` micro-step a ``no_sync`` one (none).
    ``require_forward_param_sync`` is the attribute DDP itself sets at the end of each forward."""
    if hasattr(ddp_model, "require_forward_param_sync"):
        ddp_model.require_forward_param_sync = sync


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


def probe_exposed_comm(ddp_model: nn.parallel.DistributedDataParallel, batches: Sequence[tuple],
                       timer: AllReduceTimer, loss_fn: Callable | None = None,
                       warmup: int = 1) -> CommProbe:
    """Time the same batches with and without gradient sync (the module docstring's (b) and (c)).

    ``batches`` are ``(x, y)`` on the model's device, each run twice (the order alternating), with
    no optimizer step: the parameters do not change (BatchNorm statistics do). A synchronized step
    broadcasts the buffers first, as in training, a ``no_sync`` one does not (:func:`_as_in_training`).
    The first ``warmup`` are not counted. Every rank must call this with the same number of batches.
    """
    if len(batches) <= warmup:
        raise ValueError(f"probe_exposed_comm needs more than {warmup} batches, got {len(batches)}")
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    device = timer.device
    sync_t, nosync_t, steps = [], [], []

    def one(x, y, sync: bool) -> float:
        for p in ddp_model.parameters():
            p.grad = None
        _as_in_training(ddp_model, sync)
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
        t = {sync: one(x, y, sync) for sync in ((True, False) if i % 2 == 0 else (False, True))}
        if i >= warmup:
            sync_t.append(t[True])
            nosync_t.append(t[False])
        else:
            steps.clear()
    for p in ddp_model.parameters():
        p.grad = None
    _as_in_training(ddp_model, True)  # the next forward broadcasts, as after any synchronized step
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

    It assumes a perfect split of the one-device work; a negative value (super-linear) is
    returned as is, because it shows the assumption failing.
    """
    if devices < 1:
        raise ValueError(f"devices must be at least 1, got {devices}")
    compute = t1_seconds / devices
    return compute, tn_seconds - compute


def compute_to_comm(compute_seconds: float | None, comm_seconds: float | None) -> float | None:
    """Compute seconds per second of communication: ``compute / comm``; None when either is unknown or the
    communication is not positive (no ratio to state). Table 2's (a): compute (a) / comm (a); its (b):
    (T(N) - (b)) / (b)."""
    if compute_seconds is None or comm_seconds is None or not comm_seconds > 0:
        return None
    return compute_seconds / comm_seconds


def hidden_percent(overlap_fraction: float | None) -> float | None:
    """The all-reduce's share hidden behind backward, in percent: 100 x ``overlap_fraction``
    (:func:`overlap_figures`: ((c) - (b)) / (c)); None when unknown."""
    return None if overlap_fraction is None else 100 * overlap_fraction


NOISE_FLAG = "noise >= effect: not a result"


def noise_flag(effect: float | None, noise: float | None, sigmas: float = NOISE_SIGMAS) -> str:
    """:data:`NOISE_FLAG` when ``sigmas`` x ``noise`` (a standard error, same units) is as large as
    ``|effect|`` (not a result: repeat it, or report the spread); "" when the effect stands out or
    there is no noise estimate to judge by (:func:`lab_utils.learn.spread.within_noise`)."""
    return NOISE_FLAG if within_noise(effect, noise, sigmas=sigmas) else ""
