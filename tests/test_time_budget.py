"""The GPU time budget: one row per notebook, the README carries the same table."""

import re

import pytest

from lab_utils import time_budget as tb
from lab_utils.core.config import repo_root
from lab_utils.core.errors import LabError


def test_table_has_every_notebook_and_a_total():
    df = tb.budget_table()
    assert list(df["notebook"]) == [*tb.NOTEBOOKS, "all"]
    minutes = list(df["estimated minutes"])
    assert all(m >= 1 for m in minutes)
    assert minutes[-1] == sum(minutes[:-1])


def test_flop_constant_matches_the_counter():
    from lab_utils.experiments.sweep import flops_per_image

    assert tb.RESNET_TRAIN_FLOPS_PER_IMAGE == pytest.approx(flops_per_image(64).train_flops, rel=1e-3)


def test_spec_epoch_is_anchored_on_published_times():
    assert tb.spec_epoch_seconds(1, 128) == 33.64  # as published (core.anchors.FIRST_COHORT_TABLE1_SECONDS)
    assert tb.spec_epoch_seconds(4, 2048) == 9.01  # above 512: the 512 time
    assert tb.spec_epoch_seconds(1, 32) > tb.spec_epoch_seconds(1, 128)
    assert tb.fast_epoch_seconds("bf16") < tb.spec_epoch_seconds(1, 128)


def test_budget_line_is_labelled_an_estimate():
    line = tb.budget_line("1")
    assert line == tb.budget_line("01")
    assert tb.LABEL in line and f"~{tb.estimate_minutes('01')} min" in line and "\n" not in line
    with pytest.raises(LabError, match="No notebook"):
        tb.budget_line("42")


def test_readme_table_matches_the_function():
    readme = (repo_root() / "README.md").read_text(encoding="utf-8")
    m = re.search(r"<!-- time-budget:start -->\n(.*?)\n<!-- time-budget:end -->", readme, re.S)
    assert m, "README.md lacks the time-budget block (<!-- time-budget:start --> ... end)"
    assert m.group(1).strip() == tb.budget_markdown().strip(), (
        "README's time budget is stale: paste lab_utils.time_budget.budget_markdown() between the markers")
