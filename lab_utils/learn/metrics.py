"""The glossary: every metric name a record holds, its one definition, and its unit.

One meaning per name, everywhere in the lab; a name that would mean something else gets another:
``images_per_s`` is always over ``train_seconds`` (loader waits excluded), the fast path's rate over the whole
epoch is ``epoch_images_per_s``, the loader's own ``loader_images_per_s`` (of its ``loader_images``:
``images`` are always trained on). The entries are kept by topic in ``glossary_training``, ``glossary_comm``
and ``glossary_runs``; :func:`define` also resolves the ``_mean``, ``_max`` or ``_min`` an aggregate over
ranks (:mod:`lab_utils.learn.ranks`) adds to a time. ``tests/test_metrics_glossary.py`` checks that no
definition says the same thing twice, ``tests/test_notebooks.py`` that every metric key a notebook run writes
is defined here.

Units: ``s`` seconds, ``us`` microseconds, ``bytes`` (decimal multiples in tables: MB = 1e6), ``GB/s`` decimal
(1e9, as nccl-tests), ``count``, ``fraction`` (0..1), ``%`` (0..100), ``nats`` (natural-log cross-entropy),
``lr`` (a learning rate), ``-`` (text, a flag, or a nested structure described in the definition).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lab_utils.learn import glossary_comm, glossary_runs, glossary_training


@dataclass(frozen=True)
class Metric:
    """One metric: its name, what it is (what it includes and excludes), its unit."""

    name: str
    definition: str
    unit: str


_ENTRIES: tuple[tuple[str, str, str], ...] = (*glossary_training.ENTRIES, *glossary_comm.ENTRIES,
                                              *glossary_runs.ENTRIES)

GLOSSARY: dict[str, Metric] = {n: Metric(n, d, u) for n, d, u in _ENTRIES}


RANK_SUFFIXES = {"_mean": "mean over ranks", "_max": "maximum over ranks", "_min": "minimum over ranks"}


def define(name: str) -> Metric | None:
    """The glossary's entry for ``name`` (an aggregate's ``<time>_mean`` / ``_max`` / ``_min`` too)."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    for suffix, what in RANK_SUFFIXES.items():
        base = name.removesuffix(suffix)
        if base != name and base in GLOSSARY and GLOSSARY[base].unit == "s":
            m = GLOSSARY[base]
            return Metric(name, f"{what} of {base}: {m.definition}", m.unit)
    return None


def unknown(names: Iterable[str]) -> list[str]:
    """The names that are not in the glossary (sorted)."""
    return sorted({n for n in names if define(n) is None})


def note(name: str) -> str:
    """``name: definition (unit)``, for a table's notes."""
    m = define(name)
    if m is None:
        raise KeyError(f"{name!r} is not in lab_utils.learn.metrics; define it there first")
    return f"{m.name}: {m.definition} ({m.unit})"
