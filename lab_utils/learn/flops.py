"""FLOP counts measured with ``torch.utils.flop_counter.FlopCounterMode``, and what they say about a run.

The counter records the FLOPs of matrix multiplications and convolutions (2 FLOPs per multiply-accumulate) as
the model actually runs, forward and backward. Element-wise work (BatchNorm, ReLU, softmax) is not counted; it
is small in FLOPs but not in time, which is one reason achieved FLOP/s stays below peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class FlopCount:
    """FLOPs of one training step on a batch, and per sample."""

    batch_size: int
    forward_flops: int
    backward_flops: int

    @property
    def train_flops(self) -> int:
        return self.forward_flops + self.backward_flops

    @property
    def forward_flops_per_sample(self) -> float:
        return self.forward_flops / self.batch_size

    @property
    def train_flops_per_sample(self) -> float:
        return self.train_flops / self.batch_size


def count_flops(model: nn.Module, example: torch.Tensor, backward: bool = True,
                loss_fn=None) -> FlopCount:
    """Count forward (and backward) FLOPs of ``model`` on ``example``, differentiating ``loss_fn(output)``
    (default ``output.float().sum()``: not a matmul, so not counted); gradients are cleared after."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.train(backward)
    with FlopCounterMode(display=False) as fwd_counter:
        out = model(example)
    fwd = int(fwd_counter.get_total_flops())
    bwd = 0
    if backward:
        loss = loss_fn(out) if loss_fn else out.float().sum()
        with FlopCounterMode(display=False) as bwd_counter:
            loss.backward()
        bwd = int(bwd_counter.get_total_flops())
        model.zero_grad(set_to_none=True)
    model.train(was_training)
    return FlopCount(batch_size=int(example.shape[0]), forward_flops=fwd, backward_flops=bwd)


def mfu(flops_per_token: float, tokens_per_s: float | None, peak_flops_per_s: float | None,
        devices: int) -> float | None:
    """Model FLOPs utilization, a fraction: ``flops_per_token x tokens_per_s`` (all devices' tokens per
    second) over ``devices x peak_flops_per_s`` (one device's dense peak). None when the peak or the rate is
    unknown (a CPU, a GPU the peak table lacks): never a guessed one. THE fraction of peak of every record:
    the ResNet workers' ``percent_of_peak`` is 100 x ``mfu(flops_per_image, images_per_s, peak, 1)``."""
    if peak_flops_per_s is None or tokens_per_s is None or not peak_flops_per_s > 0:
        return None
    return flops_per_token * tokens_per_s / (devices * peak_flops_per_s)


def step_time_line(batch_sizes: list[int], step_seconds: list[float], block_size: int) -> tuple[float, float]:
    """``(fixed_seconds, seconds_per_token)`` of the line through two measured (batch, seconds per step)
    points, t(b) = fixed + b x block_size x per_token: the part of a step that does not grow with the batch
    (launches, Python, the optimizer) and the part that does. One device, one micro-step per step."""
    (b1, b2), (t1, t2) = batch_sizes, step_seconds
    if b1 == b2:
        raise ValueError("step_time_line needs two different batch sizes.")
    per_token = (t2 - t1) / ((b2 - b1) * block_size)
    return t1 - b1 * block_size * per_token, per_token


def predicted_tokens_per_s(batch_sizes: list[int], step_seconds: list[float], micro_batch: int,
                           effective_batch: int, block_size: int) -> float:
    """Notebook 06's predict-then-measure exercise: tokens per second of one device at ``micro_batch``
    sequences per micro-step, accumulated to ``effective_batch`` per optimizer step, from
    :func:`step_time_line`: each of the k = effective / micro micro-steps pays the fixed part and its
    tokens' part, so k cancels: micro x block / (fixed + micro x block x per_token)."""
    fixed, per_token = step_time_line(batch_sizes, step_seconds, block_size)
    k = effective_batch // micro_batch
    tokens = k * micro_batch * block_size
    return tokens / (k * (fixed + micro_batch * block_size * per_token))
