"""One epoch of training and one evaluation pass, each returning a typed record.

The recipe is the assignment's: SGD (lr 0.1, momentum 0.9, weight decay 5e-4) and
cross-entropy. ``train_epoch`` works for a model on one device and for a model wrapped
in ``nn.DataParallel`` (which scatters each batch over the visible GPUs itself).

What the reported training time includes: host-to-device copies, forward, loss,
backward and the optimizer step (``data_movement`` + ``compute`` +
``communication``). What it excludes: waiting on the data loader (``data_loading``).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lab_utils.core.progress import progress
from lab_utils.core.timing import NestedTimers, PhaseTimer, synchronize


def make_optimizer(model: nn.Module, lr: float = 0.1, momentum: float = 0.9,
                   weight_decay: float = 5e-4, **kw) -> torch.optim.SGD:
    """The spec's SGD."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, **kw)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wrap_data_parallel(model: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    """``nn.DataParallel`` over ``device_ids`` (default: all visible GPUs).

    Single-process: each step scatters the batch from GPU 0, replicates the model from
    GPU 0, runs the replicas in threads and gathers outputs and gradients back onto
    GPU 0. It is not a ring all-reduce.
    """
    return nn.DataParallel(model, device_ids=device_ids)


@dataclass
class EpochRecord:
    """What one training epoch measured. Times are seconds, memory bytes."""

    epoch: int
    images: int
    steps: int
    epoch_seconds: float            # wall time of the whole epoch, loader included
    train_seconds: float            # movement + compute + communication (no loader wait)
    data_loading_seconds: float
    data_movement_seconds: float
    compute_seconds: float
    communication_seconds: float
    images_per_s: float             # images / train_seconds
    loss: float                     # mean training loss over the epoch's images
    accuracy: float                 # training accuracy over the epoch's images
    peak_memory_bytes: int | None   # device memory high-water mark (the fullest GPU); None on CPU
    lr: float
    # DataParallel: each GPU's high-water mark, in device_ids order (GPU 0 holds the gathered
    # outputs and the master copy, the others their replicas); None for one device
    peak_memory_bytes_per_device: list[int] | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EvalRecord:
    loss: float
    accuracy: float
    images: int
    seconds: float

    def as_dict(self) -> dict:
        return {f"test_{k}": v for k, v in asdict(self).items()}


def peak_memory(device: torch.device) -> int | None:
    """Device memory high-water mark since the last reset; None where not tracked (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def model_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices a model's step allocates on: every GPU of an ``nn.DataParallel`` (its
    ``device_ids``), else ``device`` alone."""
    if isinstance(model, nn.DataParallel) and device.type == "cuda" and model.device_ids:
        return [torch.device("cuda", i) for i in model.device_ids]  # DataParallel keeps them as ints
    return [device]


@dataclass
class EpochSums:
    """What :func:`train_steps` counted in one pass: images, optimizer steps, micro-steps
    (forward/backward passes, = batches), the loss and correct-prediction sums of this rank
    (float64 tensors on the device) and, with a comm timer, the all-reduce seconds."""

    images: int
    steps: int
    micro_steps: int
    loss_sum: Any
    correct: Any
    allreduce_seconds: float = 0.0
    exposed_tail_seconds: float = 0.0


def train_steps(ddp, batches, n_batches: int | None, optimizer, loss_fn, timer, device, *,
                accumulation_steps: int = 1, scheduler=None, comm_timer=None,
                skew_barrier: bool = True, autocast_dtype: torch.dtype | None = None,
                count_correct: bool = True, lr_at: Callable[[int], float] | None = None,
                first_step: int = 0, max_steps: int | None = None, grad_clip: float | None = None,
                channels_last: bool = False, step_timers: NestedTimers | None = None) -> EpochSums:
    """THE training loop: one pass over ``batches`` (``n_batches`` of them, or None if unknown).

    Every path that trains goes through it: the DDP ResNet worker
    (:mod:`lab_utils.workers.ddp`, notebooks 02, 03 and 05), the batch-size sweep and
    DataParallel (notebooks 01 and 02, through :func:`train_epoch`), the compute-step timing
    of notebook 04, the communication ledger, the GPT worker (notebook 06) and the fast path
    (notebook 08). ``ddp`` is a DDP module or a plain one (or any callable model, e.g. a
    compiled one); a plain one accumulates gradients locally (there is nothing to
    synchronize) and cannot take the skew barrier.

    ``timer=None`` runs untimed: no phase boundaries, so no device synchronization inside
    the loop (the fast path synchronizes only at the ends of a pass). The options:
    ``autocast_dtype`` (forward and loss under autocast, e.g. ``torch.bfloat16``),
    ``count_correct`` (argmax accuracy; off for language models), ``lr_at(step)`` (the lr
    set before each optimizer step, ``step`` counted from ``first_step``), ``max_steps``
    (stop after that many optimizer steps), ``grad_clip`` (max gradient norm),
    ``channels_last`` (the batch in the model's memory format), ``step_timers`` (a
    :class:`~lab_utils.core.timing.NestedTimers` for a forward/loss/backward/optimizer
    breakdown inside ``compute``; it synchronizes at each of those boundaries).

    Per batch, timed by ``timer`` (a :class:`lab_utils.core.timing.PhaseTimer`; seconds):

    - ``data_loading``: waiting for this rank's loader (``timer.iterate``);
    - ``data_movement``: host-to-device copies of the batch;
    - ``skew_wait`` (with ``skew_barrier``, before each micro-step that starts a collective):
      a barrier across ranks, an all-reduce of one float32 (works on gloo and NCCL; the
      timer synchronizes the device, so on CUDA it is waited for). A rank whose batch is
      ready early waits here for the slowest rank's loader, instead of inside backward's
      gradient all-reduce, where that wait used to be counted as compute. The micro-step
      that all-reduces gets it, and with accumulation also the group's first micro-step:
      its DDP forward broadcasts the BatchNorm buffers, a collective that would otherwise
      absorb the wait for that batch. It costs one or two tiny collectives per optimizer
      step; their own latency is in this phase too;
    - ``compute``: forward, loss, backward (including DDP's gradient all-reduce, whose
      exposed part ``comm_timer`` moves to ``communication``), optimizer step, lr step.

    Gradient accumulation (``accumulation_steps`` = k > 1): one optimizer step per k
    batches (the epoch's last group may be shorter). The first k - 1 micro-steps run
    under ``ddp.no_sync()`` (gradients accumulate locally, nothing is communicated), the
    last one all-reduces the sum; each micro-step's loss is divided by the group's size, so
    the gradient is the mean over world x k micro-batches: that of one step on the global
    batch world x k x batch, as long as each micro-batch is normalized on its own, which is
    what DDP's per-rank BatchNorm does anyway. BatchNorm running statistics are not equal:
    they get k updates per step (one per micro-batch) instead of one.
    """
    non_blocking = device.type == "cuda"
    timer = timer if timer is not None else PhaseTimer(device, enabled=False)
    sub = step_timers if step_timers is not None else NestedTimers(enabled=False)
    autocast = (partial(torch.autocast, device_type=device.type, dtype=autocast_dtype)
                if autocast_dtype is not None else nullcontext)
    params = [p for g in optimizer.param_groups for p in g["params"]] if grad_clip else []
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.float64)
    token = torch.zeros(1, device=device) if skew_barrier else None
    out = EpochSums(0, 0, 0, loss_sum, correct)
    group_start, group_size = 0, 1
    for i, (x, y) in enumerate(timer.iterate(batches)):
        with timer.phase("data_movement"):
            x = x.to(device, non_blocking=non_blocking)
            y = y.to(device, non_blocking=non_blocking)
            if channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
        pos = i - group_start
        if pos == 0:
            left = accumulation_steps if n_batches is None else n_batches - i
            group_size = max(1, min(accumulation_steps, left))
        last = pos == group_size - 1  # this micro-step all-reduces and steps the optimizer
        # the barrier comes before each micro-step that starts a collective: the last one (the
        # gradient all-reduce in backward) and, with accumulation, the first one, whose forward
        # DDP opens with a broadcast of the BatchNorm buffers
        if token is not None and (last or (pos == 0 and _forward_syncs_buffers(ddp))):
            with timer.phase("skew_wait"):
                dist.all_reduce(token)
        if last and comm_timer is not None:
            comm_timer.begin_step()
        with timer.phase("compute"):
            if pos == 0:
                optimizer.zero_grad(set_to_none=True)
            # DDP all-reduces in the backward of a forward run outside no_sync: only the last micro-step's
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
                    if lr_at is not None:
                        for g in optimizer.param_groups:
                            g["lr"] = lr_at(first_step + out.steps)
                    if grad_clip:
                        nn.utils.clip_grad_norm_(params, grad_clip)
                    optimizer.step()
                if scheduler is not None:
                    scheduler.step()
            loss_sum += loss.detach().double() * y.shape[0]
            if count_correct:
                correct += (logits.detach().argmax(1) == y).sum().double()
        if last and comm_timer is not None:
            sc = comm_timer.finish_step()
            out.allreduce_seconds += sc.allreduce_busy_seconds
            out.exposed_tail_seconds += sc.exposed_tail_seconds
            # the exposed wait happened inside the compute phase: move it to communication
            timer.stats["compute"].total_seconds -= sc.exposed_tail_seconds
            timer.add("communication", sc.exposed_tail_seconds)
        out.images += int(y.shape[0])
        out.micro_steps += 1
        if last:
            out.steps += 1
            group_start = i + 1
            if max_steps is not None and out.steps >= max_steps:
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


def train_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, device: torch.device | str,
                epoch: int = 1, timer: PhaseTimer | None = None, scheduler=None,
                loss_fn: nn.Module | None = None, max_steps: int | None = None,
                desc: str | None = None) -> EpochRecord:
    """Train for one pass over ``loader`` (or ``max_steps`` batches) with :func:`train_steps`
    on one device (or ``nn.DataParallel``), and measure it as an :class:`EpochRecord`.

    ``scheduler`` (optional) is stepped after every optimizer step (per-iteration
    schedules such as warm-up). The timer synchronizes the device at phase boundaries,
    so every phase includes the GPU work it queued.
    """
    device = torch.device(device)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    timer = timer or PhaseTimer(device)
    model.train()
    devices = model_devices(model, device)  # DataParallel: the peak of every GPU, not GPU 0's alone
    for d in devices:
        reset_peak_memory(d)
    n = _len_or_none(loader, max_steps)
    batches = loader if max_steps is None else itertools.islice(loader, max_steps)
    synchronize(device)
    t_start = time.perf_counter()
    sums = train_steps(model, progress(batches, total=n, desc=desc or f"epoch {epoch}"), n, optimizer,
                       loss_fn, timer, device, scheduler=scheduler, skew_barrier=False)
    synchronize(device)
    epoch_seconds = time.perf_counter() - t_start
    train_s = timer.training_seconds
    images = sums.images
    peaks = [peak_memory(d) for d in devices]
    return EpochRecord(
        epoch=epoch, images=images, steps=sums.steps, epoch_seconds=epoch_seconds,
        train_seconds=train_s,
        data_loading_seconds=timer.seconds("data_loading"),
        data_movement_seconds=timer.seconds("data_movement"),
        compute_seconds=timer.seconds("compute"),
        communication_seconds=timer.seconds("communication"),
        images_per_s=images / train_s if train_s > 0 else math.nan,
        loss=float(sums.loss_sum) / max(images, 1),
        accuracy=float(sums.correct) / max(images, 1),
        peak_memory_bytes=max(peaks) if None not in peaks else None,
        lr=float(optimizer.param_groups[0]["lr"]),
        peak_memory_bytes_per_device=peaks if len(peaks) > 1 and None not in peaks else None,
    )


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device | str, *, loss_fn=None,
             autocast_dtype: torch.dtype | None = None, max_batches: int | None = None,
             count_correct: bool = True) -> EvalRecord:
    """THE evaluation pass: mean loss and accuracy of ``model`` over ``loader`` in eval mode.

    BatchNorm uses its running statistics, dropout is off; the model's training mode is
    restored afterwards. ``loss_fn`` is a mean-reduced loss (default: cross-entropy); each
    batch counts with ``y.numel()`` predictions (images, or tokens for a language model), so
    ``loss`` is the mean over every prediction and ``images`` their number. Sums stay on the
    device (one synchronization at the end). ``max_batches`` stops early; ``count_correct``
    off skips the argmax accuracy (``nan``). ``seconds``: wall time, device synchronized.
    """
    device = torch.device(device)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    autocast = (partial(torch.autocast, device_type=device.type, dtype=autocast_dtype)
                if autocast_dtype is not None else nullcontext)
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros((), device=device, dtype=torch.float64)
    count = 0
    non_blocking = device.type == "cuda"  # from pinned memory the copy overlaps; the kernels wait for it
    synchronize(device)
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        x, y = x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)
        with autocast():
            out = model(x)
            loss = loss_fn(out, y)
        loss_sum += loss.double() * y.numel()
        if count_correct:
            correct += (out.argmax(-1) == y).sum().double()
        count += y.numel()
    synchronize(device)
    model.train(was_training)
    n = max(count, 1)
    return EvalRecord(loss=float(loss_sum) / n, accuracy=float(correct) / n if count_correct else math.nan,
                      images=count, seconds=time.perf_counter() - t0)


def _len_or_none(loader, max_steps: int | None) -> int | None:
    try:
        n = len(loader)
    except TypeError:
        return max_steps
    return min(n, max_steps) if max_steps else n
