"""Learning-rate rules and schedules against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lab_utils.learn.errors import LabError
from lab_utils.learn.schedules import LRSchedule, linear_scaling_recipe, make_schedule, scaled_lr


def test_linear_scaling_rule_by_hand():
    assert scaled_lr(0.1, 2048, 128) == pytest.approx(1.6)   # the assignment: 512 x 4 GPUs
    assert scaled_lr(0.1, 128, 128) == pytest.approx(0.1)
    assert scaled_lr(0.1, 256, 32) == pytest.approx(0.8)
    with pytest.raises(LabError, match="positive"):
        scaled_lr(0.1, 0, 128)


def test_warmup_then_cosine_per_step_by_hand():
    # peak 0.8, 10 steps, 4 warm-up steps from 0.1: the ramp adds (0.8 - 0.1) / 4 = 0.175 per step,
    # then cosine over the 6 remaining steps: 0.4 x (1 + cos(pi x k / 6)), cos(pi/6) = sqrt(3)/2.
    s = LRSchedule(peak_lr=0.8, total_steps=10, warmup_steps=4, warmup_start_lr=0.1, decay="cosine")
    r3 = math.sqrt(3) / 2
    expected = [0.1, 0.275, 0.45, 0.625,                 # warm-up
                0.8, 0.4 * (1 + r3), 0.6, 0.4, 0.2, 0.4 * (1 - r3)]  # cosine
    assert [s.lr_at(i) for i in range(10)] == pytest.approx(expected)


def test_warmup_then_step_decay_per_step_by_hand():
    # peak 0.4, 12 steps, 2 warm-up steps from 0.1 (+0.15 per step); step decay x0.1 at 50% and 75%
    # of the 10 post-warm-up steps, i.e. from step 2 + 5 = 7 and from step 2 + 7.5 -> 10.
    s = LRSchedule(peak_lr=0.4, total_steps=12, warmup_steps=2, warmup_start_lr=0.1, decay="step")
    expected = [0.1, 0.25, 0.4, 0.4, 0.4, 0.4, 0.4, 0.04, 0.04, 0.04, 0.004, 0.004]
    assert [s.lr_at(i) for i in range(12)] == pytest.approx(expected)


def test_constant_and_no_warmup():
    s = LRSchedule(peak_lr=0.1, total_steps=5)
    assert [s.lr_at(i) for i in range(5)] == pytest.approx([0.1] * 5)
    # warm-up without a start lr starts at the peak (no ramp)
    s = LRSchedule(peak_lr=0.3, total_steps=5, warmup_steps=2)
    assert s.lr_at(0) == pytest.approx(0.3)


def test_lambda_lr_follows_the_schedule_step_by_step():
    """What the workers do: LambdaLR(optimizer, lambda_for(peak)) stepped after every optimizer step."""
    sched = LRSchedule(peak_lr=0.8, total_steps=10, warmup_steps=4, warmup_start_lr=0.1, decay="cosine")
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.8)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, sched.lambda_for(0.8))
    seen = []
    for _ in range(10):
        seen.append(opt.param_groups[0]["lr"])  # the lr this optimizer step uses
        opt.step()
        lam.step()
    assert seen == pytest.approx([sched.lr_at(i) for i in range(10)])


def test_make_schedule_in_epochs_matches_goyal():
    # 2048 global, base 128: peak 1.6; 8 steps/epoch, 5 epochs, warm-up 2 epochs = 16 steps from 0.1
    s = make_schedule(0.1, "linear", 2048, 128, steps_per_epoch=8, epochs=5, warmup_epochs=2, decay="cosine")
    assert (s.peak_lr, s.total_steps, s.warmup_steps, s.warmup_start_lr) == pytest.approx((1.6, 40, 16, 0.1))
    assert s.lr_at(0) == pytest.approx(0.1)
    assert s.lr_at(8) == pytest.approx(0.1 + 1.5 * 8 / 16)  # half-way up the ramp: 0.85
    assert s.lr_at(16) == pytest.approx(1.6)
    assert s.lr_at(28) == pytest.approx(0.8)  # half-way through the 24 cosine steps
    fixed = make_schedule(0.1, "fixed", 2048, 128, steps_per_epoch=8, epochs=5)
    assert {fixed.lr_at(i) for i in range(40)} == {0.1}
    # fractional warm-up epochs round to whole steps
    assert make_schedule(0.1, "linear", 256, 32, 8, 5, warmup_epochs=0.5).warmup_steps == 4


@pytest.mark.parametrize("kwargs, match", [
    ({"decay": "linear"}, "Unknown decay"),
    ({"warmup_steps": 11}, "warmup_steps"),
    ({"total_steps": 0}, "total_steps"),
])
def test_bad_schedules_are_refused(kwargs, match):
    base = {"peak_lr": 0.1, "total_steps": 10}
    with pytest.raises(LabError, match=match):
        LRSchedule(**{**base, **kwargs})


def test_make_schedule_refuses_bad_rule_and_warmup():
    with pytest.raises(LabError, match="lr rule"):
        make_schedule(0.1, "sqrt", 256, 32, 8, 5)
    with pytest.raises(LabError, match="warmup_epochs"):
        make_schedule(0.1, "linear", 256, 32, 8, 5, warmup_epochs=6)


def test_linear_scaling_recipe_by_hand():
    """Exercise 05-b's reference. The assignment: 4 x 512 = 2,048 from 0.1 at 128 -> 1.6;
    ceil(ceil(50,000 / 4) / 512) = ceil(12,500 / 512) = 25 steps per epoch, 2 warm-up epochs -> 50 steps.
    Goyal et al.: 256 x 32 = 8,192 from 0.1 at 256 -> 3.2; ceil(ceil(1,281,167 / 256) / 32) = ceil(5,005 / 32)
    = 157, 5 epochs -> 785. Quick: 4 x 32 = 128 from 0.00625 at 8 -> 0.1; 12 steps, half an epoch -> 6.
    1.3 x 39 = 50.7 -> 51."""
    assert linear_scaling_recipe(0.1, 128, 512, 4, 50_000, 2.0) == (pytest.approx(1.6), 50)
    assert linear_scaling_recipe(0.1, 256, 32, 256, 1_281_167, 5.0) == (pytest.approx(3.2), 785)
    assert linear_scaling_recipe(0.00625, 8, 32, 4, 1_536, 0.5) == (pytest.approx(0.1), 6)
    assert linear_scaling_recipe(0.05, 64, 32, 8, 9_800, 1.3) == (pytest.approx(0.2), 51)
    assert linear_scaling_recipe(0.1, 128, 512, 4, 50_000, 0.0)[1] == 0


@pytest.mark.parametrize("ranks,accumulation", [(4, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("images,per_device,warmup",
                         [(50_000, 512, 2.0), (1_536, 32, 0.5), (9_999, 96, 1.25)])
def test_the_recipe_is_what_the_worker_schedules(ranks, accumulation, images, per_device, warmup):
    """The DDP worker's schedule (its loader's batches per rank, ceil(ceil(N/n)/b), over the accumulation
    steps) for 4 devices, real or emulated, has the recipe's peak and warm-up: the prediction table compares
    like with like."""
    batches = math.ceil(math.ceil(images / ranks) / per_device)
    steps_per_epoch = math.ceil(batches / accumulation)
    worker = make_schedule(0.1, "linear", per_device * 4, 128, steps_per_epoch, 5, warmup)
    peak, warm = linear_scaling_recipe(0.1, 128, per_device, 4, images, warmup)
    assert (worker.peak_lr, worker.warmup_steps) == (pytest.approx(peak), warm)

