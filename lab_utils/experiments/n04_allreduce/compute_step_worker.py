"""Notebook 04's compute time per training step on one device: the projection's compute side.

A one-process worker (:mod:`lab_utils.engine.harness`, no process group): launched on a GPU so that
the notebook's kernel opens no CUDA context, called in the notebook's process on a CPU. Each
configuration (``width``, ``batch_size``, ``steps``, ``warmup``:
:func:`lab_utils.experiments.n04_allreduce.experiment.plan_compute`) gives one record, metric
``compute_seconds_per_step``.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import torch

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.dist import DistContext
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.records import Record
from lab_utils.learn.errors import LabError
from lab_utils.learn.loop import make_optimizer, train_steps
from lab_utils.learn.models import ResNet18
from lab_utils.learn.timing import synchronize

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1


def measure_compute_step_seconds(width: int, batch_size: int, device, steps: int, warmup: int,
                                 seed: int = 0) -> float:
    """Mean seconds of one training step on one device (forward, loss, backward, SGD step).

    Random inputs already on the device (no loader, no host-to-device copy); the device
    is synchronized before the clock starts and after the last step. ``warmup`` steps
    (allocator, cuDNN autotuning) are not timed. The values are checked by the plan's Settings.
    """
    apply_training_backends()  # the same cuDNN settings as the runs this step time is compared with
    torch.manual_seed(seed)
    dev = torch.device(device)
    model = ResNet18(width=width).to(dev)
    opt = make_optimizer(model)
    loss_fn = torch.nn.CrossEntropyLoss()
    x = torch.randn(batch_size, 3, 32, 32, device=dev)
    y = torch.randint(0, 10, (batch_size,), device=dev)

    def run(n: int) -> None:  # n steps of the lab's one loop, untimed inside (no per-step sync)
        train_steps(model, itertools.repeat((x, y), n), n, opt, loss_fn, None, dev)

    if warmup:
        run(warmup)
    synchronize(dev)
    start = time.perf_counter()
    run(steps)
    synchronize(dev)
    return (time.perf_counter() - start) / steps


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: Any) -> list[Record]:
    """One batch size: its record (random tensors: synthetic)."""
    if ctx.device.type != config["device_type"]:
        raise LabError(f"The configuration is for {config['device_type']} but this process has {ctx.device}.")
    seconds = measure_compute_step_seconds(config["width"], config["batch_size"], ctx.device, config["steps"],
                                           config["warmup"])
    return [Record(job.experiment, dict(config), {"compute_seconds_per_step": seconds}, profile=job.profile,
                   synthetic=True, dataset="random tensors", hardware=ctx.hardware())]


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
