import time

import pytest
import torch

from lab_utils.app.paired_ratio import paired_ratio
from lab_utils.learn import timing
from lab_utils.learn.timing import NestedTimers, PhaseTimer


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


class _LoadedClock:
    """A clock on a machine whose load drifts: each call of ``work(cost)`` advances it by cost x the load,
    and the load grows by 2 % per call (another process ramping up)."""

    def __init__(self):
        self.t, self.load, self.calls = 0.0, 1.0, []

    def __call__(self) -> float:
        return self.t

    def work(self, name: str, cost: float):
        def run():
            self.calls.append(name)
            self.t += cost * self.load
            self.load *= 1.02
        return run


def test_paired_ratio_interleaves_and_survives_a_drifting_load():
    """Issue 52, B3: a costs 2, b costs 1, under a load that grows 2 % per call. Interleaved a b / b a, the
    pairs' ratios are 2 x 1.02 and 2 / 1.02, and their median 2.0002; timing each arm in a block of its own
    (or always in the same order) would put the drift into the ratio."""
    clock = _LoadedClock()
    r = paired_ratio(clock.work("a", 2.0), clock.work("b", 1.0), pairs=40, warmup=1, clock=clock)
    assert clock.calls[:2] == ["a", "b"] and clock.calls[2:10] == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert r.pairs == 40 and r.ratio == pytest.approx((2 * 1.02 + 2 / 1.02) / 2, rel=1e-9)
    assert r.ratio_p10 == pytest.approx(2 / 1.02) and r.ratio_p90 == pytest.approx(2 * 1.02)
    assert r.ratio_low <= r.ratio <= r.ratio_high
    assert r.a_seconds > r.b_seconds > 0
    blocks = _LoadedClock()   # the same work as two blocks: the drift between them is in the ratio
    a, b = blocks.work("a", 2.0), blocks.work("b", 1.0)
    t0 = blocks()
    for _ in range(40):
        b()
    tb = blocks() - t0
    for _ in range(40):
        a()
    assert (blocks() - t0 - tb) / tb > 2 * 1.5


def test_paired_ratio_takes_more_pairs_to_fill_its_seconds():
    clock = _LoadedClock()
    r = paired_ratio(clock.work("a", 0.01), clock.work("b", 0.01), pairs=4, warmup=0, clock=clock,
                            seconds=1.0, max_pairs=500)
    assert r.pairs % 2 == 0 and 4 < r.pairs < 500
    six = paired_ratio(clock.work("a", 1), clock.work("b", 1), pairs=6, warmup=0, clock=clock)
    assert six.pairs == 6
    with pytest.raises(ValueError, match="2 pairs"):
        paired_ratio(clock.work("a", 1), clock.work("b", 1), pairs=1)


def test_bench_timers_prints_the_median_paired_ratio_of_each_row(capsys):
    """`python -m lab_utils bench timers` on the CPU: a row per model and batch asked, its two arms' times,
    the pairs, the median ratio within its bootstrap interval; bad rows are one sentence."""
    from lab_utils.app import bench_timers

    threads = torch.get_num_threads()
    try:
        assert bench_timers.main(["--rows", "gpt:1,resnet:2", "--pairs", "4", "--seconds", "0"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "clock: this thread's CPU time, torch on 1 thread" in out
    lines = {line.split(",")[0]: line.split() for line in out.splitlines()
             if line.startswith(("GPT tiny", "ResNet-18 width 8"))}
    assert set(lines) == {"GPT tiny", "ResNet-18 width 8"}
    gpt = lines["GPT tiny"]
    assert "nested" in gpt and "phase timers (01-03)" in " ".join(lines["ResNet-18 width 8"])
    low, high = (float(v) for v in gpt[-2].split("-"))
    assert gpt[-4] == "4" and low <= float(gpt[-3]) <= high
    with pytest.raises(SystemExit, match="MODEL:BATCH"):
        bench_timers.main(["--rows", "gpt:0"])
