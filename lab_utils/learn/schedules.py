"""Learning-rate rules and schedules for large-batch training (Goyal et al. 2017): the linear scaling
rule (:func:`scaled_lr`), a gradual warm-up from the small-batch lr, then constant, cosine decay to 0,
or step decay (x0.1 at given fractions). Schedules are functions of the optimizer step (0-based)
returning the lr for that step, so they are exact per iteration and easy to test by hand.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab_utils.learn.errors import LabError, check_choice
from lab_utils.learn.ring import iterations_per_epoch

DECAYS = ("constant", "cosine", "step")


def scaled_lr(base_lr: float, global_batch: int, base_batch: int = 128) -> float:
    """The linear scaling rule: lr grows in proportion to the global batch."""
    if global_batch <= 0 or base_batch <= 0:
        raise LabError(f"Batch sizes must be positive, got global={global_batch}, base={base_batch}.")
    return base_lr * global_batch / base_batch


@dataclass(frozen=True)
class LRSchedule:
    """Peak lr, linear warm-up from ``warmup_start_lr`` over ``warmup_steps``, then a decay over the rest
    of the run's ``total_steps`` optimizer steps."""

    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    warmup_start_lr: float | None = None
    decay: str = "constant"
    step_milestones: tuple[float, ...] = (0.5, 0.75)  # fractions of the post-warm-up steps
    step_gamma: float = 0.1

    def __post_init__(self):
        check_choice(self.decay, DECAYS, "decay")
        if self.total_steps <= 0 or self.warmup_steps < 0 or self.warmup_steps > self.total_steps:
            raise LabError(f"Need 0 <= warmup_steps ({self.warmup_steps}) <= total_steps "
                           f"({self.total_steps}) and total_steps > 0.")

    def lr_at(self, step: int) -> float:
        """The lr used by optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            start = self.peak_lr if self.warmup_start_lr is None else self.warmup_start_lr
            return start + (self.peak_lr - start) * step / self.warmup_steps
        if self.decay == "constant":
            return self.peak_lr
        span = max(self.total_steps - self.warmup_steps, 1)
        progress = min((step - self.warmup_steps) / span, 1.0)
        if self.decay == "cosine":
            return 0.5 * self.peak_lr * (1 + math.cos(math.pi * progress))
        factor = sum(1 for m in self.step_milestones if progress >= m)
        return self.peak_lr * self.step_gamma ** factor

    def lambda_for(self, base_lr: float):
        """A multiplier function for ``torch.optim.lr_scheduler.LambdaLR`` (optimizer lr = base_lr)."""
        return lambda step: self.lr_at(step) / base_lr


LR_RULES = ("fixed", "linear")


def make_schedule(base_lr: float, lr_rule: str, global_batch: int, base_batch: int, steps_per_epoch: int,
                  epochs: int, warmup_epochs: float = 0.0, decay: str = "constant") -> LRSchedule:
    """The schedule of a run, in epochs, as the DDP worker builds it: peak lr ``base_lr`` (``fixed``) or
    ``scaled_lr(...)`` (``linear``), a warm-up from ``base_lr`` over :func:`warmup_steps`, then ``decay``."""
    check_choice(lr_rule, LR_RULES, "lr rule")
    if steps_per_epoch <= 0 or epochs <= 0:
        raise LabError(f"steps_per_epoch ({steps_per_epoch}) and epochs ({epochs}) must be positive.")
    if not 0 <= warmup_epochs <= epochs:
        raise LabError(f"warmup_epochs must be between 0 and epochs ({epochs}), got {warmup_epochs}.")
    peak = base_lr if lr_rule == "fixed" else scaled_lr(base_lr, global_batch, base_batch)
    total = steps_per_epoch * epochs
    warmup = min(total, warmup_steps(warmup_epochs, steps_per_epoch))
    return LRSchedule(peak_lr=peak, total_steps=total, warmup_steps=warmup, warmup_start_lr=base_lr,
                      decay=decay)


def warmup_steps(warmup_epochs: float, steps_per_epoch: int) -> int:
    """Optimizer steps of a warm-up of ``warmup_epochs`` epochs: ``round(warmup_epochs x steps_per_epoch)``
    (Goyal et al. 2017 give the warm-up in epochs; the lr changes per step)."""
    return round(warmup_epochs * steps_per_epoch)


def linear_scaling_recipe(base_lr: float, base_batch: int, per_device_batch: int, devices: int,
                          dataset_size: int, warmup_epochs: float) -> tuple[float, int]:
    """Notebook 05's prediction: the peak lr and the warm-up length in optimizer steps of a run on
    ``devices`` x ``per_device_batch`` from the recipe ``base_lr`` at ``base_batch``: the linear scaling
    rule on the global batch, and ``warmup_epochs`` of that run's steps (:func:`iterations_per_epoch`)."""
    steps = iterations_per_epoch(dataset_size, per_device_batch, devices)
    return scaled_lr(base_lr, per_device_batch * devices, base_batch), warmup_steps(warmup_epochs, steps)
