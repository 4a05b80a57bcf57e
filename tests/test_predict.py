"""The predict-then-measure table: the student's prediction beside the measurement and the lab's model."""

from __future__ import annotations

import pandas as pd
import pytest

from lab_utils.app.grading.predict import NOT_DONE, error_pct, prediction_table


def _model(t1, n):
    return t1 / n


def test_error_is_signed_percent_of_the_measurement():
    assert error_pct(11.0, 10.0) == pytest.approx(10.0)
    assert error_pct(9.0, 10.0) == pytest.approx(-10.0)
    assert error_pct(None, 10.0) is None and error_pct(5.0, None) is None and error_pct(5.0, 0.0) is None


def test_rows_hold_measurement_model_prediction_and_errors():
    cases = [{"t1": 40.0, "n": 2}, {"t1": 40.0, "n": 4}]
    table = prediction_table(lambda t1, n: t1 / n * 1.1, cases, [25.0, None], _model, labels=["2", "4"])
    assert list(table["configuration"]) == ["2", "4"]
    assert list(table["measured_seconds"])[0] == 25.0
    assert list(table["lab_model_seconds"]) == [20.0, 10.0]
    assert table["lab_model_error_pct"][0] == pytest.approx(-20.0)   # (20 - 25) / 25
    assert table["your_prediction_seconds"][0] == pytest.approx(22.0)
    assert table["your_error_pct"][0] == pytest.approx(-12.0)        # (22 - 25) / 25
    assert pd.isna(table["your_error_pct"][1])                      # not measured: no error


def test_a_blank_or_failing_prediction_says_so_and_the_table_still_builds():
    cases = [{"t1": 40.0, "n": 2}]
    blank = prediction_table(lambda t1, n: None, cases, [25.0], _model)
    assert blank["your_prediction_seconds"][0] == NOT_DONE and pd.isna(blank["your_error_pct"][0])
    failing = prediction_table(lambda t1, n: 1 / 0, cases, [25.0], _model, show=["n"])
    assert failing["your_prediction_seconds"][0].startswith("raised ZeroDivisionError")
    assert list(failing.columns)[0] == "n"
    with pytest.raises(ValueError, match="1 cases but 2 measurements"):
        prediction_table(None, cases, [1.0, 2.0], _model)
