"""The row helpers every notebook's tables share: a missing value's blank cell, and T(1) of a T(N) row.

Which record is a run's aggregate and which a rank's is the record's own business
(:func:`lab_utils.engine.records.is_rank_record`); a table picks runs with
:func:`lab_utils.engine.records.aggregates`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from lab_utils.engine.records import Record, aggregates

__all__ = ["PAIR_KEYS", "blank", "blank_missing", "one_device_runs", "pair_key"]


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
