"""``python -m lab_utils bench timers``: what the lab's timers cost a training step, as a measured ratio.

For each row (the spec ResNet-18 and the GPT, each at a usual and at a small batch) the same optimizer
step, on the same batch already in memory, runs through THE loop (:func:`lab_utils.learn.loop.train_steps`)
in two arms: *timed* with the timers a notebook uses (the ResNet: the phase timers of notebooks 01-03; the
GPT: phase and nested forward / loss / backward / optimizer timers, notebook 06's instrumented pass), whose
every boundary synchronizes the device, and *plain*, untimed, the device synchronized once at the end of
the step. :func:`lab_utils.app.paired_ratio.paired_ratio` interleaves the arms step by step (the arm that goes
first alternates) and prints the median of the paired ratios timed / plain, the 10th-90th percentile of
the pairs, and a 95 % bootstrap interval of the median.

The clock: on a GPU the wall clock (the cost is waiting for the device). On a CPU this thread's CPU time
(``time.thread_time``) with torch on one thread, so that all of a step's work is on the clock's thread:
there synchronizing waits for nothing and the timers cost only CPU work, which another process on the
machine cannot add to (``--clock wall`` measures wall time instead, which a busy machine blurs).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from lab_utils.app.paired_ratio import PairedRatio, paired_ratio
from lab_utils.learn.devices import default_device
from lab_utils.learn.errors import check_positive_int
from lab_utils.learn.loop import StepOptions, make_optimizer, train_steps
from lab_utils.learn.models import ResNet18
from lab_utils.learn.models.gpt import GPT, lm_loss
from lab_utils.learn.models.gpt_sizes import gpt_config
from lab_utils.learn.timing import NestedTimers, PhaseTimer, synchronize


@dataclass(frozen=True)
class Sizes:
    """The models and batches a device gets: each model at a usual batch and at a small one, where fixed
    costs dominate; the clock (``wall`` or ``cpu``)."""

    resnet_width: int
    resnet_batches: tuple[int, ...]
    gpt_size: str
    gpt_batches: tuple[int, ...]
    clock: str


GPU_SIZES = Sizes(resnet_width=64, resnet_batches=(128, 8), gpt_size="small", gpt_batches=(64, 4),
                  clock="wall")
CPU_SIZES = Sizes(resnet_width=8, resnet_batches=(8, 2), gpt_size="tiny", gpt_batches=(8, 1), clock="cpu")


@dataclass(frozen=True)
class Row:
    """One measured configuration: the model (``resnet`` or ``gpt``) and its batch (images or sequences)."""

    model: str
    batch_size: int

    @property
    def timers(self) -> str:
        """Which timers the timed arm uses: the GPT's nested sub-timers too (notebook 06), else the phase
        timers alone (notebooks 01-03)."""
        return "phase + nested (06's instrumented pass)" if self.model == "gpt" else "phase timers (01-03)"


def rows(sizes: Sizes) -> list[Row]:
    return [*(Row("resnet", b) for b in sizes.resnet_batches), *(Row("gpt", b) for b in sizes.gpt_batches)]


def arms(row: Row, device: torch.device, sizes: Sizes) -> tuple[Callable[[], None], Callable[[], None], str]:
    """``(timed, plain, description)``: one optimizer step of ``row`` each, finished on the device."""
    torch.manual_seed(0)
    if row.model == "gpt":
        cfg = gpt_config(sizes.gpt_size, vocab_size=65)
        model: nn.Module = GPT(cfg).to(device)
        x = torch.randint(0, cfg.vocab_size, (row.batch_size, cfg.block_size))
        batch, loss_fn = (x, torch.roll(x, -1, dims=1)), lm_loss
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        what = f"GPT {sizes.gpt_size}, batch {row.batch_size} x {cfg.block_size} tokens"
    else:
        model = ResNet18(width=sizes.resnet_width).to(device)
        batch = (torch.randn(row.batch_size, 3, 32, 32), torch.randint(0, 10, (row.batch_size,)))
        loss_fn, opt = nn.CrossEntropyLoss(), make_optimizer(model)
        what = f"ResNet-18 width {sizes.resnet_width}, batch {row.batch_size}"
    gpt = row.model == "gpt"

    def plain() -> None:
        train_steps(model, [batch], 1, opt, loss_fn, None, device, StepOptions(count_correct=not gpt))
        synchronize(device)

    def timed() -> None:
        sub = NestedTimers(device) if gpt else None
        train_steps(model, [batch], 1, opt, loss_fn, PhaseTimer(device), device,
                    StepOptions(count_correct=not gpt, step_timers=sub))
        synchronize(device)

    return timed, plain, what


def parse_rows(text: str) -> list[Row]:
    """``gpt:8,resnet:2`` as rows; anything else one sentence naming the form."""
    out = []
    for item in text.split(","):
        model, _, batch = item.strip().partition(":")
        if model not in ("gpt", "resnet") or not batch.isdigit() or int(batch) < 1:
            raise SystemExit(f"--rows: {item!r} is not MODEL:BATCH; use gpt:BATCH and resnet:BATCH with a "
                             "positive batch, e.g. gpt:8,resnet:2.")
        out.append(Row(model, int(batch)))
    return out


def measure(row: Row, device: torch.device, sizes: Sizes, pairs: int, seconds: float,
            clock) -> tuple[str, PairedRatio]:
    """The row's description and its :class:`PairedRatio` (timed / plain): at least ``pairs`` pairs, more
    until ``seconds`` of ``clock`` are spent (a fast row gets more pairs, a tighter median)."""
    timed, plain, what = arms(row, device, sizes)
    return what, paired_ratio(timed, plain, pairs=pairs, clock=clock, seconds=seconds)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab_utils bench timers", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=100, help="timed/plain pairs per row at least (default: 100)")
    p.add_argument("--seconds", type=float, default=8.0,
                   help="more pairs until a row has spent that much of the clock (default: 8)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="auto: wall time on a GPU, this thread's CPU time on a CPU")
    p.add_argument("--rows", default=None, help="e.g. gpt:8,resnet:2 (default: both models, two batches)")
    a = p.parse_args(argv)
    device = default_device()
    sizes = GPU_SIZES if device.type == "cuda" else CPU_SIZES
    pairs = check_positive_int(a.pairs, "--pairs")
    if not a.seconds >= 0:
        raise SystemExit(f"--seconds must be 0 or more, got {a.seconds!r}.")
    clock_name = sizes.clock if a.clock == "auto" else a.clock
    if clock_name == "cpu":
        torch.set_num_threads(1)  # the step's work on this thread, the one thread_time counts
    clock = time.perf_counter if clock_name == "wall" else time.thread_time
    todo = rows(sizes)
    if a.rows:
        todo = parse_rows(a.rows)
    clock_text = "wall time" if clock_name == "wall" else "this thread's CPU time, torch on 1 thread"
    print(f"device {device}; clock: {clock_text}; per row at least {pairs} pairs and {a.seconds:g} s of the "
          "clock; one optimizer step per arm, interleaved step by step (the first arm alternates)")
    print(f"{'row':<42} {'timers':<40} {'plain ms':>9} {'timed ms':>9} {'pairs':>6} {'ratio':>7} "
          f"{'95% of median':>15} {'pairs p10-p90':>15}")
    for row in todo:
        what, r = measure(row, device, sizes, pairs, a.seconds, clock)
        print(f"{what:<42} {row.timers:<40} {1e3 * r.b_seconds:9.3f} {1e3 * r.a_seconds:9.3f} {r.pairs:6d} "
              f"{r.ratio:7.4f} "
              f"{r.ratio_low:7.4f}-{r.ratio_high:<7.4f} {r.ratio_p10:7.4f}-{r.ratio_p90:<7.4f}")
    print("ratio: timed / plain time of the same step, the median over the pairs; '95% of median': a "
          "bootstrap interval of that median; 'pairs p10-p90': how single pairs vary.")
    return 0
