"""Execute the lab's notebooks headless and collate the report.

``python -m lab_utils run [NOTEBOOK ...] [--profile quick|full] [--timeout SECONDS]``

- Each notebook runs under nbclient in a kernel started from *this* interpreter
  (``sys.executable -m ipykernel_launcher``), so the kernel sees the same ``.venv`` and
  ``lab_utils`` as the command, whatever kernels the user has installed.
- The working directory is ``labs/``; ``LAB_PROFILE`` and ``LAB_HEADLESS=1`` are
  exported to the kernel.
- The executed copy is saved under ``results/<profile>/executed/`` even when a cell
  fails, and one line per notebook says its status and seconds.
- ``results/<profile>/report.md`` collates the machine description, the notebooks'
  statuses and every table and figure in ``results/<profile>/``, ordered by question
  (:mod:`lab_utils.questions`), figures embedded as images.
- On failure: notebook, cell number and error are printed; the exit code is non-zero.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lab_utils.core import config
from lab_utils.core.errors import LabError

KERNEL_NAME = "lab-utils-python"


@dataclass
class NotebookResult:
    notebook: str
    ok: bool
    seconds: float
    executed_path: Path
    cell: int | None = None  # 1-based index among code cells, when a cell failed
    error: str | None = None

    def line(self) -> str:
        status = "ok    " if self.ok else "FAILED"
        tail = "" if self.ok else f"  cell {self.cell}: {self.error}"
        return f"{status} {self.notebook:<34} {self.seconds:8.1f} s{tail}"


def all_notebooks() -> list[Path]:
    """The lab's notebooks in order (``labs/NN_*.ipynb``)."""
    return sorted(config.labs_dir().glob("[0-9][0-9]_*.ipynb"))


def resolve_notebooks(names: Sequence[str]) -> list[Path]:
    """Paths for the given names (a path, a file in labs/, or a prefix like ``01``)."""
    if not names:
        return all_notebooks()
    out = []
    for name in names:
        p = Path(name)
        candidates = [p, config.labs_dir() / p.name]
        candidates += sorted(config.labs_dir().glob(f"{name}*.ipynb")) if not p.suffix else []
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            known = ", ".join(n.name for n in all_notebooks()) or "none"
            raise LabError(f"Notebook {name!r} does not exist; give a path or one of: {known}.")
        out.append(found.resolve())
    return out


def _kernelspec_dir() -> Path:
    """A temporary Jupyter data dir whose kernel runs ``sys.executable``."""
    root = Path(tempfile.mkdtemp(prefix="lab_kernels_"))
    spec = root / "kernels" / KERNEL_NAME
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "lab_utils (this interpreter)",
        "language": "python",
    }))
    return root


def _failing_cell(nb) -> tuple[int | None, str | None]:
    """1-based code-cell number and 'Ename: evalue' of the first error output."""
    n = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        n += 1
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return n, f"{out.get('ename')}: {out.get('evalue')}"
    return None, None


def execute_notebook(path: Path, profile: str, timeout_s: float, out_dir: Path) -> NotebookResult:
    """Run one notebook; save the executed copy whatever happens."""
    import nbformat
    from jupyter_client.manager import KernelManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(str(path), as_version=4)
    out_dir.mkdir(parents=True, exist_ok=True)
    executed = out_dir / path.name
    t0 = time.perf_counter()
    error = None
    # The kernel talks to this process over Unix sockets in a private folder, not TCP ports:
    # nothing listens on the (shared) node, and the kernel has no "unencrypted TCP" warning to print.
    # The kernel runs in the notebook's own folder, as in JupyterLab (a student edition's
    # check cells read their notebook from there).
    with tempfile.TemporaryDirectory(prefix="lab-kernel-") as sockets:
        base = str(Path(sockets) / "kernel")
        # A Unix socket path must fit in 108 bytes (with the "-<port>" suffix); a long $TMPDIR
        # (some clusters set one per job) falls back to TCP on the loopback interface.
        km = (KernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=base) if len(base) < 90
              else KernelManager(kernel_name=KERNEL_NAME))
        client = NotebookClient(nb, km=km, timeout=int(timeout_s), kernel_name=KERNEL_NAME,
                                resources={"metadata": {"path": str(path.resolve().parent)}},
                                record_timing=True)
        try:
            client.execute()
        except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
            error = e
        except Exception as e:  # kernel failed to start, etc.: still save and report
            error = e
        finally:  # nbclient leaves a kernel it did not create running
            if km.has_kernel:
                km.shutdown_kernel(now=True)
    seconds = time.perf_counter() - t0
    nbformat.write(nb, str(executed))
    if error is None:
        return NotebookResult(path.name, True, seconds, executed)
    cell, message = _failing_cell(nb)
    if message is None:
        last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        message = f"{type(error).__name__}: {last}"
    return NotebookResult(path.name, False, seconds, executed, cell=cell, error=message)


def run(names: Sequence[str] = (), profile: str | None = None, timeout_s: float = 3600,
        stream=None) -> list[NotebookResult]:
    """Execute notebooks headless, print one line each, write the report; return results."""
    stream = stream or sys.stdout
    profile_name, why = config.resolve_profile_name(profile)
    paths = resolve_notebooks(names)  # bad names fail here, before any kernel starts
    if timeout_s <= 0:
        raise LabError(f"--timeout must be a positive number of seconds, got {timeout_s}.")
    out_dir = config.results_dir(profile_name) / "executed"
    saved = {k: os.environ.get(k) for k in ("LAB_PROFILE", "LAB_HEADLESS", "JUPYTER_PATH",
                                            "MPLBACKEND")}
    os.environ["LAB_PROFILE"] = profile_name
    os.environ["LAB_HEADLESS"] = "1"
    # Figures go into the executed notebook (the inline backend), whatever the caller uses.
    os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(_kernelspec_dir()), saved["JUPYTER_PATH"]) if p)
    print(f"profile {profile_name} ({why}); executed notebooks -> {out_dir}", file=stream, flush=True)
    results = []
    try:
        for p in paths:
            r = execute_notebook(p, profile_name, timeout_s, out_dir)
            results.append(r)
            print(r.line(), file=stream, flush=True)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    report = write_report(profile_name, results)
    print(f"report: {report}", file=stream, flush=True)
    return results


def write_report(profile: str, results: Sequence[NotebookResult] = ()) -> Path:
    """``results/<profile>/report.md``: machine, notebook statuses, then tables and figures by question."""
    from lab_utils.core.hardware import describe_machine

    root = config.results_dir(profile)
    root.mkdir(parents=True, exist_ok=True)
    m = describe_machine()
    gpus = ", ".join(f"{g['name']} ({g['memory_bytes'] / 2**30:.0f} GiB)" for g in m["gpus"]) or "none"
    sw = m["software"]
    lines = [
        f"# Lab report: profile `{profile}`", "",
        f"Generated {_dt.datetime.now().isoformat(timespec='seconds')}.", "",
        f"- GPUs: {gpus}",
        f"- CPU: {m['cpu']} ({m['cpu_cores']} cores)",
        f"- torch {sw['torch']}, torchvision {sw['torchvision']}, CUDA {sw['cuda']}, Python {sw['python']}",
    ]
    if profile == "quick":
        lines.append("- **quick profile**: reduced data and models for CPU/CI; not the assignment's numbers.")
    if results:
        lines += ["", "## Notebooks", "", "| notebook | status | seconds | error |", "|---|---|---|---|"]
        for r in results:
            err = (f"cell {r.cell}: {r.error}" if not r.ok else "").replace("|", "\\|")
            lines.append(f"| {r.notebook} | {'ok' if r.ok else 'FAILED'} | {r.seconds:.1f} | {err} |")
    lines += report_sections(root)
    path = root / "report.md"
    tmp = path.with_suffix(".md.tmp")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)
    return path


def report_sections(root: Path) -> list[str]:
    """The report's body: tables and figures by question (:data:`lab_utils.questions.SECTIONS`).

    Q1 ... Q7, then the Part 2 project, then the extras; each section holds its tables
    (``tables/<name>.md``) and embeds its figures (``figures/<name>.png``, linked relative to
    ``report.md``). Tables and figures no section names follow under "Other tables and
    figures", so nothing a notebook saved is left out.
    """
    from lab_utils.questions import SECTIONS

    tables = {p.stem: p for p in sorted((root / "tables").glob("*.md"))}
    figures = {p.stem: p for p in sorted((root / "figures").glob("*.png"))}
    if not tables and not figures:
        return ["", "No tables yet: run the notebooks."]
    lines: list[str] = []
    used_t: set[str] = set()
    used_f: set[str] = set()
    for s in SECTIONS:
        mine_t = [t for t in s.tables if t in tables and t not in used_t]
        mine_f = [f for f in s.figures if f in figures and f not in used_f]
        if not mine_t and not mine_f:
            continue
        lines += ["", f"## {s.heading}", "", f"_{s.asks}_ (section: {s.cell})", ""]
        for t in mine_t:
            lines += [tables[t].read_text().rstrip(), ""]
            used_t.add(t)
        for f in mine_f:
            lines += [f"![{f}](figures/{f}.png)", ""]
            used_f.add(f)
    rest_t = [t for t in tables if t not in used_t]
    rest_f = [f for f in figures if f not in used_f]
    if rest_t or rest_f:
        lines += ["", "## Other tables and figures", ""]
        lines += [x for t in rest_t for x in (tables[t].read_text().rstrip(), "")]
        lines += [x for f in rest_f for x in (f"![{f}](figures/{f}.png)", "")]
    return lines


def main(names: Sequence[str], profile: str | None, timeout_s: float) -> int:
    results = run(names, profile, timeout_s)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"error: {r.notebook}, code cell {r.cell}: {r.error} (executed copy: {r.executed_path})",
              file=sys.stderr)
    return 1 if failed else 0
