"""The result store: records are the unit of truth.

Every measured configuration becomes one JSON record (:class:`~lab_utils.engine.records.Record`: its
configuration, profile, hardware, software, backends, data, timestamp, status ``ok``/``oom``/
``skipped``/``error``, reason and metrics) appended as one line to
``results/<profile>/runs/<experiment>.jsonl``. :meth:`ResultStore.run_many` is the only way a record
is written, by the parent process (workers hand theirs back through the launcher's records file). A
configuration already stored is not measured again unless ``force=True`` (a notebook restarted after
a dead kernel resumes where it stopped), but only when it was measured on this machine's devices (the
same device name and count), so a results folder shared by A100, H100 and V100 partitions never mixes
GPUs in one table. An append is one ``write`` of a whole line and an ``fsync`` under an exclusive
lock: a crash never leaves a half record taken for a whole one (a torn last line is skipped, with a
warning).

Tables are saved as Markdown and CSV under ``tables/``, figures as PNG under ``figures/``, each with a
provenance label (profile, data, device) so that a pasted table cannot pass for something it is not.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import json
import math
import numbers
import os
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lab_utils.engine import config, table_view
from lab_utils.engine.hardware import device_name, gpu_count, hardware_summary, software_versions
from lab_utils.engine.records import (  # the record and its key live in core: workers build records too
    STATUSES,
    Record,
    canonical_key,
    configuration_key,
    jsonable,
    same_devices,
)
from lab_utils.learn.errors import LabError, WriteError, write_failure

__all__ = ["QUICK_WATERMARK", "REUSED", "SIGNIFICANT_DIGITS", "STATUSES", "Record", "ResultStore",
           "canonical_key", "display_table", "format_number", "formatted_frame", "is_percent_column",
           "markdown_table", "provenance_label"]

#: Drawn across every figure saved in the quick profile.
QUICK_WATERMARK = "quick profile: mechanics, not results"

#: Significant digits shown in notebook tables and in the saved ``.md`` tables.
SIGNIFICANT_DIGITS = 4

#: Statuses of a stored record that :meth:`ResultStore.run` reuses: a measurement, an
#: out-of-memory result, a row deliberately not measured for a reason that holds for its
#: configuration. An ``error`` record (a failed run) is measured again next time.
REUSED = ("ok", "oom", "skipped")


class ResultStore:
    """Append-only JSONL records under ``results/<profile>/runs/``.

    >>> store = ResultStore("quick")
    >>> rec = store.run("batch_sweep", {"batch_size": 32}, measure)  # doctest: +SKIP
    """

    def __init__(self, profile: str | config.Profile | None = None, root: Path | None = None):
        name = profile.name if isinstance(profile, config.Profile) else None
        self.profile = name or config.resolve_profile_name(profile)[0]  # type: ignore[arg-type]
        self.root = Path(root) if root is not None else config.results_dir(self.profile)

    # -- paths
    @property
    def runs_dir(self) -> Path:
        return self.root / "runs"

    @property
    def tables_dir(self) -> Path:
        return self.root / "tables"

    @property
    def figures_dir(self) -> Path:
        return self.root / "figures"

    def path(self, experiment: str) -> Path:
        if not experiment or "/" in experiment or experiment.startswith("."):
            raise LabError(f"Experiment name {experiment!r} must be a plain file name like 'batch_sweep'.")
        return self.runs_dir / f"{experiment}.jsonl"

    # -- reading
    def records(self, experiment: str) -> list[Record]:
        """All records of an experiment in the order they were written."""
        p = self.path(experiment)
        if not p.exists():
            return []
        out: list[Record] = []
        with p.open("r", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.endswith("\n"):
                    warnings.warn(f"{p}:{lineno}: skipping a torn last line (an interrupted write).",
                                  stacklevel=2)
                    continue
                if not line.strip():
                    continue
                try:
                    out.append(Record.from_dict(json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    warnings.warn(f"{p}:{lineno}: skipping a line that is not a record.", stacklevel=2)
        return out

    def latest(self, experiment: str) -> list[Record]:
        """One record per configuration: the most recent one."""
        return _newest_per_key(self.records(experiment))

    def latest_here(self, experiment: str, machine: Mapping[str, tuple[str, int | None]] | None = None
                    ) -> HereRecords:
        """One record per configuration, the most recent one *measured on this machine's devices*.

        THE rule of every table that pairs records across runs (T(1) with T(N), a projection's
        compute time, a run's per-rank records): a record counts when its device name is this
        machine's (for its device type) and its device count one this machine has (``machine``:
        :func:`this_machine`). Records of other devices, which a results folder shared across
        partitions holds, are left out and counted, so the table can say so (:meth:`HereRecords.note`).
        """
        machine = dict(machine) if machine is not None else this_machine()
        kept, left = [], Counter()
        for r in self.records(experiment):
            if on_this_machine(r.hardware, machine):
                kept.append(r)
            else:
                hw = r.hardware or {}
                left[f"{hw.get('device_name') or 'unknown devices'} x {hw.get('device_count', '?')}"] += 1
        types = {(r.hardware or {}).get("device_type", "cpu") for r in kept} or set(machine)
        return HereRecords(_newest_per_key(kept), describe_machine_devices(machine, types), dict(left))

    def here_note(self, *experiments: str) -> str:
        """One sentence for a table built from ``experiments``: which devices' records it uses, and how
        many records of other devices it left out (:meth:`latest_here`)."""
        parts = [self.latest_here(e) for e in experiments]
        left = sum((Counter(h.left_out) for h in parts), Counter())
        devices = "; ".join(dict.fromkeys(h.devices for h in parts)) if parts else ""
        return HereRecords([], devices, dict(left)).note()

    def get(self, experiment: str, cfg: Mapping[str, Any]) -> Record | None:
        """The most recent record for exactly this configuration, if any."""
        key = canonical_key(cfg)
        return next((r for r in reversed(self.records(experiment)) if r.key == key), None)

    def reusable(self, experiment: str, cfg: Mapping[str, Any],
                 hardware: Mapping[str, Any] | None = None) -> Record | None:
        """THE reuse check of the lab: the most recent record for ``cfg`` if its status is one of
        :data:`REUSED` and it was measured on the devices ``hardware`` names (:func:`same_devices`: the
        same device name and count; default: this machine's default device), else None."""
        rec = self.get(experiment, cfg)
        if rec is None or rec.status not in REUSED:
            return None
        here = hardware if hardware is not None else hardware_summary()
        return rec if same_devices(rec.hardware, here) else None

    # -- writing: run() is the only way in
    def run(self, experiment: str, cfg: Mapping[str, Any],
            measure: Callable[[], Mapping[str, Any] | Record], force: bool = False,
            hardware: Mapping[str, Any] | None = None) -> Record:
        """Return the stored record for ``cfg`` (:meth:`reusable`, with ``hardware``), or measure
        it, store it and return it.

        ``measure()`` returns metrics (stored with ``hardware``, default this machine's) or a
        whole :class:`Record` (its own ``hardware`` is kept; its config becomes ``cfg``).
        """
        def one(todo: list[dict[str, Any]]) -> list[Record]:
            result = measure()
            if not isinstance(result, Record):
                result = Record(experiment, dict(cfg), jsonable(dict(result)),
                                hardware=dict(hardware) if hardware else {})
            result.config = jsonable(dict(cfg))
            return [result]

        rec = self.run_many(experiment, [cfg], one, force=force, hardware=hardware)[0]
        assert rec is not None  # one() always returns the record of cfg
        return rec

    def run_many(self, experiment: str, cfgs: Sequence[Mapping[str, Any]],
                 measure: Callable[[list[dict[str, Any]]], Iterable[Record]], force: bool = False,
                 hardware: Mapping[str, Any] | None = None) -> list[Record | None]:
        """:meth:`run` for several configurations measured by one call (one launch, one run).

        ``measure(todo)`` measures the configurations of ``todo`` (those not reusable, in
        order) and yields their records; each is stored the moment it is yielded, so a
        failure later in ``measure`` keeps it. A yielded record whose config is not in
        ``todo`` (e.g. a DDP run's per-rank records beside its aggregate) is stored too.
        Returns, per configuration of ``cfgs``, its reused or new record, or None when
        ``measure`` yielded none for it (the caller says why in a row it does not store).
        """
        cfgs = [jsonable(dict(c)) for c in cfgs]
        keys = [canonical_key(c) for c in cfgs]
        found = {} if force else {k: rec for k, c in zip(keys, cfgs)
                                  if (rec := self.reusable(experiment, c, hardware)) is not None}
        todo = [c for k, c in zip(keys, cfgs) if k not in found]
        if todo:
            wanted = {canonical_key(c) for c in todo}
            for rec in measure(todo):
                rec.experiment = experiment
                rec.config = jsonable(dict(rec.config))
                rec.metrics = jsonable(dict(rec.metrics))
                if not rec.hardware and hardware:
                    rec.hardware = dict(hardware)
                self._append(rec)
                if rec.key in wanted:
                    found[rec.key] = rec
        return [found.get(k) for k in keys]

    def _append(self, record: Record) -> Record:
        """Append one whole line atomically (lock, single write, fsync). Only :meth:`run_many` calls it."""
        if record.status not in STATUSES:
            raise LabError(f"Record status {record.status!r} is not one of {STATUSES}.")
        record.profile = record.profile or self.profile
        now = _dt.datetime.now(_dt.timezone.utc)  # noqa: UP017 (Python 3.10 has no datetime.UTC)
        record.timestamp = record.timestamp or now.isoformat(timespec="seconds")
        if not record.software:
            record.software = software_versions()
        if not record.hardware:
            record.hardware = hardware_summary()
        line = record.to_json() + "\n"
        p = self.path(record.experiment)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = line.encode("utf-8")
        try:
            fd = os.open(p, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise WriteError(write_failure(e, p.parent, f"the {record.experiment} record")) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            size = os.fstat(fd).st_size
            try:
                if os.write(fd, data) != len(data):  # a short write: the disk filled up under us
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            except OSError as e:
                # Cut the torn line off again, so that the next append after space is freed
                # starts on a fresh line and every record stored before stays readable.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise WriteError(write_failure(e, p.parent, f"the {record.experiment} record")) from None
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
        return record

    # -- tables and figures
    def save_table(self, df, name: str, records: Iterable[Record] | None = None,
                   title: str | None = None, notes: Iterable[str] = (),
                   digits: int = SIGNIFICANT_DIGITS) -> Path:
        """Save ``df`` as ``tables/<name>.md`` (with title, provenance and notes) and ``.csv``.

        The ``.md`` uses :func:`display_table`'s formatting (``digits`` significant digits,
        ``%`` on percent columns, no index); the ``.csv`` keeps the full numbers.
        """
        self.tables_dir.mkdir(parents=True, exist_ok=True)
        label = provenance_label(records, self.profile)
        md_path = self.tables_dir / f"{name}.md"
        body = markdown_table(df, digits)
        notes = [f"- {n}" for n in notes]
        parts = [f"### {title or name}", "", f"_{label}_", "", body, *([""] + notes if notes else [])]
        _atomic_write_text(md_path, "\n".join(parts) + "\n")
        csv = df.copy()
        csv.insert(0, "provenance", label)
        _atomic_write_text(self.tables_dir / f"{name}.csv", csv.to_csv(index=False))
        df.attrs[table_view.SAVED] = f"{self.tables_dir / name}.csv"   # the narrow view points at it
        return md_path

    def save_figure(self, fig, name: str, records: Iterable[Record] | None = None) -> Path:
        """Save a matplotlib figure as ``figures/<name>.png`` with the provenance label on it.

        In the quick profile the figure also gets a large diagonal watermark,
        :data:`QUICK_WATERMARK`: its numbers show the mechanics, not the assignment's results.
        """
        self.figures_dir.mkdir(parents=True, exist_ok=True)
        fig.text(0.99, 0.005, provenance_label(records, self.profile), ha="right", va="bottom",
                 fontsize=7, color="0.35")
        if self.profile == "quick" and not any(t.get_text() == QUICK_WATERMARK for t in fig.texts):
            fig.text(0.5, 0.5, QUICK_WATERMARK, ha="center", va="center", rotation=28,
                     fontsize=max(14.0, 2.6 * fig.get_figwidth()), color="red", alpha=0.18,
                     fontweight="bold", zorder=1000)
        path = self.figures_dir / f"{name}.png"
        tmp = path.with_suffix(".png.tmp")
        try:
            fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png")
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise WriteError(write_failure(e, path.parent, f"the figure {path.name}")) from None
        return path


def this_machine() -> dict[str, tuple[str, int | None]]:
    """This machine's devices by type: ``{"cuda": (GPU name, GPU count), "cpu": (CPU name, None)}``
    (the GPU named through nvidia-smi while CUDA is not initialised: no context is opened)."""
    out: dict[str, tuple[str, int | None]] = {"cpu": (device_name("cpu"), None)}
    n = gpu_count()
    if n:
        out["cuda"] = (device_name("cuda"), n)
    return out


def on_this_machine(hardware: Mapping[str, Any] | None,
                    machine: Mapping[str, tuple[str, int | None]]) -> bool:
    """A record's ``hardware`` is this machine's: its device name, and a device count the machine has
    (CPU processes: any count). A record without a device name cannot be tied to these devices."""
    hw = hardware or {}
    mine = machine.get(hw.get("device_type") or "cpu")
    name = hw.get("device_name")
    if not name or mine is None or name != mine[0]:
        return False
    return mine[1] is None or int(hw.get("device_count") or 1) <= mine[1]


def describe_machine_devices(machine: Mapping[str, tuple[str, int | None]], types: Iterable[str]) -> str:
    """``"NVIDIA H100 80GB HBM3, up to 4"`` (or the CPU's name) for the device types a table uses."""
    parts = []
    for t in sorted(types, key=lambda t: t != "cuda"):
        if t in machine:
            name, count = machine[t]
            parts.append(f"{name}, up to {count}" if count else name)
    return "; ".join(parts) or "none"


@dataclass
class HereRecords:
    """What :meth:`ResultStore.latest_here` returns: this machine's records, and what it left out."""

    records: list[Record]
    devices: str                   # this machine's devices, as the note names them
    left_out: dict[str, int]       # "<device name> x <count>" -> records of it left out

    def note(self) -> str:
        """``"Records of this machine's devices only (<devices>)[: N record(s) of other devices left out
        (<name> x <count>, ...)]."``"""
        head = f"Records of this machine's devices only ({self.devices})"
        n = sum(self.left_out.values())
        if not n:
            return head + "."
        return (f"{head}: {n} record{'s' if n != 1 else ''} of other devices left out "
                f"({', '.join(sorted(self.left_out))}).")


def _newest_per_key(records: Iterable[Record]) -> list[Record]:
    """One record per configuration, the last one, in the order the newest were written. A configuration
    measured again under a newer metrics version (:func:`~lab_utils.engine.records.configuration_key`) is
    one configuration: the older lab's record is left out."""
    by_key: dict[str, Record] = {}
    for r in records:
        key = configuration_key(r.config)
        by_key.pop(key, None)
        by_key[key] = r
    return list(by_key.values())


def is_percent_column(name: Any) -> bool:
    """True for a column holding percentages: its name has ``percent`` or ``pct`` or ends in ``%``.

    Such a column holds numbers already in percent (0.8629 means 0.8629 %), so they are
    shown with a ``%`` sign rather than multiplied by 100.
    """
    text = str(name).strip().lower()
    tokens = [t for t in re.split(r"[^a-z0-9]+", text) if t]
    return text.endswith("%") or "pct" in tokens or any(t.startswith("percent") for t in tokens)


def format_number(value: Any, digits: int = SIGNIFICANT_DIGITS, percent: bool = False) -> str:
    """One table cell as text: floats to ``digits`` significant digits, no exponent for usual sizes.

    ``40390.372158`` -> ``40390`` (whole numbers keep every integer digit), ``33.6449`` ->
    ``33.64``, ``0.0123456`` -> ``0.01235``; trailing zeros are dropped (``32.0`` -> ``32``),
    tiny or huge values use an exponent (``1.235e-07``). Integers, strings and booleans print as
    they are; a missing value (None, NaN) is an empty cell. ``percent`` appends ``%`` to numbers.
    """
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        text = str(int(value))
    elif isinstance(value, numbers.Real):
        x = float(value)
        if math.isnan(x):
            return ""
        if math.isinf(x):
            text = "inf" if x > 0 else "-inf"
        elif x == 0:
            text = "0"
        else:
            magnitude = math.floor(math.log10(abs(x)))
            if magnitude >= 12 or magnitude < -4:
                mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
                text = mantissa.rstrip("0").rstrip(".") + "e" + exponent
            elif magnitude >= digits - 1:
                text = f"{x:.0f}"
            else:
                text = f"{x:.{digits - 1 - magnitude}f}"
                if "." in text:
                    text = text.rstrip("0").rstrip(".")
            if text in ("-0", "-0.0"):
                text = "0"
    else:
        return str(value)
    return text + "%" if percent else text


def formatted_frame(df, digits: int = SIGNIFICANT_DIGITS):
    """``df`` with every cell as display text (:func:`format_number`; ``%`` on percent columns)."""
    out = df.copy().astype(object)
    for col in out.columns:
        pct = is_percent_column(col)
        out[col] = [format_number(v, digits, percent=pct) for v in df[col].tolist()]
    return out.reset_index(drop=True)


def display_table(df, digits: int = SIGNIFICANT_DIGITS, key=None):
    """A table for a notebook: ``digits`` significant digits, no index, ``%`` on percent columns, numbers
    right-aligned; in the narrow view of :func:`lab_utils.engine.table_view.narrow_view` (long texts as notes
    under it; a wide table shows the columns its maker listed in ``df.attrs["view"]`` and names the CSV
    that holds the rest, or else is shown in parts that each repeat the ``key`` columns).

    The same formatting rule as the saved ``tables/<name>.md`` (:meth:`ResultStore.save_table`, which
    keeps every column and every word), so what a notebook shows and what the report holds agree. A
    notebook cell ending with the returned view renders it as HTML.
    """
    numeric = [c for c in df.columns if _mostly_numeric(df[c])]
    return table_view.narrow_view(formatted_frame(df, digits), numeric, key=key,
                                  view=df.attrs.get(table_view.VIEW), saved=df.attrs.get(table_view.SAVED))


def _mostly_numeric(series) -> bool:
    vals = [v for v in series.tolist() if v is not None and v == v]
    return bool(vals) and all(isinstance(v, numbers.Number) and not isinstance(v, bool) for v in vals)


def markdown_table(df, digits: int = SIGNIFICANT_DIGITS) -> str:
    """``df`` as a Markdown table with :func:`display_table`'s number formatting."""
    text = formatted_frame(df, digits)
    align = ["right" if _mostly_numeric(df[c]) else "left" for c in df.columns]
    return text.to_markdown(index=False, disable_numparse=True, colalign=align or None)


def provenance_label(records: Iterable[Record] | None, profile: str) -> str:
    """A one-line label: profile, data (synthetic or real), devices, from the records."""
    recs = list(records or [])
    parts = [f"profile: {profile}" + (" (CPU/CI, reduced sizes)" if profile == "quick" else "")]
    datasets = sorted({r.dataset or "?" for r in recs if r.dataset or r.synthetic is not None})
    if any(r.synthetic for r in recs):
        parts.append("data: SYNTHETIC stand-in" + (f" ({', '.join(datasets)})" if datasets else ""))
    elif datasets:
        parts.append(f"data: {', '.join(datasets)}")
    recs = [r for r in recs if r.status != "skipped"] or recs  # a row not measured ran on no device
    devices = sorted({str(r.hardware["device_name"]) for r in recs if (r.hardware or {}).get("device_name")})
    if devices:
        parts.append(f"device: {', '.join(devices)}")
    threads = sorted({r.threads for r in recs if r.threads is not None})
    if threads:
        parts.append(f"torch threads/process: {', '.join(map(str, threads))}")
    return " · ".join(parts)


def _atomic_write_text(path: Path, text: str) -> None:
    """Write via a temporary file, fsync, rename: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # the old file, if any, is left whole
        tmp.unlink(missing_ok=True)
        raise WriteError(write_failure(e, path.parent, path.name)) from None
