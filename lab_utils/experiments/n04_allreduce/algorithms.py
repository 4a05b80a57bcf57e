"""Notebook 04's comparison of all-reduce algorithms: ring vs tree vs an earlier student's log2
formula at the fitted alpha and B (:func:`compare_algorithms`, table ``allreduce_models``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from lab_utils.learn.alpha_beta import AlphaBetaFit
from lab_utils.learn.ring import ALGORITHMS, ring_bytes_per_rank, spec_log2_seconds

__all__ = ["compare_algorithms", "report_models"]


def report_models(store, size_bytes: int, fit: AlphaBetaFit | None, records: Sequence):
    """Table ``allreduce_models``: ring vs tree vs an earlier student's log2 formula at the fitted
    alpha, B on 2 to 1,024 ranks (None without a fit)."""
    if fit is None:
        return None
    df = compare_algorithms(size_bytes, (2, 4, 8, 64, 1024), fit.alpha_seconds, fit.bandwidth_bytes_per_s)
    store.save_table(df, "allreduce_models", records,
                     title=f"Modelled all-reduce of {size_bytes:,} B "
                           f"(alpha, B fitted on {fit.world_size} ranks)",
                     notes=["earlier student's formula (transfer + compute) x log2(P), not the "
                            "assignment's (which asks for the ring), evaluated with transfer = S/B and "
                            "compute = 0."])
    return df


EARLIER_LOG2_COLUMN = "earlier student's (S/B)*log2(P) (ms)"


def compare_algorithms(size_bytes: float, world_sizes: Iterable[int], alpha_seconds: float,
                       bandwidth_bytes_per_s: float):
    """A DataFrame: modelled all-reduce milliseconds of each algorithm per P, and the earlier student's
    log2 formula at ``transfer = S / B``, ``compute = 0`` (its most favourable reading)."""
    import pandas as pd

    rows = []
    for p in world_sizes:
        row: dict[str, Any] = {"devices": p, "message_bytes": int(size_bytes)}
        for name, fn in ALGORITHMS.items():
            row[f"{name} (ms)"] = 1e3 * fn(size_bytes, p, alpha_seconds, bandwidth_bytes_per_s)
        row[EARLIER_LOG2_COLUMN] = 1e3 * spec_log2_seconds(size_bytes / bandwidth_bytes_per_s, 0.0, p)
        row["ring bytes sent per rank"] = ring_bytes_per_rank(size_bytes, p)
        rows.append(row)
    return pd.DataFrame(rows)
