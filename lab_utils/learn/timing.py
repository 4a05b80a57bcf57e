"""Timers that are correct under CUDA asynchrony. All times are in seconds.

A CUDA kernel launch returns before the kernel runs, so ``time.perf_counter()`` around GPU work measures the
*launch*, not the work, unless the host waits for the device. Every timer here calls :func:`synchronize` at
its boundaries (a no-op on the CPU), so a phase's time includes all device work queued inside it. The price is
that the phases do not overlap each other; that is what a per-phase breakdown means.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

PHASES = ("data_loading", "data_movement", "compute", "communication")
# Waiting for data, not training: this rank's loader, and (DDP) the other ranks', in a barrier.
WAIT_PHASES = ("data_loading", "skew_wait")


def synchronize(device: torch.device | str | None) -> None:
    """Wait until all queued work on ``device`` has finished (CPU: nothing to wait for)."""
    if device is None:
        return
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@contextmanager
def timed(device: torch.device | str | None, stat: Stat):
    """Add the enclosed block's wall time to ``stat``, synchronizing ``device`` at both ends."""
    synchronize(device)
    t0 = time.perf_counter()
    try:
        yield
    finally:
        synchronize(device)
        stat.add(time.perf_counter() - t0)


@dataclass
class Stat:
    """Count, total and mean of one named timer, in seconds."""

    count: int = 0
    total_seconds: float = 0.0

    @property
    def mean_seconds(self) -> float:
        return self.total_seconds / self.count if self.count else 0.0

    def add(self, seconds: float) -> None:
        self.count += 1
        self.total_seconds += seconds


@dataclass
class PhaseTimer:
    """Per-phase wall time of a training loop (the phases: :func:`lab_utils.learn.loop.train_steps`),
    synchronized with the device: ``iterate(loader)`` times each batch wait, ``with timer.phase(name):`` a
    block. ``enabled=False`` makes every call a cheap no-op (the untimed fast path, the timers' overhead)."""

    device: torch.device | str | None = None
    enabled: bool = True
    stats: dict[str, Stat] = field(default_factory=lambda: {p: Stat() for p in PHASES})

    def iterate(self, iterable: Iterable) -> Iterator:
        """Yield from ``iterable``, timing each ``next()`` as ``data_loading``, synchronized at both
        ends: a device-resident loader's kernels (its crop, flip, normalization) are its time."""
        it = iter(iterable)
        while True:
            if self.enabled:
                synchronize(self.device)
                t0 = time.perf_counter()
            try:
                item = next(it)
            except StopIteration:
                return
            if self.enabled:
                synchronize(self.device)
                self.stats["data_loading"].add(time.perf_counter() - t0)
            yield item

    @contextmanager
    def phase(self, name: str):
        """Time the enclosed block as phase ``name`` (synchronized at both ends)."""
        if not self.enabled:
            yield
            return
        with timed(self.device, self.stats.setdefault(name, Stat())):
            yield

    def add(self, name: str, seconds: float) -> None:
        """Record time measured elsewhere (for example by CUDA events) under ``name``."""
        self.stats.setdefault(name, Stat()).add(seconds)

    def seconds(self, name: str) -> float:
        return self.stats[name].total_seconds if name in self.stats else 0.0

    @property
    def training_seconds(self) -> float:
        """Everything but waiting for data (:data:`WAIT_PHASES`): movement + compute + communication."""
        return sum(s.total_seconds for n, s in self.stats.items() if n not in WAIT_PHASES)

    def totals(self) -> dict[str, float]:
        """``{phase}_seconds`` for every phase, for a record."""
        return {f"{n}_seconds": s.total_seconds for n, s in self.stats.items()}


class NestedTimers:
    """Named timers that nest, for the GPT's breakdown: inside ``with t("epoch"):``, ``with t("forward"):``
    is ``"epoch/forward"``; each keeps a :class:`Stat`, synchronizing ``device`` at both ends."""

    def __init__(self, device: torch.device | str | None = None, enabled: bool = True):
        self.device = device
        self.enabled = enabled
        self.stats: dict[str, Stat] = {}
        self._stack: list[str] = []

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        self._stack.append(name)
        try:
            with timed(self.device, self.stats.setdefault("/".join(self._stack), Stat())):
                yield
        finally:
            self._stack.pop()

    def table(self) -> list[dict]:
        """Rows of name, count, total and mean seconds, in first-seen order."""
        return [{"timer": n, "count": s.count, "total_seconds": s.total_seconds,
                 "mean_seconds": s.mean_seconds} for n, s in self.stats.items()]
