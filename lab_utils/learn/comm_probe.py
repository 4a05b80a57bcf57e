"""Measuring DDP's gradient communication, (b): the ``no_sync`` probe, and the overlap (c) - (b). All times
are in seconds; the all-reduce time (c) is :class:`lab_utils.learn.comm_hooks.AllReduceTimer`'s.

(b) **exposed communication** (:func:`probe_exposed_comm`): the same steps (forward, loss, backward)
    timed as a training step runs them and under ``ddp.no_sync()``, alternating, after a barrier each:
    ``mean(sync) - mean(no_sync)``. It includes all that synchronization adds to a training step: the
    all-reduce not hidden behind backward, the arrival skew of the ranks, the copies into and out of
    buckets, and the BatchNorm buffer broadcast at the start of the forward (:func:`_as_in_training`).

**Overlap** = (c) - (b); ``overlap_fraction`` = overlap / (c). (b) <= (c) is an expectation, not a law:
(b) also holds the skew, copies and broadcast above, which (c) does not, so with one bucket (nothing to
overlap) or a tiny all-reduce (b) exceeds (c) by those; on a GPU, NCCL's kernels take SMs and memory
bandwidth from the compute they overlap, which also counts in (b); on a CPU, gloo's thread competes with
backward for the cores, so with several buckets (b) can exceed (c) by up to that computation
(``tests/test_ddp.py`` measures it). Neither includes DDP's parameter broadcast at construction nor the
loop's metric reductions. The assignment's method (a), :func:`derived_comm`, needs no probe.
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

from lab_utils.learn.comm_hooks import AllReduceTimer
from lab_utils.learn.spread import NOISE_SIGMAS, within_noise
from lab_utils.learn.timing import synchronize


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
    """Make the next forward broadcast DDP's buffers or not, as a training step of that kind does: DDP
    broadcasts them in a forward that follows a synchronized one (``require_forward_param_sync``, set
    after a synchronized forward, cleared after a ``no_sync`` one), so every step without accumulation
    does. Left to the probe's order (sync, no_sync, no_sync, sync, ...), half of each arm would broadcast,
    and the broadcast would cancel out of (b)."""
    if hasattr(ddp_model, "require_forward_param_sync"):
        ddp_model.require_forward_param_sync = sync


def probe_exposed_comm(ddp_model: nn.parallel.DistributedDataParallel, batches: Sequence[tuple],
                       timer: AllReduceTimer, loss_fn: Callable | None = None,
                       warmup: int = 1) -> CommProbe:
    """(b) and (c) on the same ``batches``, ``(x, y)`` on the model's device, each run with and without
    gradient sync (the order alternating) and no optimizer step: the parameters do not change (BatchNorm
    statistics do). The first ``warmup`` are not counted. Every rank must call this with as many batches."""
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
    """The assignment's method (a), Table 2's: ``compute = T(1)/N``, ``communication = T(N) - T(1)/N``,
    assuming a perfect split of the one-device work; a negative value (super-linear) is returned as is,
    because it shows the assumption failing."""
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
