"""The record, the unit of truth, and the one file protocol by which records travel.

A :class:`Record` is one measured (or deliberately not measured) configuration: its
``config`` (the resume key), ``metrics`` (named in :mod:`lab_utils.learn.metrics`), a
status (``ok``, ``oom``, ``skipped``, ``error``), the reason when not ``ok``, and where it
was measured (profile, hardware, software, cuDNN/matmul settings, torch threads, data).

Records travel one way (``DESIGN.md``, "Architecture"): a worker's rank 0 appends them to the
file named by ``--out`` (:func:`append_records`), the launcher reads it while the run goes on
(:class:`RecordsReader`; a torn last line is read only once whole) and hands them to the parent,
which alone writes the result store (:meth:`lab_utils.engine.store.ResultStore.run`).

Nothing here imports the store, so the workers can build records without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from lab_utils.engine.backends import backend_settings

STATUSES = ("ok", "oom", "skipped", "error")


def jsonable(obj: Any) -> Any:
    """Convert dataclasses, tuples, paths and numpy/torch scalars to JSON types (NaN -> None)."""
    if is_dataclass(obj) and not isinstance(obj, type):
        return jsonable(asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        try:
            return obj.item()
        except (TypeError, ValueError):
            pass
    if isinstance(obj, float) and obj != obj:  # NaN is not valid JSON
        return None
    return obj


def canonical_key(cfg: Mapping[str, Any]) -> str:
    """The configuration as canonical JSON: equal configs give equal keys."""
    return json.dumps(jsonable(dict(cfg)), sort_keys=True, separators=(",", ":"))


#: The config key that names the version of a worker's metrics (:func:`lab_utils.engine.plan.versioned`).
METRICS_VERSION_KEY = "metrics_version"


def configuration_key(cfg: Mapping[str, Any]) -> str:
    """What was configured, whichever lab measured it: the canonical key without ``metrics_version``.
    Reuse needs the whole key (the same version); a table shows one record per configuration, the newest."""
    return canonical_key({k: v for k, v in cfg.items() if k != METRICS_VERSION_KEY})


def torch_threads() -> int | None:
    """torch's intra-op thread count in this process (None when torch cannot say)."""
    try:
        import torch

        return int(torch.get_num_threads())
    except Exception:  # a record must be buildable even where torch misbehaves
        return None


@dataclass
class Record:
    """One measured (or deliberately not measured) configuration."""

    experiment: str
    config: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    status: str = "ok"
    reason: str | None = None
    profile: str = ""
    synthetic: bool | None = None
    dataset: str | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    software: dict[str, Any] = field(default_factory=dict)
    timestamp: str = ""
    #: the measuring process's cuDNN / matmul settings (:mod:`lab_utils.engine.backends`) and torch
    #: intra-op threads (CPU timings depend on them), taken when the record is built; ``{}`` and
    #: ``None`` in records stored before these fields existed.
    backends: dict[str, Any] = field(default_factory=backend_settings)
    threads: int | None = field(default_factory=torch_threads)

    @property
    def key(self) -> str:
        return canonical_key(self.config)

    def to_json(self) -> str:
        return json.dumps(jsonable(asdict(self)), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Record:
        known = {f for f in cls.__dataclass_fields__}
        # a stored record without ``backends`` predates it: its settings are unknown, not the reader's
        return cls(**{"backends": {}, "threads": None, **{k: v for k, v in d.items() if k in known}})


def same_devices(stored: Mapping[str, Any], here: Mapping[str, Any]) -> bool:
    """A stored record's ``hardware`` is ``here``'s: the same device name and device count (a record
    without a device name, old or never run, cannot be tied to these devices: no match)."""
    name = stored.get("device_name")
    return bool(name) and name == here.get("device_name") and stored.get("device_count") == here.get(
        "device_count")


# --------------------------------------------------------------------------- a run's record and its ranks'

#: How records are written: a DDP worker's rank 0 writes its run's record (``config["record"]``
#: "aggregate", ``"rank"`` None) and one record per rank (``{**config, "record": "rank", "rank": r}``); a
#: one-process worker (the sweep, the fast path, ...) writes one record with no ``"record"`` key. So the one
#: rule: a record is a rank's when its ``config["record"]`` is "rank"; every other record is its run's.
RANK = "rank"


def is_rank_record(record: Record) -> bool:
    """``record`` is one rank's (of a DDP run), not a run's own record (:data:`RANK`)."""
    return record.config.get("record") == RANK


def aggregates(records: Iterable[Record]) -> list[Record]:
    """The one record per run among ``records``: all but the per-rank ones (:func:`is_rank_record`)."""
    return [r for r in records if not is_rank_record(r)]


def run_key(record: Record) -> str:
    """The key of the run ``record`` belongs to: its own, or for a rank's record its run's record's."""
    if is_rank_record(record):
        return canonical_key({**record.config, "record": "aggregate", "rank": None})
    return record.key


def ranks_of(run: Any, records: Iterable[Record]) -> list[Record]:
    """The per-rank records among ``records`` of ``run`` (a run's record, or anything with its ``key``)."""
    return [r for r in records if is_rank_record(r) and run_key(r) == run.key]


# --------------------------------------------------------------------------- the file protocol


def append_records(path: str | Path | None, records: Iterable[Record]) -> None:
    """Append ``records`` to ``path`` as whole JSON lines, flushed and fsynced (a worker's rank 0, once
    per finished configuration: they survive a later one's failure). No ``path``: nothing."""
    if not path:
        return
    data = "".join(r.to_json() + "\n" for r in records).encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


class RecordsReader:
    """Reads the records appended to a file so far, each one once (the launcher's side); a line still
    being written is left for the next call of :meth:`new`."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._offset = 0

    def new(self) -> list[Record]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self._offset += end
        return [Record.from_dict(json.loads(line)) for line in data[:end].splitlines() if line.strip()]


# --------------------------------------------------------------------------- a rank's failure

FAILURE_FILE = "failure-rank{rank}.json"


#: Where a failure goes when the job runs in this process (no launch folder): set by
#: :func:`failures_to` around an in-process job, so that a run the watchdog ends still leaves its row.
_IN_PROCESS_SINK: Callable[[dict[str, Any]], None] | None = None


@contextlib.contextmanager
def failures_to(sink: Callable[[dict[str, Any]], None]) -> Iterator[None]:
    """Within the block, :func:`write_rank_failure` without a folder hands its data to ``sink``."""
    global _IN_PROCESS_SINK
    before, _IN_PROCESS_SINK = _IN_PROCESS_SINK, sink
    try:
        yield
    finally:
        _IN_PROCESS_SINK = before


def write_rank_failure(folder: str | Path | None, rank: int, status: str, reason: str,
                       config_index: int | None) -> None:
    """A failing rank's last word, ``<folder>/failure-rank<R>.json``: ``status`` ("oom" | "error"),
    one line of ``reason``, and which configuration of the job it was on. Best effort: the rank
    is ending anyway, and its log keeps the traceback. Without a folder (a job in this process) it
    goes to the sink of :func:`failures_to`, if any."""
    data = {"rank": rank, "status": status, "reason": reason, "config_index": config_index,
            "time": time.time()}
    if not folder:
        if _IN_PROCESS_SINK is not None:  # a run in this process: the plan stores it as the run's row
            _IN_PROCESS_SINK(data)
        return
    with contextlib.suppress(OSError):
        (Path(folder) / FAILURE_FILE.format(rank=rank)).write_text(json.dumps(data), encoding="utf-8")


def read_failures(folder: str | Path) -> list[dict[str, Any]]:
    """The failure files the ranks of a launch wrote into ``folder``, earliest first."""
    out = []
    for path in Path(folder).glob(FAILURE_FILE.format(rank="*")):
        try:
            out.append(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError):
            continue
    return sorted(out, key=lambda f: (f.get("time", 0.0), f.get("rank", 0)))


def run_records(experiment: str, config: Mapping[str, Any], metrics: dict[str, Any],
                gathered: Sequence[Mapping[str, Any]], common: Mapping[str, Any],
                rank_extra: Callable[[Mapping[str, Any]], Mapping[str, Any]], drop: Sequence[str] = ()
                ) -> list[Record]:
    """Rank 0's records of one DDP run: the run's record (``config``, ``metrics`` over the ranks) and one
    per rank, ``{**config, "record": "rank", "rank": r}``, holding its reported (last) epoch's entry
    (without ``epoch`` and ``drop``), ``reported_epoch``, every epoch and ``rank_extra(its results)``.
    ``common``: the Record fields both share (profile, data, hardware)."""
    records = [Record(experiment, dict(config), metrics, **common)]
    for r, g in enumerate(gathered):
        last = g["epochs"][-1]
        m = {k: v for k, v in last.items() if k not in ("epoch", *drop)}
        m.update(reported_epoch=last["epoch"], epochs=g["epochs"], **rank_extra(g))
        records.append(Record(experiment, {**config, "record": RANK, "rank": r}, m, **common))
    return records
