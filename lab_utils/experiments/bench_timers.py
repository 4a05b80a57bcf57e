"""``python -m lab_utils bench timers``: what the phase timers cost.

Trains the same steps (same model, same batches, in memory so the loader is not
measured) through :func:`~lab_utils.core.loop.run_epoch` with its phase timers on and off,
alternating the two variants several times, and prints the ratio of the median times
(target: under 1.02). On a GPU the enabled timer synchronizes at phase boundaries,
which is the cost it is meant to expose.
"""

from __future__ import annotations

import argparse

import torch

from lab_utils.core.config import check_positive_int
from lab_utils.core.loop import default_device, make_optimizer, run_epoch
from lab_utils.core.timing import measure_overhead
from lab_utils.models import ResNet18


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab_utils bench timers", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None, help="steps per variant (default: 20 GPU / 6 CPU)")
    p.add_argument("--batch-size", type=int, default=None, help="default: 128 GPU / 32 CPU")
    p.add_argument("--width", type=int, default=None, help="ResNet-18 width (default: 64 GPU / 16 CPU)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    device = default_device()
    gpu = device.type == "cuda"
    steps = check_positive_int(a.steps or (20 if gpu else 6), "--steps")
    bs = check_positive_int(a.batch_size or (128 if gpu else 32), "--batch-size")
    width = check_positive_int(a.width or (64 if gpu else 16), "--width")
    check_positive_int(a.repeats, "--repeats")

    torch.manual_seed(0)
    model = ResNet18(width=width).to(device)
    opt = make_optimizer(model)
    batches = [(torch.randn(bs, 3, 32, 32), torch.randint(0, 10, (bs,))) for _ in range(steps)]

    def variant(enabled: bool):
        return lambda: run_epoch(model, batches, opt, device, timed=enabled)

    variant(True)()  # warm-up: allocator, cuDNN autotuning
    r = measure_overhead(variant(True), variant(False), repeats=a.repeats)
    print(f"device {device}, ResNet-18 width {width}, batch {bs}, {steps} steps x {a.repeats} repeats")
    print(f"without timers: {r['without_seconds']:.4f} s   with timers: {r['with_seconds']:.4f} s (medians)")
    print(f"ratio with/without: {r['ratio']:.4f}  (target < 1.02)")
    return 0
