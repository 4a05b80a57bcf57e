import time

import pytest
import torch

from lab_utils.core import timing
from lab_utils.core.timing import NestedTimers, PhaseTimer


def slow_loader(n, delay):
    for i in range(n):
        time.sleep(delay)
        yield i


def test_phase_timer_splits_loading_from_compute():
    t = PhaseTimer("cpu")
    for _ in t.iterate(slow_loader(3, 0.03)):
        with t.phase("data_movement"):
            time.sleep(0.01)
        with t.phase("compute"):
            time.sleep(0.02)
    assert t.stats["data_loading"].count == 3
    assert t.seconds("data_loading") == pytest.approx(0.09, abs=0.04)
    assert t.seconds("compute") == pytest.approx(0.06, abs=0.03)
    assert t.training_seconds == pytest.approx(t.seconds("compute") + t.seconds("data_movement"))
    assert set(t.totals()) >= {"data_loading_seconds", "compute_seconds", "communication_seconds"}


def test_disabled_timer_records_nothing():
    t = PhaseTimer("cpu", enabled=False)
    for _ in t.iterate(range(3)):
        with t.phase("compute"):
            pass
    assert t.training_seconds == 0 and t.stats["data_loading"].count == 0


def test_synchronize_waits_on_cuda(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(d))
    t = PhaseTimer("cuda:0")
    with t.phase("compute"):
        pass
    assert len(calls) == 2  # at entry and at exit
    timing.synchronize("cpu")
    assert len(calls) == 2  # nothing to wait for on the CPU


def test_nested_timers_paths_and_means():
    nt = NestedTimers()
    with nt("epoch"):
        for _ in range(4):
            with nt("forward"):
                time.sleep(0.005)
    rows = {r["timer"]: r for r in nt.table()}
    assert set(rows) == {"epoch", "epoch/forward"}
    assert rows["epoch/forward"]["count"] == 4
    f = rows["epoch/forward"]
    assert f["mean_seconds"] == pytest.approx(f["total_seconds"] / 4)
    assert rows["epoch"]["total_seconds"] >= f["total_seconds"]


def test_measure_overhead_ratio():
    r = timing.measure_overhead(lambda: time.sleep(0.02), lambda: time.sleep(0.01), repeats=3)
    assert r["ratio"] == pytest.approx(2.0, rel=0.5)
