"""Predict, then measure: a student's prediction beside the measurement and the lab's own model.

A predict-then-measure exercise asks for a function that predicts a quantity from numbers measured
earlier in the lab (an epoch time from t(1) and the all-reduce fit, a learning rate from the recipe).
After the notebook measures that quantity, :func:`prediction_table` shows, per configuration, the
measurement, the lab's reference model, the student's prediction and each one's error in % of the
measurement. A blank or failing student function leaves its columns saying so; the notebook goes on.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

NOT_DONE = "not done yet"


def error_pct(predicted: float | None, measured: float | None) -> float | None:
    """100 x (predicted - measured) / measured; None when either is missing or the measurement is 0."""
    if predicted is None or measured is None or not math.isfinite(predicted) or not measured:
        return None
    return 100.0 * (predicted - measured) / measured


def _call(fn: Callable | None, case: Mapping[str, Any]) -> tuple[float | None, str]:
    """(the prediction, "") or (None, why there is none) for ``fn(**case)``."""
    if fn is None:
        return None, NOT_DONE
    try:
        value = fn(**case)
    except Exception as e:  # the student's function failing is a cell of the table, not a traceback
        return None, f"raised {type(e).__name__}: {e}"[:80]
    if value is None:
        return None, NOT_DONE
    try:
        return float(value), ""
    except (TypeError, ValueError):
        return None, f"returned a {type(value).__name__}, not a number"


def one_output(fn: Callable | None, index: int) -> Callable | None:
    """``fn``'s ``index``-th returned value as a function of the same keyword arguments, for a prediction
    of several values (a learning rate and a warm-up; (b) and (c)): None stays None, and so does a None
    answer, so that a blank student function shows "not done yet"."""
    if fn is None:
        return None

    def one(**kwargs):
        answer = fn(**kwargs)
        return None if answer is None else answer[index]

    return one


def prediction_table(predict: Callable | None, cases: Sequence[Mapping[str, Any]],
                     measured: Sequence[float | None], reference: Callable, *,
                     show: Sequence[str] | None = None, labels: Sequence[str] | None = None,
                     unit: str = "seconds"):
    """One row per case: its inputs (``show``: which of them, default all), the measured value, the lab's
    reference model ``reference(**case)``, the student's ``predict(**case)``, and both errors in % of the
    measurement. ``measured[i]`` is None for a configuration that was not measured (its errors stay
    blank). ``labels`` name the rows (a ``configuration`` column). Values are in ``unit`` (a column-name
    suffix: ``seconds``, ``gb_per_s``, ...). Returns a pandas DataFrame."""
    import pandas as pd

    if len(measured) != len(cases):
        raise ValueError(f"prediction_table: {len(cases)} cases but {len(measured)} measurements.")
    rows = []
    for i, (case, meas) in enumerate(zip(cases, measured)):
        row: dict[str, Any] = {}
        if labels is not None:
            row["configuration"] = labels[i]
        row.update({k: case[k] for k in (show if show is not None else case)})
        model, _ = _call(reference, case)
        mine, why = _call(predict, case)
        row[f"measured_{unit}"] = meas
        row[f"lab_model_{unit}"] = model
        row["lab_model_error_pct"] = error_pct(model, meas)
        row[f"your_prediction_{unit}"] = mine if why == "" else why
        row["your_error_pct"] = error_pct(mine, meas)
        rows.append(row)
    return pd.DataFrame(rows)
