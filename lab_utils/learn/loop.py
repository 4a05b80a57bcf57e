"""THE step loop and THE epoch driver: every path that trains goes through them.

Read it in this order: the plain synchronized step first, then the DDP options as a marked extension.
:func:`train_steps` runs one pass of optimizer steps; :func:`run_epoch` is the clock around it, one
epoch of one process; :func:`lab_utils.learn.evaluation.evaluate` is the one evaluation pass.
Definitions of every number: :mod:`lab_utils.learn.metrics`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lab_utils.learn.devices import model_devices, peak_memory, reset_peak_memory
from lab_utils.learn.epoch_record import EpochRecord, EpochSums
from lab_utils.learn.progress import progress
from lab_utils.learn.spread import step_statistics
from lab_utils.learn.timing import NestedTimers, PhaseTimer, synchronize


def make_optimizer(model: nn.Module, lr: float = 0.1, momentum: float = 0.9,
                   weight_decay: float = 5e-4, **kw) -> torch.optim.SGD:
    """The spec's SGD (the assignment's recipe, with cross-entropy)."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, **kw)


@dataclass(frozen=True)
class StepOptions:
    """How :func:`train_steps` runs a pass; the defaults are the spec's plain loop, the DDP extension
    ``accumulation_steps``, ``comm_timer`` and ``skew_barrier``."""

    accumulation_steps: int = 1     # micro-batches per optimizer step
    scheduler: Any = None           # stepped after every optimizer step
    comm_timer: Any = None          # an AllReduceTimer: the exposed all-reduce wait moves to communication
    skew_barrier: bool = False      # DDP's barrier before each micro-step that starts a collective
    autocast_dtype: torch.dtype | None = None  # forward and loss under autocast, e.g. torch.bfloat16
    count_correct: bool = True      # argmax accuracy (off for language models)
    lr_at: Callable[[int], float] | None = None  # lr set before each optimizer step, counted from first_step
    first_step: int = 0
    max_steps: int | None = None    # stop after that many optimizer steps
    grad_clip: float | None = None  # max gradient norm
    channels_last: bool = False     # the batch in the model's memory format
    step_timers: NestedTimers | None = None  # forward/loss/backward/optimizer inside compute (synchronizes)


PLAIN = StepOptions()


def train_steps(ddp, batches, n_batches: int | None, optimizer, loss_fn, timer, device,
                options: StepOptions = PLAIN) -> EpochSums:
    """THE training loop: one pass over ``batches`` (``n_batches`` of them, or None if unknown).

    Callers, most through :func:`run_epoch`: the workers of notebooks 01-03, 05, 06 and 08, notebook 04's
    compute-step timing and the communication ledger. ``ddp`` is a DDP module or any callable model; a
    plain one accumulates gradients locally and cannot take the skew barrier. With :data:`PLAIN` it is
    the spec's plain step: copy the batch, forward, loss, backward, optimizer step.

    ``timer`` (a :class:`~lab_utils.learn.timing.PhaseTimer`) times each phase in seconds, synchronized
    with the device at its ends; ``timer=None`` runs untimed, with no device synchronization inside the
    loop (the fast path synchronizes only at the ends of a pass). The phases:

    - ``data_loading``: waiting for this rank's loader; ``data_movement``: host-to-device copies;
    - ``skew_wait`` (``skew_barrier``): an all-reduce of one float32 across ranks (gloo and NCCL; on CUDA
      the timer's synchronize waits for it) before the micro-step that all-reduces and, with accumulation,
      the group's first one, whose DDP forward broadcasts the BatchNorm buffers. A rank whose batch is
      ready early waits here for the slowest rank's loader, not inside a collective, where the wait would
      count as compute; the latency of these one or two tiny all-reduces per step is in this phase too;
    - ``compute``: forward, loss, backward (with DDP's gradient all-reduce, whose exposed part
      ``comm_timer`` moves to ``communication``), optimizer step, lr step.

    ``step_train_seconds`` (timed): each optimizer step's growth of ``timer.training_seconds``; the phases
    being synchronized already, these need no synchronization of their own and sum to the training time.

    Gradient accumulation (``accumulation_steps`` = k > 1): one optimizer step per k batches (the epoch's
    last group may be shorter). The first k - 1 micro-steps run under ``ddp.no_sync()`` (nothing is
    communicated), the last all-reduces the sum; each loss is divided by the group's size, so the gradient
    is that of one step on the global batch world x k x batch, as long as each micro-batch is normalized
    on its own (as DDP's per-rank BatchNorm does). BatchNorm's running statistics differ: k updates, not 1.
    """
    o = options
    comm_timer = o.comm_timer
    non_blocking = device.type == "cuda"
    timer = timer if timer is not None else PhaseTimer(device, enabled=False)
    sub = o.step_timers if o.step_timers is not None else NestedTimers(enabled=False)
    autocast = (partial(torch.autocast, device_type=device.type, dtype=o.autocast_dtype)
                if o.autocast_dtype is not None else nullcontext)
    params = [p for g in optimizer.param_groups for p in g["params"]] if o.grad_clip else []
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.float64)
    token = torch.zeros(1, device=device) if o.skew_barrier else None
    out = EpochSums(0, 0, 0, loss_sum, correct)
    group_start, group_size = 0, 1
    step_mark = timer.training_seconds if timer.enabled else 0.0  # training time at the last step's end
    for i, (x, y) in enumerate(timer.iterate(batches)):
        with timer.phase("data_movement"):
            x = x.to(device, non_blocking=non_blocking)
            y = y.to(device, non_blocking=non_blocking)
            if o.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
        pos = i - group_start
        if pos == 0:
            left = o.accumulation_steps if n_batches is None else n_batches - i
            group_size = max(1, min(o.accumulation_steps, left))
        last = pos == group_size - 1  # this micro-step all-reduces and steps the optimizer
        # DDP extension, the skew barrier: before each micro-step that starts a collective
        if token is not None and (last or (pos == 0 and _forward_syncs_buffers(ddp))):
            with timer.phase("skew_wait"):
                dist.all_reduce(token)
        if last and comm_timer is not None:
            comm_timer.begin_step()
        with timer.phase("compute"):
            if pos == 0:
                optimizer.zero_grad(set_to_none=True)
            # DDP extension, accumulation: only the last micro-step's backward all-reduces
            with ddp.no_sync() if not last and isinstance(ddp, DistributedDataParallel) else nullcontext():
                with sub("forward"), autocast():
                    logits = ddp(x)
                with sub("loss"), autocast():
                    loss = loss_fn(logits, y)
                with sub("backward"):
                    (loss / group_size if group_size > 1 else loss).backward()
            if last:
                if comm_timer is not None:
                    comm_timer.end_backward()
                with sub("optimizer"):
                    if o.lr_at is not None:
                        for g in optimizer.param_groups:
                            g["lr"] = o.lr_at(o.first_step + out.steps)
                    if o.grad_clip:
                        nn.utils.clip_grad_norm_(params, o.grad_clip)
                    optimizer.step()
                if o.scheduler is not None:
                    o.scheduler.step()
            loss_sum += loss.detach().double() * y.shape[0]
            if o.count_correct:
                correct += (logits.detach().argmax(1) == y).sum().double()
        if last and comm_timer is not None:
            sc = comm_timer.finish_step()
            out.allreduce_seconds += sc.allreduce_busy_seconds
            out.exposed_tail_seconds += sc.exposed_tail_seconds
            # DDP extension, comm timing: the exposed wait happened inside compute: move it to communication
            timer.stats["compute"].total_seconds -= sc.exposed_tail_seconds
            timer.add("communication", sc.exposed_tail_seconds)
        out.images += int(y.shape[0])
        out.micro_steps += 1
        if last:
            out.steps += 1
            group_start = i + 1
            if timer.enabled:
                now = timer.training_seconds
                out.step_train_seconds.append(now - step_mark)
                step_mark = now
            if o.max_steps is not None and out.steps >= o.max_steps:
                break
    if out.micro_steps != group_start:
        raise RuntimeError(f"train_steps: {out.micro_steps} batches arrived, {n_batches} announced; "
                           "the last gradients were never applied")
    return out


def _forward_syncs_buffers(ddp) -> bool:
    """Whether ``ddp``'s next forward starts with a collective (DDP broadcasts module buffers,
    e.g. BatchNorm statistics, in a forward that follows a synchronizing one)."""
    if not isinstance(ddp, DistributedDataParallel):
        return False
    will_sync = getattr(ddp, "will_sync_module_buffers", None)  # a DDP method since torch 1.10
    return bool(will_sync()) if callable(will_sync) else bool(getattr(ddp, "broadcast_buffers", True))


def run_epoch(model, batches, optimizer, device: torch.device | str, *, epoch: int = 1,
              n_batches: int | None = None, loss_fn=None, options: StepOptions = PLAIN, timed: bool = True,
              global_sums: bool = False, desc: str | None = None) -> EpochRecord:
    """THE epoch driver: one pass of :func:`train_steps` over ``batches``, clocked; this process's
    :class:`EpochRecord`. Peak memory is reset on every device the model uses (all GPUs of an
    ``nn.DataParallel``).

    ``epoch_seconds`` runs from the first batch request to the end of the last step, device synchronized
    at both ends, loader waits included. ``train_seconds``, the reported training time, sums the training
    phases: host-to-device copies, forward, loss, backward, optimizer step (``data_movement`` +
    ``compute`` + ``communication``), leaving out the waits on this rank's loader (``data_loading``) and
    DDP's on the other ranks' (``skew_wait``). ``images_per_s`` = images / ``train_seconds``.
    ``timed=False`` (the fast path: the host queues work ahead, as in real training): no phase boundaries
    inside the pass, only ``epoch_seconds``. ``n_batches``: ``len(batches)`` by default. ``global_sums``:
    one all-reduce of three float64 at the end (timed as ``communication``) gives ``global_loss``,
    ``global_accuracy`` and ``global_images`` over all ranks.
    """
    device = torch.device(device)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    timer = PhaseTimer(device, enabled=timed)
    model.train()
    devices = model_devices(model, device)  # DataParallel: the peak of every GPU, not GPU 0's alone
    for d in devices:
        reset_peak_memory(d)
    if n_batches is None:
        n_batches = _len_or_none(batches)
        if n_batches is not None and options.max_steps is not None:
            n_batches = min(n_batches, options.max_steps * options.accumulation_steps)
    batches = progress(batches, total=n_batches, desc=desc or f"epoch {epoch}")
    synchronize(device)
    t_start = time.perf_counter()
    sums = train_steps(model, batches, n_batches, optimizer, loss_fn, timer if timed else None, device,
                       options)
    glob: list[float] | None = None
    if global_sums and dist.is_available() and dist.is_initialized():
        with timer.phase("communication"):  # the global loss/accuracy: an all-reduce of three numbers
            t = torch.stack([sums.loss_sum, sums.correct,
                             torch.tensor(float(sums.images), device=device, dtype=torch.float64)])
            dist.all_reduce(t)
            glob = t.tolist()
    synchronize(device)
    epoch_seconds = time.perf_counter() - t_start
    train_s = timer.training_seconds if timed else None
    images = sums.images
    peaks = [peak_memory(d) for d in devices]
    rec = EpochRecord(
        epoch=epoch, images=images, steps=sums.steps, micro_steps=sums.micro_steps,
        epoch_seconds=epoch_seconds, train_seconds=train_s, **timer.totals(),
        images_per_s=images / train_s if train_s else None,
        loss=float(sums.loss_sum) / max(images, 1),
        accuracy=float(sums.correct) / max(images, 1) if options.count_correct else math.nan,
        peak_memory_bytes=max(peaks) if None not in peaks else None,
        lr=float(optimizer.param_groups[0]["lr"]),
        peak_memory_bytes_per_device=peaks if len(peaks) > 1 and None not in peaks else None,
        **(step_statistics(sums.step_train_seconds) if timed else {}),
    )
    if options.comm_timer is not None:
        rec.allreduce_seconds, rec.exposed_tail_seconds = sums.allreduce_seconds, sums.exposed_tail_seconds
    if glob is not None:
        g_loss, g_correct, g_images = glob
        rec.global_loss, rec.global_images = g_loss / max(g_images, 1), int(g_images)
        rec.global_accuracy = g_correct / max(g_images, 1) if options.count_correct else math.nan
    return rec


def next_epoch(options: StepOptions, steps_done: int) -> StepOptions:
    """``options`` for the next epoch of a run: the lr schedule continues from ``steps_done``."""
    return replace(options, first_step=steps_done)


def _len_or_none(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
