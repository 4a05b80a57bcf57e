"""One epoch of training and one evaluation pass, each returning a typed record.

The recipe is the assignment's: SGD (lr 0.1, momentum 0.9, weight decay 5e-4) and
cross-entropy. ``train_epoch`` works for a model on one device and for a model wrapped
in ``nn.DataParallel`` (which scatters each batch over the visible GPUs itself).

What the reported training time includes: host-to-device copies, forward, loss,
backward and the optimizer step (``data_movement`` + ``compute`` +
``communication``). What it excludes: waiting on the data loader (``data_loading``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn

from lab_utils.progress import progress
from lab_utils.timing import PhaseTimer, synchronize


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
    peak_memory_bytes: int | None   # device memory high-water mark; None on CPU
    lr: float

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


def train_epoch(model: nn.Module, loader, optimizer: torch.optim.Optimizer, device: torch.device | str,
                epoch: int = 1, timer: PhaseTimer | None = None, scheduler=None,
                loss_fn: nn.Module | None = None, max_steps: int | None = None,
                desc: str | None = None) -> EpochRecord:
    """Train for one pass over ``loader`` (or ``max_steps`` batches) and measure it.

    ``scheduler`` (optional) is stepped after every optimizer step (per-iteration
    schedules such as warm-up). The timer synchronizes the device at phase boundaries,
    so every phase includes the GPU work it queued.
    """
    device = torch.device(device)
    loss_fn = loss_fn or nn.CrossEntropyLoss()
    timer = timer or PhaseTimer(device)
    model.train()
    reset_peak_memory(device)
    loss_sum = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    images = steps = 0
    non_blocking = device.type == "cuda"
    synchronize(device)
    t_start = time.perf_counter()
    for x, y in progress(timer.iterate(loader), total=_len_or_none(loader, max_steps),
                         desc=desc or f"epoch {epoch}"):
        with timer.phase("data_movement"):
            x = x.to(device, non_blocking=non_blocking)
            y = y.to(device, non_blocking=non_blocking)
        with timer.phase("compute"):
            optimizer.zero_grad(set_to_none=True)
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            # accumulate on device: no host sync inside the step
            loss_sum += loss.detach() * y.shape[0]
            correct += (out.detach().argmax(1) == y).sum()
        images += y.shape[0]
        steps += 1
        if max_steps is not None and steps >= max_steps:
            break
    synchronize(device)
    epoch_seconds = time.perf_counter() - t_start
    train_s = timer.training_seconds
    return EpochRecord(
        epoch=epoch, images=images, steps=steps, epoch_seconds=epoch_seconds,
        train_seconds=train_s,
        data_loading_seconds=timer.seconds("data_loading"),
        data_movement_seconds=timer.seconds("data_movement"),
        compute_seconds=timer.seconds("compute"),
        communication_seconds=timer.seconds("communication"),
        images_per_s=images / train_s if train_s > 0 else math.nan,
        loss=float(loss_sum) / max(images, 1),
        accuracy=float(correct) / max(images, 1),
        peak_memory_bytes=peak_memory(device),
        lr=float(optimizer.param_groups[0]["lr"]),
    )


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device | str) -> EvalRecord:
    """Mean cross-entropy and accuracy over ``loader`` in eval mode (BatchNorm uses running stats)."""
    device = torch.device(device)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    model.eval()
    loss_sum = 0.0
    correct = images = 0
    synchronize(device)
    t0 = time.perf_counter()
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        out = model(x)
        loss_sum += float(loss_fn(out, y))
        correct += int((out.argmax(1) == y).sum())
        images += y.shape[0]
    synchronize(device)
    return EvalRecord(loss=loss_sum / max(images, 1), accuracy=correct / max(images, 1),
                      images=images, seconds=time.perf_counter() - t0)


def _len_or_none(loader, max_steps: int | None) -> int | None:
    try:
        n = len(loader)
    except TypeError:
        return max_steps
    return min(n, max_steps) if max_steps else n
