"""One record per configuration over its repeats (:func:`merge_repeats`) and the spread a merged record
holds (:func:`spread_of_record`): what every table of notebooks 01-03 reads. The statistics themselves
(:func:`~lab_utils.learn.spread.time_spread`, what the spread and the standard error are) live in
:mod:`lab_utils.learn.spread`."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from lab_utils.engine.records import Record, canonical_key, is_rank_record
from lab_utils.learn.spread import REPEAT, TIME_MEDIAN, Spread, time_spread


def base_key(config: Mapping[str, Any]) -> str:
    """The key of a configuration with its repeat number left out: all repeats of one share it."""
    return canonical_key({k: v for k, v in config.items() if k != REPEAT})


def merge_repeats(records: Sequence[Record]) -> list[Record]:
    """One record per configuration (its config without ``repeat``), in first-seen order, with the
    :data:`~lab_utils.learn.spread.SPREAD_KEYS` in its metrics (``repeats``: the ok measurements merged).

    The ok repeats become the metrics of the one whose ``train_seconds`` is the lower median (its own
    ``train_seconds`` kept, so its phases still add up to it), with :data:`TIME_MEDIAN`, the MEDIAN over
    the repeats, and the spread of :func:`time_spread`; with no ok repeat, the first record. Per-rank
    records are kept for the first measurement only.
    """
    groups: dict[str, list[Record]] = {}
    order: list[str | Record] = []  # a configuration's key, or a per-rank record kept as it is
    for r in records:
        if is_rank_record(r):
            if not r.config.get(REPEAT):
                order.append(r)
            continue
        k = base_key(r.config)
        if k not in groups:
            order.append(k)
        groups.setdefault(k, []).append(r)
    out = []
    for k in order:
        if isinstance(k, Record):
            out.append(k)
            continue
        group = groups[k]
        ok = [r for r in group if r.status == "ok"]
        first = group[0]
        config = {c: v for c, v in first.config.items() if c != REPEAT}
        if not ok:
            out.append(replace(first, config=config))
            continue
        spread = time_spread([r.metrics for r in ok])
        times = [r.metrics["train_seconds"] for r in ok if r.metrics.get("train_seconds") is not None]
        low_median = statistics.median_low(times) if times else None
        rep = next((r for r in ok if r.metrics.get("train_seconds") == low_median), ok[0])
        metrics = dict(rep.metrics)
        metrics.update({TIME_MEDIAN: statistics.median(times) if times else None,
                        "spread_pct": spread and spread.pct, "spread_of": spread and spread.of,
                        "spread_low_seconds": spread and spread.low_seconds,
                        "spread_high_seconds": spread and spread.high_seconds, "repeats": len(ok),
                        "stderr_seconds": spread and spread.stderr_seconds,
                        "stderr_pct": spread and spread.stderr_pct})
        out.append(replace(rep, config=config, metrics=metrics))
    return out


def spread_of_record(record: Record | None) -> Spread | None:
    """The spread :func:`merge_repeats` put into a merged record (None: none, or not merged)."""
    if record is None or record.status != "ok":
        return None
    m = record.metrics
    if m.get("spread_low_seconds") is None or m.get(TIME_MEDIAN) is None:
        return None
    se = m.get("stderr_seconds")
    return Spread(float(m[TIME_MEDIAN]), float(m["spread_low_seconds"]), float(m["spread_high_seconds"]),
                  m.get("spread_pct"), m.get("spread_of") or "", int(m.get("repeats") or 1),
                  None if se is None else float(se))
