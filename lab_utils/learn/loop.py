"""THE step loop, THE epoch driver and THE evaluation: every path that trains goes through them.

- :func:`train_steps` runs one pass of optimizer steps over some batches (its options, in
  :class:`StepOptions`, cover gradient accumulation, the DDP skew barrier and comm timing,
  autocast, lr per step, gradient clipping, channels_last, nested step timers);
- :func:`run_epoch` is the clock around it: one epoch of one process, measured as an
  :class:`EpochRecord` (the DDP worker, the GPT worker, the batch-size sweep, DataParallel
  and the fast path all call it; :mod:`lab_utils.learn.ranks` then aggregates the ranks'
  records, the slowest rank defining T(N));
- :func:`evaluate` is the one evaluation pass.

The recipe is the assignment's: SGD (lr 0.1, momentum 0.9, weight decay 5e-4) and
cross-entropy. What the reported training time (``train_seconds``) includes: host-to-device
copies, forward, loss, backward and the optimizer step (``data_movement`` + ``compute`` +
``communication``). What it excludes: waiting on the data loader (``data_loading``) and, in
DDP, on the other ranks' loaders (``skew_wait``). Definitions: :mod:`lab_utils.learn.metrics`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lab_utils.learn.progress import progress
from lab_utils.learn.spread import step_statistics
from lab_utils.learn.timing import NestedTimers, PhaseTimer, synchronize


def make_optimizer(model: nn.Module, lr: float = 0.1, momentum: float = 0.9,
                   weight_decay: float = 5e-4, **kw) -> torch.optim.SGD:
    """The spec's SGD."""
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, **kw)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wrap_data_parallel(model: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    """``nn.DataParallel`` over ``device_ids`` (default: all visible GPUs): one process scatters the
    batch from GPU 0, replicates the model, runs the replicas in threads and gathers outputs and
    gradients back onto GPU 0. It is not a ring all-reduce."""
    return nn.DataParallel(model, device_ids=device_ids)


@dataclass
class EpochRecord:
    """What one training epoch of one process measured (:func:`run_epoch`). Times are seconds,
    memory bytes; every name is defined in :mod:`lab_utils.learn.metrics`."""

    epoch: int
    images: int                     # samples this process trained on (images, or sequences for a GPT)
    steps: int                      # optimizer steps
    epoch_seconds: float            # wall time of the whole pass, loader waits included, device synced
    train_seconds: float | None     # movement + compute + communication (no loader wait); None untimed
    data_loading_seconds: float
    data_movement_seconds: float
    compute_seconds: float
    communication_seconds: float
    images_per_s: float | None      # images / train_seconds (None untimed)
    loss: float                     # mean training loss over this process's samples
    accuracy: float                 # training accuracy over this process's samples (nan: not counted)
    peak_memory_bytes: int | None   # device memory high-water mark (the fullest GPU); None on CPU
    lr: float
    # DataParallel: each GPU's peak, in device_ids order (GPU 0 also holds the gathered outputs)
    peak_memory_bytes_per_device: list[int] | None = None
    micro_steps: int = 0            # forward/backward passes (= batches); = steps without accumulation
    skew_wait_seconds: float = 0.0  # DDP: waiting in the barrier for the other ranks' loaders
    allreduce_seconds: float | None = None     # with a comm timer: all-reduce in flight, summed over steps
    exposed_tail_seconds: float | None = None  # with a comm timer: exposed all-reduce wait, summed
    # with global_sums: loss, accuracy and samples over ALL ranks (an all-reduce at the epoch's end)
    global_loss: float | None = None
    global_accuracy: float | None = None
    global_images: int | None = None
    # the spread of the epoch's per-step training time (seconds; None untimed): see train_steps
    step_train_seconds_p10: float | None = None
    step_train_seconds_p50: float | None = None
    step_train_seconds_p90: float | None = None
    step_train_seconds_sd: float | None = None  # their standard deviation: the total's standard error

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
    """What :func:`train_steps` counted in one pass; the loss and correct sums are float64 tensors
    on the device, ``step_train_seconds`` each optimizer step's training time when timed."""

    images: int
    steps: int
    micro_steps: int
    loss_sum: Any
    correct: Any
    allreduce_seconds: float = 0.0
    exposed_tail_seconds: float = 0.0
    step_train_seconds: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class StepOptions:
    """How :func:`train_steps` runs a pass; the defaults are the spec's plain loop."""

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

    Every path that trains goes through it, most through :func:`run_epoch`: the DDP ResNet
    worker (notebooks 02, 03 and 05), the batch-size sweep and DataParallel (notebooks 01 and
    02), the compute-step timing of notebook 04, the communication ledger, the GPT worker
    (notebook 06) and the fast path (notebook 08). ``ddp`` is a DDP module or a plain one
    (or any callable model, e.g. a compiled one); a plain one accumulates gradients locally
    (there is nothing to synchronize) and cannot take the skew barrier. ``options``: see
    :class:`StepOptions`.

    ``timer=None`` runs untimed: no phase boundaries, so no device synchronization inside
    the loop (the fast path synchronizes only at the ends of a pass).

    Per batch, timed by ``timer`` (a :class:`lab_utils.learn.timing.PhaseTimer`; seconds):

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

    Per optimizer step (when timed): ``step_train_seconds``, the step's training time, i.e. the
    same phases ``train_seconds`` sums (data movement + compute + communication of the step's
    micro-steps; its loader wait and skew wait left out): the growth of
    :attr:`~lab_utils.learn.timing.PhaseTimer.training_seconds` from the end of the previous step to
    the end of this one. Each phase is already synchronized with the device at its ends, so these
    per-step times need no synchronization of their own, and they sum to the loop's training time.

    Gradient accumulation (``accumulation_steps`` = k > 1): one optimizer step per k
    batches (the epoch's last group may be shorter). The first k - 1 micro-steps run
    under ``ddp.no_sync()`` (gradients accumulate locally, nothing is communicated), the
    last one all-reduces the sum; each micro-step's loss is divided by the group's size, so
    the gradient is the mean over world x k micro-batches: that of one step on the global
    batch world x k x batch, as long as each micro-batch is normalized on its own, which is
    what DDP's per-rank BatchNorm does anyway. BatchNorm running statistics are not equal:
    they get k updates per step (one per micro-batch) instead of one.
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
            # the exposed wait happened inside the compute phase: move it to communication
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
    :class:`EpochRecord`.

    Peak memory is reset on every device the model uses (all GPUs of an ``nn.DataParallel``);
    ``epoch_seconds`` runs from the first batch request to the end of the last step, device
    synchronized at both ends, loader waits included. ``train_seconds`` sums the training phases
    (data movement, compute, communication; the loader wait and DDP's ``skew_wait`` left out), each
    synchronized at its ends; ``images_per_s`` = images / ``train_seconds``; the
    ``step_train_seconds_p10/_p50/_p90`` percentiles are the spread of the per-step training times,
    ``step_train_seconds_sd`` their standard deviation (the total's standard error: core.spread).

    ``timed=False`` (the fast path: the host queues work ahead, as in real training): no phase
    boundaries inside the pass, only ``epoch_seconds``. ``n_batches``: ``len(batches)`` by default.
    ``global_sums``: one all-reduce of three float64 at the end (timed as ``communication``) gives
    ``global_loss``, ``global_accuracy`` and ``global_images`` over all ranks.
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


def _len_or_none(loader) -> int | None:
    try:
        return len(loader)
    except TypeError:
        return None
