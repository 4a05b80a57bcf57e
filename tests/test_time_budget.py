"""The GPU time budget: one row per notebook, a sum over each experiment's own plan; `make docs` writes the
same table into docs/generated/time-budget.md (tests/test_docs.py checks it is current)."""


import pytest

from lab_utils.app import time_budget as tb
from lab_utils.engine import plan, profiles
from lab_utils.engine.machine import BUDGET_NODE
from lab_utils.experiments import registry
from lab_utils.experiments.n02_scaling import experiment as scaling
from lab_utils.experiments.n03_compute_vs_comm.experiment import COMPUTE_VS_COMM_EXPERIMENT
from lab_utils.experiments.n04_allreduce import experiment as comm
from lab_utils.experiments.shared import estimates
from lab_utils.learn.errors import LabError


def test_table_has_every_notebook_and_a_total():
    df = tb.budget_table()
    assert list(df["notebook"]) == [*tb.notebooks(), "all"]
    assert list(tb.notebooks()) == [f"{i:02d}" for i in range(10)]
    minutes = list(df["estimated minutes"])
    assert all(m >= 1 for m in minutes)
    assert minutes[-1] == sum(minutes[:-1])


def test_flop_constant_matches_the_counter():
    from lab_utils.experiments.n01_batch_sweep.experiment import flops_per_image

    assert estimates.RESNET_TRAIN_FLOPS_PER_IMAGE == pytest.approx(flops_per_image(64).train_flops, rel=1e-3)


def test_spec_epoch_is_anchored_on_published_times():
    assert estimates.spec_epoch_seconds(1, 128) == 33.64  # as published (anchors.FIRST_COHORT_TABLE1_SECONDS)
    assert estimates.spec_epoch_seconds(4, 2048) == 9.01  # above 512: the 512 time
    assert estimates.spec_epoch_seconds(1, 32) > estimates.spec_epoch_seconds(1, 128)
    assert estimates.fast_epoch_seconds("bf16") < estimates.spec_epoch_seconds(1, 128)


def test_a_registered_notebook_is_the_sum_over_its_plan_by_hand():
    """Notebook 02 on the budget's node (4 GPUs): DataParallel and DDP on 1, 2, 4 GPUs, 4 batch sizes each:
    24 runs in 6 launch groups; and notebook 04's all-reduce benchmark, which 02 runs first for its
    prediction (56 sizes x rank counts in 2 launches). Its minutes = (60 s + 8 x 40 s + the runs' costs) / 60,
    rounded up; the training runs' costs are 2 epochs at the anchors: e.g. DDP 1 x 32 = 2 x 41.3 s."""
    parts = tb.notebook_parts("02")
    runs = [p for p in parts if not p.start_up]
    starts = [p for p in parts if p.start_up]
    assert len(runs) == 24 + 56 and len(starts) == 1 + 6 + 2
    ddp_1_32 = next(p for p in runs if p.what == "DDP 1 x 32")
    assert ddp_1_32.seconds == pytest.approx(2 * 41.3) and ddp_1_32.gpus == 1
    full = profiles.settings(scaling.Settings, "full")
    costs = [scaling.cost(r) for r in plan.make_plan(scaling.SCALING_EXPERIMENT, full, BUDGET_NODE, "full")]
    bench = comm.ALLREDUCE_BENCH_EXPERIMENT
    bench_full = profiles.settings(comm.Settings, "full")
    costs += [comm.cost(r) for r in plan.make_plan(bench, bench_full, BUDGET_NODE, "full")]
    total = 60 + 8 * estimates.LAUNCH_S + sum(costs)
    assert sum(p.seconds for p in parts) == pytest.approx(total)
    assert tb.estimate_minutes("02") == -(-total // 60)
    # notebook 04 then finds the benchmark stored: only its compute-step runs count there
    only_04 = [p.what for p in tb.notebook_parts("04") if not p.start_up]
    assert only_04 == ["batch 32", "batch 128", "batch 512"]


def test_a_later_notebook_does_not_count_what_an_earlier_one_planned():
    """Notebook 03's plan holds notebook 02's T(1) and DataParallel runs (reused from its store): only its
    DDP runs with the communication probe (2 and 4 GPUs x 4 batch sizes, 2 launches) count."""
    runs = [p for p in tb.notebook_parts("03") if not p.start_up]
    assert len(runs) == 8 and {p.gpus for p in runs} == {2, 4}
    alone = tb.plan_parts(COMPUTE_VS_COMM_EXPERIMENT)  # on its own it would count them all
    assert len([p for p in alone if not p.start_up]) > 8


def test_every_measuring_notebook_is_summed_from_its_registered_plans():
    """Every notebook of labs/ but 00 has experiments in the registry, and its budget rows are their runs
    (no hand-written cost model is left: a notebook that measures must register to be budgeted)."""
    measured = [nb for nb in tb.notebooks() if nb != "00"]
    assert measured and all(registry.for_notebook(nb) for nb in measured)
    for nb in measured:
        runs = [p for p in tb.notebook_parts(nb) if not p.start_up]
        assert runs and all(p.seconds > 0 for p in runs), nb
    assert not hasattr(tb, "_LEGACY")


def test_an_experiment_without_a_cost_is_one_sentence():
    e = plan.Experiment("nocost", "02", scaling.Settings, scaling.plan)
    with pytest.raises(LabError, match="has no cost"):
        tb.plan_parts(e)


def test_budget_line_is_labelled_an_estimate():
    line = tb.budget_line("1")
    assert line == tb.budget_line("01")
    assert estimates.LABEL in line and f"~{tb.estimate_minutes('01')} min" in line and "\n" not in line
    with pytest.raises(LabError, match="No notebook"):
        tb.budget_line("42")


