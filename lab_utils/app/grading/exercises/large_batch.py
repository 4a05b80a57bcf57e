"""The exercises of notebook 05 (large-batch training): the warm-up schedule, the large-batch
recipe, the sampler's order per epoch."""

from __future__ import annotations

import math

from lab_utils.app.grading.exercises.allreduce import epoch_iterations
from lab_utils.app.grading.exercises.answers import plain
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake

# --------------------------------------------------------------------------- q05: schedules, samplers


def _recipe(base_lr, base_batch, per_device_batch, devices, dataset_size, warmup_epochs, rule="linear",
            steps="ddp"):
    """q05_recipe with one known mistake switched on (``rule``: how the peak scales; ``steps``: how the
    warm-up is counted); the right answer with the defaults."""
    k = per_device_batch * devices / base_batch
    scale = {"linear": k, "none": 1.0, "sqrt": math.sqrt(k), "per_device": per_device_batch / base_batch}
    per_epoch = {"base": math.ceil(dataset_size / base_batch),
                 "whole": math.ceil(dataset_size / per_device_batch),
                 "floor": dataset_size // devices // per_device_batch,
                 "epochs": 1}.get(steps, epoch_iterations(dataset_size, devices, per_device_batch))
    warm = warmup_epochs * per_epoch
    return base_lr * scale[rule], (warmup_epochs if steps == "epochs" else int(warm) if steps == "truncate"
                                   else round(warm))


def _lr_from_zero(step, base_lr, global_batch, base_batch, warmup_steps):
    peak = base_lr * global_batch / base_batch
    return peak * step / warmup_steps if step < warmup_steps else peak


def _lr_sqrt(step, base_lr, global_batch, base_batch, warmup_steps):
    peak = base_lr * math.sqrt(global_batch / base_batch)
    return base_lr + (peak - base_lr) * step / warmup_steps if step < warmup_steps else peak


def _sampler(case: dict):
    from torch.utils.data.distributed import DistributedSampler

    return DistributedSampler(range(case["n"]), num_replicas=case["replicas"], rank=case["rank"],
                              shuffle=True, seed=case.get("seed", 0))


def _orders_show(case: dict) -> str:
    return (f"epoch_orders(DistributedSampler(range({case['n']}), num_replicas={case['replicas']}, "
            f"rank={case['rank']}, seed={case.get('seed', 0)}), {case['epochs']})")


def _orders_set_after(sampler, epochs):
    orders = []
    for epoch in range(epochs):
        orders.append([int(i) for i in sampler])
        sampler.set_epoch(epoch)
    return orders


# --------------------------------------------------------------------------- the exercises


#: Notebook 05's exercises, in the order of :data:`lab_utils.app.grading.exercises.EXERCISES`.
EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "q05_lr_schedule", "warmup_lr",
        # matched on the text without markdown emphasis: base_lr reads "baselr", x * y "x y"
        giveaways=("re:base_?lr\\s*(x|×)?\\s*global_?batch\\s*/\\s*base_?batch",
                   "re:base_?lr\\s*\\+\\s*\\(\\s*peak"),
        implemented_by=("lab_utils.learn.schedules.LRSchedule", "lab_utils.learn.schedules.scaled_lr",
                        "lab_utils.learn.schedules.make_schedule"),
        mistakes=(
            Mistake("warm-up from 0", "the warm-up starts at base_lr (the small-batch rate) at step 0, "
                    "not at 0 (Goyal et al. 2017)", wrong=_lr_from_zero),
            Mistake("no linear scaling", "the peak is base_lr x global_batch / base_batch (the linear "
                    "scaling rule)", wrong=lambda step, base_lr, batch, base_batch, warmup: base_lr),
            Mistake("no warm-up", "during the first warmup_steps steps the lr rises linearly from base_lr "
                    "to the peak",
                    wrong=lambda step, base_lr, batch, base_batch, warmup: base_lr * batch / base_batch),
            Mistake("square-root scaling", "the linear scaling rule multiplies by global_batch / base_batch, "
                    "not by its square root", wrong=_lr_sqrt),
        )),
    Exercise(
        "q05_recipe", "large_batch_recipe", outputs=("peak_lr", "warmup_steps"),
        giveaways=("1.6 for 2,048", "re:0\\.1\\s*(x|×)?\\s*2,?048\\s*/\\s*128", "re:(?<![\\d,])125 steps"),
        implemented_by=("lab_utils.learn.schedules.linear_scaling_recipe",
                        "lab_utils.learn.schedules.make_schedule"),
        mistakes=(
            Mistake("no linear scaling", "the peak lr is base_lr x global batch / base_batch (the linear "
                    "scaling rule), not the small-batch rate", wrong=lambda *a: _recipe(*a, rule="none")),
            Mistake("square-root scaling", "the linear scaling rule multiplies by global batch / base_batch, "
                    "not by its square root", wrong=lambda *a: _recipe(*a, rule="sqrt")),
            Mistake("the per-device batch for the global batch", "the global batch is devices x per-device "
                    "batch: scale by it", wrong=lambda *a: _recipe(*a, rule="per_device")),
            Mistake("warm-up in the reference's steps", "the warm-up epochs count the LARGE run's optimizer "
                    "steps, ceil(ceil(N/P)/b) per epoch, not the small batch's",
                    wrong=lambda *a: _recipe(*a, steps="base")),
            Mistake("every device on the whole data set", "DistributedSampler gives each device ceil(N/P) "
                    "images: an epoch is ceil(ceil(N/P)/b) steps, not ceil(N/b)",
                    wrong=lambda *a: _recipe(*a, steps="whole")),
            Mistake("the last partial batch dropped", "the loader keeps the last partial batch: round both "
                    "divisions up", wrong=lambda *a: _recipe(*a, steps="floor")),
            Mistake("warm-up length in epochs", "return the warm-up in optimizer steps (epochs x steps per "
                    "epoch), as the schedule counts it", wrong=lambda *a: _recipe(*a, steps="epochs")),
            Mistake("warm-up rounded down", "round the warm-up to the nearest whole step, as the lab's "
                    "schedule does", wrong=lambda *a: _recipe(*a, steps="truncate")),
        )),
    Exercise(
        "q05_set_epoch", "epoch_orders", call=lambda fn, case: plain(fn(_sampler(case), case["epochs"])),
        show=_orders_show, needs=("torch.utils.data.distributed",),
        giveaways=("re:seed\\s*\\+\\s*epoch", "repeats epoch 0", "the same images in the same order"),
        implemented_by=("lab_utils.experiments.n05_large_batch.experiment.sampler_epoch_orders",),
        mistakes=(
            Mistake("set_epoch never called", "every epoch repeats epoch 0's order: call "
                    "sampler.set_epoch(epoch) at the start of each epoch",
                    wrong=lambda sampler, epochs: [[int(i) for i in sampler] for _ in range(epochs)]),
            Mistake("set_epoch after the epoch", "each epoch gets the previous epoch's order: call "
                    "sampler.set_epoch(epoch) BEFORE iterating the sampler", wrong=_orders_set_after),
        )),
)
