"""Where a student's numbers came from: ``handin.json`` (``make report``'s, format 1) read and checked
(:func:`read_handin`: a missing or malformed file is one sentence in the row, never a crash), and
the gradebook's columns, flags and notes from it, or from the notebooks' stamps (:func:`describe`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.app.handin import FORMAT

MAX_BYTES = 5_000_000
COLUMNS = ("profile", "device", "data", "lab version")
# The flags, as the gradebook and the feedback name them.
QUICK, SYNTHETIC, CPU, OTHER_VERSION, NO_HANDIN = ("quick profile", "synthetic data", "CPU (no GPU)",
                                                   "other lab version", "no handin.json")
# handin.json's tables that class_results compares: table -> (quantity, the row's number)
QUANTITIES = {"table1": ("speedup", "speedup"), "table3": ("gb_per_s", "gb_per_s")}


@dataclass
class Result:
    """One number of a student's Table 1 (speedup) or Table 3 (GB/s), measured ("ok")."""
    quantity: str          # "speedup" (T(1)/T(N), Table 1) or "gb_per_s" (decimal GB/s, Table 3)
    method: str
    gpus: int
    per_gpu_batch: int
    value: float


@dataclass
class HandIn:
    """A checked handin.json."""
    lab_version: str
    notebook_versions: dict[str, str]
    provenance: dict
    results: list[Result] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)     # what make report --check listed
    skipped: list[str] = field(default_factory=list)      # table rows that could not be used, and why

    @property
    def device(self) -> str:
        """``name x count`` (``NVIDIA A100-SXM4-40GB x 4``; the name alone when the count is unknown)."""
        count = self.provenance["device_count"]
        return f"{self.provenance['device']} x {count}" if count else self.provenance["device"]


def _number(row: dict, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _results(tables: dict) -> tuple[list[Result], list[str]]:
    """The measured rows of Tables 1 (speedup) and 3 (GB/s); the rows that could not be used, and why."""
    out, skipped = [], []
    for table, (quantity, key) in QUANTITIES.items():
        rows = tables.get(table, [])
        if not isinstance(rows, list):
            skipped.append(f"{table} is not a list of rows")
            continue
        for i, row in enumerate(rows, 1):
            if not isinstance(row, dict):
                skipped.append(f"{table} row {i} is not an object")
                continue
            if row.get("status") != "ok":
                continue          # not measured: its numbers are null by the format, and nothing to compare
            value = _number(row, key)
            if not isinstance(row.get("method"), str) or not _int(row.get("gpus")) \
                    or not _int(row.get("per_gpu_batch")) or value is None:
                skipped.append(f"{table} row {i} (status ok) lacks method, gpus, per_gpu_batch or a number "
                               f"{key}")
                continue
            out.append(Result(quantity, row["method"], row["gpus"], row["per_gpu_batch"], value))
    return out, skipped


def read_handin(path: Path) -> tuple[HandIn | None, str]:
    """(the checked handin.json, "") or (None, why it cannot be used, in one sentence)."""
    redo = "run `make report` again and hand in the folder it writes"
    try:
        size = Path(path).stat().st_size
        if size > MAX_BYTES:
            return None, f"handin.json is {size / 1e6:.0f} MB, not make report's ({redo})"
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"handin.json cannot be read ({getattr(e, 'strerror', None) or e}; {redo})"
    except json.JSONDecodeError as e:
        return None, f"handin.json is not JSON ({e.msg} at line {e.lineno}; {redo})"
    if not isinstance(data, dict):
        return None, f"handin.json is not a JSON object ({redo})"
    if data.get("format") != FORMAT:
        return None, (f"handin.json has format {data.get('format')!r}; this grader reads format {FORMAT} "
                      f"({redo})")
    prov, versions = data.get("provenance"), data.get("notebook_versions", {})
    if not isinstance(prov, dict):
        return None, f"handin.json has no provenance object ({redo})"
    # make report writes null for what no measured record told (device_type, device, device_count) and
    # the records' data sets as a list
    sets = prov.get("data")
    wrong = [k for k, ok in (("profile", isinstance(prov.get("profile"), str)),
                             ("device_type", prov.get("device_type") in ("cuda", "cpu", None)),
                             ("device", prov.get("device") is None or isinstance(prov.get("device"), str)),
                             ("device_count", prov.get("device_count") is None
                              or _int(prov.get("device_count"))),
                             ("data", isinstance(sets, str) or isinstance(sets, list)
                              and all(isinstance(d, str) for d in sets)),
                             ("synthetic", isinstance(prov.get("synthetic"), bool))) if not ok]
    if wrong:
        return None, f"handin.json's provenance lacks or mistypes {', '.join(wrong)} ({redo})"
    prov = {**prov, "data": sets if isinstance(sets, str) else ", ".join(sets) or "unknown",
            "device": prov.get("device") or "unknown", "device_count": prov.get("device_count") or 0}
    if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
        return None, f"handin.json's notebook_versions is not a map of notebook to version ({redo})"
    tables = data.get("tables", {})
    if not isinstance(tables, dict):
        return None, f"handin.json's tables is not an object ({redo})"
    results, skipped = _results(tables)
    problems = data.get("problems", [])
    return HandIn(str(data.get("lab_version", "")), dict(versions), prov, results,
                  [str(p) for p in problems] if isinstance(problems, list) else [], skipped), ""


@dataclass
class Provenance:
    """What the gradebook row says about where the numbers came from."""
    columns: dict[str, str]
    flags: list[str]
    notes: list[str]
    results: list[Result]
    device: str = ""           # the GPU model (device name): the group class_results compares within
    device_count: int = 0
    profile: str = ""


def _other_versions(versions: dict[str, str], manifest: dict) -> list[str]:
    """Notebooks whose stamped version differs from the grading bundle's (``05: abc (bundle: def)``)."""
    known = {**manifest.get("ungraded", {}), **manifest.get("notebooks", {})}
    return [f"{book[:2]}: {v} (bundle: {known[book]['version']})" for book, v in sorted(versions.items())
            if book in known and v != known[book]["version"]]


def describe(handin: HandIn | None, why: str, stamps: dict[str, str], manifest: dict) -> Provenance:
    """The row's columns, flags and notes from the student's handin.json (``why``: why none could be used)
    and the versions stamped in the notebooks handed in (``stamps``: notebook -> version)."""
    if handin is None:
        notes = [f"where the numbers came from is unknown: {why}" if why else
                 "where the numbers came from is unknown: no handin.json handed in (make report writes it)"]
        other = _other_versions(stamps, manifest)
        flags = [NO_HANDIN + (" (unreadable: see notes)" if why else "")]
        if other:
            flags.append(f"{OTHER_VERSION} ({'; '.join(other)})")
        return Provenance({c: "" for c in COLUMNS}, flags, notes, [])
    prov = handin.provenance
    flags = []
    if prov["profile"] == "quick":
        flags.append(QUICK)
    if prov["synthetic"]:
        flags.append(SYNTHETIC)
    if prov["device_type"] != "cuda":    # "cpu", or null: no measured record ran on a GPU
        flags.append(CPU)
    # the notebooks the numbers came from (handin.json) and those handed in (their stamps) may differ
    other = list(dict.fromkeys(_other_versions(handin.notebook_versions, manifest)
                               + _other_versions(stamps, manifest)))
    if other:
        flags.append(f"{OTHER_VERSION} ({'; '.join(other)})")
    notes = [f"handin.json: table row not used: {s}" for s in handin.skipped]
    if handin.problems:
        notes.append(f"handin.json lists {len(handin.problems)} problem(s): " + "; ".join(handin.problems[:5])
                     + (" ..." if len(handin.problems) > 5 else ""))
    columns = {"profile": prov["profile"], "device": handin.device, "data": prov["data"],
               "lab version": handin.lab_version}
    return Provenance(columns, flags, notes, handin.results, prov["device"], prov["device_count"],
                      prov["profile"])
