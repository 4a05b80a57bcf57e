"""THE evaluation pass: mean loss and accuracy of a model over a loader, in eval mode (seconds, nats)."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from functools import partial

import torch
from torch import nn

from lab_utils.learn.timing import synchronize


@dataclass
class EvalRecord:
    loss: float
    accuracy: float
    images: int
    seconds: float

    def as_dict(self) -> dict:
        return {f"test_{k}": v for k, v in asdict(self).items()}


@torch.no_grad()
def evaluate(model: nn.Module, loader, device: torch.device | str, *, loss_fn=None,
             autocast_dtype: torch.dtype | None = None, max_batches: int | None = None,
             count_correct: bool = True) -> EvalRecord:
    """THE evaluation pass: BatchNorm uses its running statistics, dropout is off; the model's training
    mode is restored afterwards. ``loss_fn`` is a mean-reduced loss (default: cross-entropy); each batch
    counts with ``y.numel()`` predictions (images, or tokens for a language model), so ``loss`` is the
    mean over every prediction and ``images`` their number. Sums stay on the device (one synchronization
    at the end). ``max_batches`` stops early; ``count_correct`` off skips the argmax accuracy (``nan``).
    ``seconds``: wall time, device synchronized at both ends."""
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
