"""FLOP counts measured with ``torch.utils.flop_counter.FlopCounterMode``.

The counter records the FLOPs of matrix multiplications and convolutions (2 FLOPs per
multiply-accumulate) as the model actually runs, forward and backward. Element-wise
work (BatchNorm, ReLU, softmax) is not counted; it is small in FLOPs but not in time,
which is one reason achieved FLOP/s stays below peak.
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
