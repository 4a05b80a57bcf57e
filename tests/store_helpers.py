"""Putting a prepared record into a store in a test, through the store's one door (``run``)."""

from __future__ import annotations

from typing import Any

from lab_utils.engine.store import Record, ResultStore


def put(store: ResultStore, experiment: str, cfg: dict[str, Any], metrics: dict[str, Any] | None = None,
        **fields: Any) -> Record:
    """Store a record of ``cfg`` with ``metrics`` (and Record ``fields``), measured or not: ``store.run``
    with ``force=True``, as a measurement that returned exactly this record."""
    return store.run(experiment, cfg, lambda: Record(experiment, dict(cfg), dict(metrics or {}), **fields),
                     force=True, hardware=fields.get("hardware"))


def lab_for(store: ResultStore, device: str = "cpu", gpus: int = 0):
    """A notebook session stand-in for tests: the store's profile, the store, a device and a GPU count
    (what ``measure(lab, settings)`` reads of a :class:`lab_utils.engine.session.LabSession`)."""
    from types import SimpleNamespace

    import torch

    from lab_utils.engine import config, profiles

    return SimpleNamespace(profile=config.PROFILES[store.profile], store=store, device=torch.device(device),
                           gpu_count=gpus,
                           settings=lambda cls, **kw: profiles.settings(cls, store.profile, **kw))
