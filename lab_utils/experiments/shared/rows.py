"""The row helpers every notebook's tables share: a record's number (:func:`value`,
:func:`per_step`), a missing value's blank cell, and T(1) of a T(N) row. The names are the glossary's
(:mod:`lab_utils.learn.metrics`).

Which record is a run's aggregate and which a rank's is the record's own business
(:func:`lab_utils.engine.records.is_rank_record`); a table picks runs with
:func:`lab_utils.engine.records.aggregates`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from lab_utils.engine.records import Record, aggregates
from lab_utils.learn.spread import TIME_MEDIAN

__all__ = ["PAIR_KEYS", "T_N", "blank", "blank_missing", "is_missing", "one_device_runs", "pair_key",
           "per_step", "value"]


def blank(v: Any) -> Any:
    """``v``, or None (an empty cell in a notebook's table and in the saved ``.md`` and ``.csv``) when it is
    None or NaN. None, not "": a column of numbers with a blank in it still reads as numbers
    (right-aligned)."""
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def blank_missing(df):
    """Every missing cell of ``df`` (NaN, None) as None, the columns as objects: the tables show an empty
    cell, not 'nan'. Returns ``df`` itself, changed."""
    for c in df.columns:
        if df[c].isna().any():
            df[c] = df[c].astype(object).where(df[c].notna(), None)
    return df


#: What pairs an N-device row with its one-device run: the same method, per-device batch and device type
#: (a gloo CPU run is not timed against a GPU's T(1)). A record without one of these keys (the GPT's have
#: no ``method``) pairs on the others.
PAIR_KEYS = ("method", "batch_size", "device_type")


def pair_key(record: Record) -> tuple:
    """The values of :data:`PAIR_KEYS` in ``record``'s config (None for a key it does not have)."""
    return tuple(record.config.get(k) for k in PAIR_KEYS)


def one_device_runs(records: Iterable[Record]) -> Mapping[tuple, Record]:
    """T(1) of every T(N) row: the ok one-device aggregates among ``records`` by :func:`pair_key`; an
    N-device record's is ``one_device_runs(records).get(pair_key(rec))`` (None: not measured)."""
    return {pair_key(r): r for r in aggregates(records) if r.status == "ok" and r.config.get("devices") == 1}


#: The metric that IS T(N) in notebooks 02 and 03 (and every speedup built on it): a table row's
#: ``train_seconds_median``, the median over its repeats
#: (:func:`lab_utils.experiments.shared.repeats.merge_repeats`) of an aggregate record's ``train_seconds``,
#: the slowest rank's (:func:`lab_utils.learn.ranks.aggregate_epoch`). The GPT of notebook 06 times an
#: uninstrumented pass instead: its T(N) is ``epoch_seconds``
#: (:data:`lab_utils.experiments.n06_gpt_ddp.tables.GPT_T_N`).
T_N = TIME_MEDIAN


def value(record: Any, name: str) -> float | None:
    """The number ``name`` of an ``ok`` record's metrics; None (a blank table cell) when the record
    is missing, not ok, or does not hold it. ``value(rec, T_N)`` is T(N)."""
    if record is None or getattr(record, "status", None) != "ok":
        return None
    v = record.metrics.get(name)
    return float(v) if v is not None else None


def per_step(record: Any, name: str = T_N) -> float | None:
    """The record's ``name`` (T(N) by default) per optimizer step: ``value(record, name) / steps``; None when
    either is missing or the record is not ok. Table 1's ``TN_seconds_per_step`` and every t(1) per step."""
    v, steps = value(record, name), record.metrics.get("steps") if record is not None else None
    return v / steps if v is not None and steps else None


def is_missing(v: Any) -> bool:
    """None, NaN or not a number: a blank cell."""
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return True
