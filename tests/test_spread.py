"""The spread of every reported time (issue 35): the percentiles by hand, THE loop's per-step times, the
slowest rank's percentiles in the aggregate, REPEATS through the plan and the store, the tables' columns."""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest
import torch
from store_helpers import lab_for
from torch import nn

from lab_utils.engine import profiles
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.engine.records import Record
from lab_utils.experiments.n01_batch_sweep import experiment as sweep
from lab_utils.experiments.n01_batch_sweep import tables as sweep_tables
from lab_utils.experiments.n02_scaling import experiment as scaling
from lab_utils.experiments.n02_scaling import tables as scaling_tables
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.n03_compute_vs_comm import tables as compute_vs_comm
from lab_utils.experiments.shared import rows
from lab_utils.experiments.shared.repeats import merge_repeats, spread_of_record
from lab_utils.learn.loop import StepOptions, make_optimizer, run_epoch, train_steps
from lab_utils.learn.metrics import define
from lab_utils.learn.ranks import aggregate_epoch
from lab_utils.learn.spread import (
    STEP_PERCENTILE_KEYS,
    STEP_SD_KEY,
    TIME_MEDIAN,
    percentile,
    step_percentiles,
    step_statistics,
    time_spread,
    within_noise,
)
from lab_utils.learn.timing import PhaseTimer

pytestmark = pytest.mark.timeout(120)

P10, P50, P90 = STEP_PERCENTILE_KEYS
SD = STEP_SD_KEY


# --------------------------------------------------------------------------- the function, by hand


def test_percentiles_and_spread_of_one_run_by_hand():
    # sorted: 0.10 0.20 0.30 0.40 1.00; p10 at position 0.4 -> 0.10 + 0.4 x 0.10 = 0.14;
    # p50 at 2 -> 0.30; p90 at 3.6 -> 0.40 + 0.6 x 0.60 = 0.76
    p = step_percentiles([0.3, 1.0, 0.1, 0.4, 0.2])
    assert p[P10] == pytest.approx(0.14) and p[P50] == pytest.approx(0.30) and p[P90] == pytest.approx(0.76)
    # one run of 5 steps whose epoch took 2.0 s: spread = 100 x (0.76 - 0.14) / 0.30 = 206.67 %,
    # its range 2.0 x 0.14/0.30 = 0.9333 .. 2.0 x 0.76/0.30 = 5.0667 s
    s = time_spread([{"train_seconds": 2.0, "steps": 5, **p}])
    assert s.seconds == 2.0 and s.pct == pytest.approx(206.6667, rel=1e-5)
    assert s.of == "p10-p90 of 5 steps" and s.repeats == 1
    assert s.low_seconds == pytest.approx(0.93333, rel=1e-4)
    assert s.high_seconds == pytest.approx(5.06667, rel=1e-4)
    assert percentile([7.0], 90) == 7.0
    assert step_percentiles([]) == dict.fromkeys(STEP_PERCENTILE_KEYS)
    assert time_spread([{"train_seconds": 2.0}]) is None  # a record from before the percentiles: no spread


def test_spread_over_repeats_by_hand():
    # repeats 10, 12, 11: median 11, spread 100 x (12 - 10) / 11 = 18.18 %
    s = time_spread([{"train_seconds": 10.0}, {"train_seconds": 12.0}, {"train_seconds": 11.0}])
    assert s.seconds == 11.0 and s.pct == pytest.approx(18.1818, rel=1e-5) and s.of == "min-max of 3 repeats"
    assert (s.low_seconds, s.high_seconds, s.width_seconds) == (10.0, 12.0, 2.0)
    # two repeats: the median is their mean, 9.0; 100 x 2 / 9 = 22.2 %
    s = time_spread([{"train_seconds": 8.0}, {"train_seconds": 10.0}])
    assert s.seconds == 9.0 and s.pct == pytest.approx(22.2222, rel=1e-5) and s.of == "min-max of 2 repeats"


def test_every_new_name_is_in_the_glossary_with_its_unit():
    units = {n: define(n).unit for n in (*STEP_PERCENTILE_KEYS, SD, "spread_pct", "spread_of",
                                         "speedup_noise_flag", "comm_a_noise_flag", "comm_a_stderr_seconds",
                                         "stderr_seconds", "stderr_pct", "spread_low_seconds",
                                         "spread_high_seconds", "repeats")}
    assert units == {P10: "s", P50: "s", P90: "s", SD: "s", "spread_pct": "%", "spread_of": "-",
                     "speedup_noise_flag": "-", "comm_a_noise_flag": "-", "comm_a_stderr_seconds": "s",
                     "stderr_seconds": "s", "stderr_pct": "%", "spread_low_seconds": "s",
                     "spread_high_seconds": "s", "repeats": "count"}


# --------------------------------------------------------------------------- THE loop


class _SlowOnce(nn.Module):
    """A tiny model whose forward sleeps ``seconds`` on its ``slow_call``-th call: one slow step's compute."""

    def __init__(self, slow_call: int, seconds: float):
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.calls, self.slow_call, self.seconds = 0, slow_call, seconds

    def forward(self, x):
        self.calls += 1
        if self.calls == self.slow_call:
            time.sleep(self.seconds)
        return self.lin(x)


class _SlowLoader:
    """Batches whose fetch sleeps (loader wait: never in a step's training time)."""

    def __init__(self, n: int, seconds: float):
        g = torch.Generator().manual_seed(0)
        self.batches = [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))
                        for _ in range(n)]
        self.seconds = seconds

    def __len__(self):
        return len(self.batches)

    def __iter__(self):
        for b in self.batches:
            time.sleep(self.seconds)
            yield b


def _epoch(model, loader):
    """The second epoch of ``model`` (the first warms up: a first call's one-off costs make an outlier)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        opt = make_optimizer(model)
        run_epoch(model, _SlowLoader(3, 0.0), opt, "cpu")
        model.calls = 0
        return run_epoch(model, loader, opt, "cpu", epoch=2)
    finally:
        torch.set_num_threads(before)


def test_step_times_are_the_training_phases_and_sum_to_train_seconds():
    model = _SlowOnce(slow_call=0, seconds=0.0)
    timer = PhaseTimer(torch.device("cpu"))
    sums = train_steps(model, _SlowLoader(6, 0.01), 6, make_optimizer(model), nn.CrossEntropyLoss(), timer,
                       torch.device("cpu"), StepOptions(accumulation_steps=2))
    assert len(sums.step_train_seconds) == sums.steps == 3  # one time per optimizer step, not per batch
    assert sum(sums.step_train_seconds) == pytest.approx(timer.training_seconds)
    assert timer.seconds("data_loading") > 6 * 0.01 * 0.9  # the loader waits: in no step's time


def test_loop_percentiles_bracket_the_mean_step_and_leave_loader_waits_out():
    rec = _epoch(_SlowOnce(slow_call=0, seconds=0.0), _SlowLoader(20, 0.02))
    p10, p50, p90 = (getattr(rec, k) for k in STEP_PERCENTILE_KEYS)
    assert rec.steps == 20 and 0 < p10 <= p50 <= p90
    # the percentiles are of the steps whose sum is train_seconds: p10 (position 1.9 of 0..19) is at most
    # each of the 18 largest steps, p90 at most their sum. (The mean step need not lie below p90: one
    # step delayed by a busy machine lifts the mean above it; that made this test flaky under load.)
    assert 18 * p10 <= rec.train_seconds + 1e-9 and p90 <= rec.train_seconds
    assert p90 < 0.02  # the 20 ms loader sleep of every step is not in any step's training time
    assert rec.data_loading_seconds >= 20 * 0.02 * 0.9


def test_a_slow_step_moves_p90_not_p10():
    base = _epoch(_SlowOnce(slow_call=0, seconds=0.0), _SlowLoader(10, 0.0))
    # the 9th of 10 steps computes 0.2 s longer: above the 90th percentile's position (8.1 of 0..9)?
    # p90 interpolates between the 9th and 10th sorted values, so the slow step (the largest) pulls it up
    slow = _epoch(_SlowOnce(slow_call=9, seconds=0.2), _SlowLoader(10, 0.0))
    assert slow.step_train_seconds_p90 > base.step_train_seconds_p90 + 0.015
    assert slow.step_train_seconds_p10 < base.step_train_seconds_p10 + 0.01
    assert slow.step_train_seconds_p50 < base.step_train_seconds_p50 + 0.01
    model = _SlowOnce(0, 0.0)
    untimed = run_epoch(model, _SlowLoader(3, 0.0), make_optimizer(model), "cpu", timed=False)
    assert untimed.step_train_seconds_p50 is None


# --------------------------------------------------------------------------- over ranks


def test_the_aggregate_takes_the_percentiles_of_the_rank_whose_time_is_tn():
    def rank(r, epoch_s, train_s, p10, p50, p90):
        return {"rank": r, "epoch": 2, "steps": 4, "images": 8, "epoch_seconds": epoch_s,
                "train_seconds": train_s, P10: p10, P50: p50, P90: p90}

    # rank 1 has the longest train_seconds (T(N)) though rank 0 has the longest epoch (loader waits)
    agg = aggregate_epoch([rank(0, 9.0, 4.0, 0.9, 1.0, 1.1), rank(1, 8.0, 6.0, 1.2, 1.5, 2.4)])
    assert agg["train_seconds"] == 6.0
    assert (agg[P10], agg[P50], agg[P90]) == (1.2, 1.5, 2.4)  # not the means 1.05, 1.25, 1.75


# --------------------------------------------------------------------------- repeats: plan, store, table


def _tiny_sweep(**kw) -> sweep.Settings:
    return profiles.settings(sweep.Settings, "quick", batch_sizes=(16,), width=2, train_images=64,
                             test_images=20, epochs=1, reported_epoch=1, memory_cap_bytes=None,
                             dataset="synthetic", **kw)


def test_repeats_are_stored_configs_of_their_own_and_one_table_row(store):
    lab = lab_for(store)
    records = measure(lab, sweep.SWEEP_EXPERIMENT, _tiny_sweep(repeats=2), verbose=False)
    stored = store.records(sweep.EXPERIMENT)
    assert len(stored) == 2 and [r.config.get("repeat") for r in stored] == [None, 1]
    times = [r.metrics["train_seconds"] for r in records]
    table = sweep_tables.sweep_table(records)
    assert len(table) == 1
    row = table.iloc[0]
    assert row["epoch-2 training (s)"] == pytest.approx(statistics.median(times))
    assert row["spread_of"] == "min-max of 2 repeats"
    assert row["spread_pct"] == pytest.approx(100 * (max(times) - min(times)) / statistics.median(times))
    # repeats = 1 measures nothing new: the first repeat's record, stored without "repeat", is reused
    again = measure(lab, sweep.SWEEP_EXPERIMENT, _tiny_sweep(repeats=1), verbose=False)
    assert len(store.records(sweep.EXPERIMENT)) == 2 and again[0].metrics == records[0].metrics
    one = sweep_tables.sweep_table(again).iloc[0]
    assert again[0].metrics["steps"] == 4  # below MIN_STEPS: the row says it has no spread
    assert one["spread_of"] == "none: 4 step(s), fewer than 5" and one["spread_pct"] in ("", None)


def test_repeat_zero_keeps_the_ddp_and_dataparallel_keys():
    s = profiles.settings(scaling.Settings, "quick", repeats=1)
    gpu = Machine(gpus=4, gpu_name="NVIDIA H100 80GB HBM3", cores=8)
    runs = make_plan(scaling.SCALING_EXPERIMENT, s, gpu, "full")
    one = [r.config for r in runs]
    two = [r.config for r in make_plan(scaling.SCALING_EXPERIMENT, profiles.settings(
        scaling.Settings, "quick", repeats=2), gpu, "full")]
    assert all("repeat" not in c for c in one)
    assert [c for c in two if "repeat" not in c] == one
    # every configuration that runs is measured twice; a row that says why it cannot run, once
    assert len([c for c in two if c.get("repeat") == 1]) == len([r for r in runs if r.skip is None]) > 0
    for c in two:  # the worker gives back the config it was given: the plan finds its record
        assert c["metrics_version"] == (2 if c["method"] == scaling.DDP else 1)  # its worker's version
        if c["method"] == scaling.DDP:
            assert RunConfig.from_config(c).config() == {k: v for k, v in c.items() if k != "metrics_version"}


# --------------------------------------------------------------------------- Tables 1 and 2 select it


def _agg(devices, t, p10, p50, p90, repeat=0, steps=10, sd=None):
    cfg = {"method": "DDP", "record": "aggregate", "rank": None, "devices": devices, "backend": "gloo",
           "device_type": "cpu", "batch_size": 32, **({"repeat": repeat} if repeat else {})}
    return Record("scaling", cfg, {"train_seconds": t, "steps": steps, P10: p10, P50: p50, P90: p90,
                                   **({SD: sd} if sd is not None else {})})


def _steps(n: int, mean: float, cv: float, seed: int) -> list[float]:
    """``n`` step times drawn around ``mean`` with a relative standard deviation ``cv`` (seeded)."""
    rng = random.Random(seed)
    return [rng.gauss(mean, cv * mean) for _ in range(n)]


def _run(devices: int, steps: list[float]) -> Record:
    """An aggregate record of one run whose epoch is ``steps`` (train_seconds their sum)."""
    stats = step_statistics(steps)
    return _agg(devices, sum(steps), stats[P10], stats[P50], stats[P90], steps=len(steps), sd=stats[SD])


def test_391_steps_varying_by_10_percent_a_26_percent_band_and_a_half_percent_standard_error():
    """Issue 52 B2: the p10-p90 band describes the steps; the total's standard error is per-step / sqrt(n)."""
    steps = _steps(391, 0.1, 0.10, seed=1)
    s = time_spread([_run(1, steps).metrics])
    assert s.of == "p10-p90 of 391 steps"
    assert 22 < s.pct < 30                        # 2 x 1.2816 x 10 % = 25.6 % for normal steps
    assert s.stderr_pct == pytest.approx(100 * statistics.stdev(steps) * math.sqrt(391) / sum(steps))
    assert 0.44 < s.stderr_pct < 0.58             # 10 % / sqrt(391) = 0.51 %
    # repeats: the standard error of their mean, stdev / sqrt(R)
    r = time_spread([{"train_seconds": 10.0}, {"train_seconds": 12.0}, {"train_seconds": 11.0}])
    assert r.stderr_seconds == pytest.approx(1.0 / math.sqrt(3))


def test_table1_judges_the_speedup_by_the_standard_error_not_by_the_step_band():
    """T(1): 391 steps of 0.1 s +- 10 %; T(2): 196 steps of about 0.19 s +- 10 %, scaled so that T(2) is
    0.974 x T(1) (a speedup of 1.027), then 0.998 x T(1). The p10-p90 bands (+-13 %) overlap in both cases,
    which the old flag read as "not distinguishable from 1"; the standard errors (0.5 % and 0.7 % of the
    times, 0.9 % combined) say that the 2.6 % difference stands out and the 0.2 % one does not."""
    t1 = _run(1, _steps(391, 0.1, 0.10, seed=1))
    one = t1.metrics["train_seconds"]
    for factor, flagged in ((0.974, False), (0.998, True)):
        two = _steps(196, 0.2, 0.10, seed=2)
        scale = factor * one / sum(two)
        t2 = _run(2, [x * scale for x in two])
        row = scaling_tables.scaling_frame([t1, t2]).query("devices == 2").iloc[0]
        assert 0.44 < row["stderr_pct"] < 0.85 and row["spread_pct"] > 20
        assert (row["speedup_noise_flag"] == scaling_tables.SPEEDUP_NOT_DISTINGUISHABLE) is flagged, row
        # the step bands overlap in both cases: the old rule (a band overlap) flagged both
        m1, m2 = t1.metrics, t2.metrics
        lo2, hi2 = (m2["train_seconds"] * m2[p] / m2[P50] for p in (P10, P90))
        assert lo2 <= one * m1[P90] / m1[P50] and one * m1[P10] / m1[P50] <= hi2
    # no standard error (a record from before it was kept): nothing judged
    old = _agg(2, 20.0, 0.09, 0.1, 0.11, steps=196)
    assert scaling_tables.scaling_frame([t1, old]).query("devices == 2").iloc[0]["speedup_noise_flag"] is None


def test_table2_judges_comm_a_by_the_standard_errors_of_both_times():
    """(a) = T(2) - T(1)/2 with se(a) = sqrt(se(T(2))^2 + (se(T(1))/2)^2), by hand: T(1) = 10 s, 100 steps of
    sd 0.01 s (se 0.1 s); T(2) = 5.3 s, 50 steps of sd 0.02 s (se 0.1414 s): se(a) = sqrt(0.02 + 0.0025) =
    0.15 s; (a) = 0.3 s = 2 x 0.15: not distinguishable (2 se >= |a|). T(2) = 5.4 s: (a) 0.4 s stands out."""
    s = profiles.settings(scaling.Settings, "quick")
    t1 = _agg(1, 10.0, 0.09, 0.1, 0.11, steps=100, sd=0.01)
    for tn, flagged in ((5.3, True), (5.4, False), (4.7, True)):
        rows = compute_vs_comm.compute_vs_comm_rows([t1, _agg(2, tn, 0.09, 0.1, 0.11, steps=50, sd=0.02)], s)
        frame = compute_vs_comm.compute_vs_comm_frame(rows).iloc[0]
        assert frame["comm_a_seconds"] == pytest.approx(tn - 5.0)
        assert frame["comm_a_stderr_seconds"] == pytest.approx(math.sqrt(0.02 + 0.0025))
        assert (frame["comm_a_noise_flag"] == compute_vs_comm.COMM_A_NOT_DISTINGUISHABLE) is flagged, tn
    # the old rule: |(a)| = 0.4 s < T(N)'s p10-p90 band in seconds (5.4 x 0.2 = 1.08 s) flagged it
    assert 0.4 < 5.4 * (0.11 - 0.09) / 0.1


def test_within_noise_by_hand():
    assert within_noise(0.5, 0.25) is True          # 2 x 0.25 >= 0.5
    assert within_noise(0.5, 0.2) is False
    assert within_noise(-0.5, 0.15, 0.2) is True     # 2 x sqrt(0.0225 + 0.04) = 0.5
    assert within_noise(0.5, None) is None and within_noise(None, 0.1) is None
    assert within_noise(0.5, 0.1, None) is None


def test_table1_row_of_repeats_is_their_median():
    recs = [_agg(1, 10.0, 0.9, 1.0, 1.1), _agg(1, 12.0, 0.9, 1.0, 1.1, repeat=1),
            _agg(1, 11.0, 0.9, 1.0, 1.1, repeat=2)]
    merged = merge_repeats(recs)
    assert len(merged) == 1 and "repeat" not in merged[0].config
    row = scaling_tables.scaling_frame(recs).iloc[0]
    assert row["epoch2_train_seconds"] == 11.0 and row["spread_of"] == "min-max of 3 repeats"
    assert row["spread_pct"] == pytest.approx(100 * 2 / 11)


@pytest.mark.slow
def test_the_ddp_worker_stores_the_slowest_ranks_percentiles_for_each_repeat(store):
    """Two gloo ranks under torchrun, REPEATS = 2: two stored aggregates, each with T(N)'s rank's spread."""
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=(8,), run_batch_sizes=(8,), devices=(2,),
                          width=2, train_images=64, max_cpu_processes=2, timeout_s=300, dataset="synthetic",
                          repeats=2)
    records = measure(lab_for(store), scaling.SCALING_EXPERIMENT, s, verbose=False, machine=Machine(cores=2))
    aggs = [r for r in records if r.config["record"] == "aggregate"]
    assert [r.config.get("repeat") for r in aggs] == [None, 1] and all(r.status == "ok" for r in aggs)
    for agg in aggs:
        repeat = agg.config.get("repeat")
        ranks = [r for r in records if r.config["record"] == "rank" and r.config.get("repeat") == repeat]
        tn = max(ranks, key=lambda r: r.metrics["train_seconds"])
        assert tn.metrics["train_seconds"] == agg.metrics["train_seconds"]
        assert [agg.metrics[k] for k in STEP_PERCENTILE_KEYS] == [tn.metrics[k] for k in STEP_PERCENTILE_KEYS]
        assert 0 < agg.metrics[P10] <= agg.metrics[P50] <= agg.metrics[P90]
    row = scaling_tables.scaling_frame(records).iloc[0]
    times = [a.metrics["train_seconds"] for a in aggs]
    assert row["epoch2_train_seconds"] == pytest.approx(statistics.median(times))
    assert row["spread_of"] == "min-max of 2 repeats"


def test_fewer_than_five_steps_give_no_spread_and_no_flag():
    """p10 and p90 of 4 steps are not a spread: the row says so, and nothing is judged against it."""
    from lab_utils.learn.spread import MIN_STEPS, time_spread

    assert MIN_STEPS == 5
    few = {"train_seconds": 4.0, "steps": 4, "step_train_seconds_p10": 0.5, "step_train_seconds_p50": 1.0,
           "step_train_seconds_p90": 1.5, "step_train_seconds_sd": 0.4}
    s4 = time_spread([few])
    assert s4.pct is None and s4.of == "none: 4 step(s), fewer than 5" and s4.width_seconds == 0
    assert s4.stderr_seconds is None  # nothing to judge a difference by
    s5 = time_spread([{**few, "steps": 5}])
    assert s5.pct == pytest.approx(100.0)  # (1.5 - 0.5) / 1.0
    assert (s5.low_seconds, s5.high_seconds) == (2.0, 6.0)  # 4 x 0.5, 4 x 1.5
    assert s5.stderr_seconds == pytest.approx(0.4 * math.sqrt(5))
    assert scaling_tables.speedup_noise_flag(s4, s5) is None


def test_the_median_over_repeats_has_a_name_of_its_own():
    """Two repeats, 10 s and 12 s, by hand: the row's time train_seconds_median = 11 s (Table 1's T(N)); the
    merged record holds the 10 s repeat's metrics (the lower median) with its own train_seconds, 10 s,
    so its phases still add up to it."""
    recs = [_agg(1, 10.0, 0.9, 1.0, 1.1), _agg(1, 12.0, 0.9, 1.0, 1.1, repeat=1)]
    merged = merge_repeats(recs)[0]
    assert merged.metrics[TIME_MEDIAN] == 11.0 and merged.metrics["train_seconds"] == 10.0
    assert rows.T_N == TIME_MEDIAN and define(TIME_MEDIAN).unit == "s"
    assert scaling_tables.scaling_frame(recs)["epoch2_train_seconds"].tolist() == [11.0]
    assert spread_of_record(merged).seconds == 11.0
