"""Putting a prepared record into a store in a test, through the store's one door (``run``)."""

from __future__ import annotations

from typing import Any

from lab_utils.store import Record, ResultStore


def put(store: ResultStore, experiment: str, cfg: dict[str, Any], metrics: dict[str, Any] | None = None,
        **fields: Any) -> Record:
    """Store a record of ``cfg`` with ``metrics`` (and Record ``fields``), measured or not: ``store.run``
    with ``force=True``, as a measurement that returned exactly this record."""
    return store.run(experiment, cfg, lambda: Record(experiment, dict(cfg), dict(metrics or {}), **fields),
                     force=True, hardware=fields.get("hardware"))
