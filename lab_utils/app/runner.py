"""Execute the lab's notebooks headless and collate the report.

``python -m lab_utils run [NOTEBOOK ...] [--profile quick|full] [--timeout SECONDS]``

Each notebook runs under nbclient, in its own folder, in a kernel started from *this* interpreter (so
it sees the same ``.venv`` whatever kernels are installed), with ``LAB_PROFILE`` and ``LAB_HEADLESS=1``.
The executed copy is saved under ``results/<profile>/executed/`` even when a cell fails; one line per
notebook says its status and seconds (a failure: its cell and error, and a non-zero exit code).
``results/<profile>/report.md`` collates the machine, the statuses and every table and figure,
ordered by question (:mod:`lab_utils.app.questions`).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import datetime as _dt
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError

from lab_utils.app.questions import SECTIONS
from lab_utils.engine import config, proc
from lab_utils.engine.store import _atomic_write_text
from lab_utils.learn.errors import LabError, WriteError, write_failure

KERNEL_NAME = "lab-utils-python"


@dataclass
class NotebookResult:
    """One notebook's outcome: status, wall seconds, and where its executed copy is."""

    notebook: str
    ok: bool
    seconds: float
    executed_path: Path | None  # None when the copy could not be saved
    cell: int | None = None  # 1-based index among code cells: the one that failed or was running
    error: str | None = None
    interrupted: str | None = None  # "SIGINT" or "SIGTERM" when a signal stopped this notebook
    save_error: str | None = None  # one sentence, when the executed copy could not be written

    @property
    def status(self) -> str:
        """``ok``, ``STOPPED`` (a signal stopped it) or ``FAILED``, in the console line and report.md."""
        return "ok" if self.ok else ("STOPPED" if self.interrupted else "FAILED")

    def line(self) -> str:
        where = f"cell {self.cell}: " if self.cell is not None else ""
        tail = "" if self.ok else f"  {where}{self.error}"
        return f"{self.status:<6} {self.notebook:<34} {self.seconds:8.1f} s{tail}"


class RunResults(list):
    """The results of one ``run``, in order; ``interrupted`` names the signal that ended it early."""

    interrupted: str | None = None
    save_error: str | None = None  # why an executed copy or the report could not be written


class SaveError(LabError):
    """An executed copy or the report could not be written (a full disk, no permission)."""


# How a signal that stopped the run is named to the user, and the exit status shells expect.
SIGNAL_WORDS = {"SIGINT": "Ctrl-C", "SIGTERM": "SIGTERM"}
SIGNAL_EXIT = {"SIGINT": 130, "SIGTERM": 143}
# After a signal or a cell timeout: how long nbclient gets to notice the dead kernel (it checks
# about once a second) before the runner stops waiting for it.
STOP_WAIT_S = 8.0


def all_notebooks() -> list[Path]:
    """The lab's notebooks in order (``labs/NN_*.ipynb``)."""
    return sorted(config.labs_dir().glob(config.NOTEBOOK_GLOB))


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
    for n, cell in enumerate((c for c in nb.cells if c.cell_type == "code"), start=1):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return n, f"{out.get('ename')}: {out.get('evalue')}"
    return None, None


class _RunningCell:
    """Which code cell the kernel is running (nbclient's ``on_cell_execute`` hook)."""

    def __init__(self, nb) -> None:
        code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
        self._number = {index: n for n, index in enumerate(code, start=1)}
        self.number: int | None = None

    def hook(self, cell, cell_index: int, **_) -> None:
        self.number = self._number.get(cell_index)


def describe_exit(returncode: int | None) -> str:
    """How a kernel process ended, in words: ``-9`` -> 'killed (signal 9): out of memory?'."""
    if returncode is None:
        return "its exit status is unknown"
    if returncode >= 0:
        return f"it exited with code {returncode}"
    number = -returncode
    try:
        name = signal.Signals(number).name
    except ValueError:
        name = f"signal {number}"
    if number == signal.SIGKILL:  # what the out-of-memory killer (and SLURM's cgroup) sends
        return f"killed (signal {number}): out of memory?"
    if number == signal.SIGSEGV:
        return f"crashed (signal {number}, {name})"
    return f"stopped by {name} (signal {number})"


def _kernel_manager(private: str):
    """An asynchronous kernel manager (what nbclient's event loop expects) on private sockets.

    The kernel talks to this process over Unix sockets in a private folder, not TCP ports:
    nothing listens on the (shared) node, and the kernel has no "unencrypted TCP" warning to
    print. A Unix socket path must fit in 108 bytes (with the "-<port>" suffix); a long $TMPDIR
    (some clusters set one per job) falls back to TCP on the loopback interface.
    """
    base = str(Path(private) / "kernel")
    if len(base) < 90:
        return AsyncKernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=base)
    return AsyncKernelManager(kernel_name=KERNEL_NAME)


def _kernel_process(km):
    """The kernel's ``subprocess.Popen`` (jupyter_client's local provisioner), or None."""
    return getattr(getattr(km, "provisioner", None), "process", None)


def _drive(client, env: dict[str, str], outcome: dict) -> None:
    """Worker thread: nbclient executes the notebook in this thread's own event loop."""

    async def execute() -> None:
        try:
            await client.async_execute(env=env)
        finally:
            if client.kc is not None:
                client.kc.stop_channels()

    try:
        # asyncio.run also cancels what nbclient leaves pending after a timeout or a dead kernel
        # (its output poller), so nothing is left running and no "Task was destroyed" warning.
        asyncio.run(execute())
    except BaseException as e:  # noqa: BLE001 - handed to the watching thread, which reports it
        outcome["error"] = e


def _watch(worker: threading.Thread, stop: proc.StopSignals | None, token: str, km) -> str | None:
    """Wait for the worker; on SIGINT/SIGTERM stop the kernel's processes and return the signal."""
    while worker.is_alive():
        worker.join(0.2)
        if stop is not None and stop.signal is not None:
            kernel = _kernel_process(km)
            proc.stop(token, root_pid=kernel.pid if kernel else None, grace_s=2.0)
            worker.join(STOP_WAIT_S)  # nbclient notices the dead kernel within about a second
            return stop.signal
    return None


def _save_notebook(nb, path: Path) -> None:
    """Write ``nb`` to ``path`` atomically (temp file, fsync, rename): a full disk leaves the old copy."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            nbformat.write(nb, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SaveError(write_failure(e, path.parent, f"the executed copy of {path.name}")) from None


def execute_notebook(path: Path, profile: str, timeout_s: float, out_dir: Path,
                     stop: proc.StopSignals | None = None) -> NotebookResult:
    """Run one notebook in a fresh kernel; save the executed copy whatever happens.

    nbclient drives the kernel from a worker thread (its per-cell timeout ``timeout_s`` and its
    is-the-kernel-alive check run there); this thread only watches, so a signal (``stop``) is acted on
    within a fraction of a second. The kernel starts with this run's mark in its environment, so every
    process it started (torchrun's ranks too, even in a session of their own or orphaned) is stopped
    when the notebook ends, however it ends (:mod:`lab_utils.engine.proc`). An executed copy that cannot be
    written (a full disk) is ``save_error``, one sentence; an older copy is left whole.
    """
    nb = nbformat.read(str(path), as_version=4)
    executed = out_dir / path.name
    token = proc.new_token()
    running = _RunningCell(nb)
    outcome: dict = {}
    t0 = time.perf_counter()
    # One private folder per notebook holds everything its kernel puts on disk: the sockets, the
    # connection file and the kernel's $TMPDIR (where a launch keeps its logs, lab_ddp_*). It goes
    # however the notebook ends: a kernel stopped by a signal cannot clean up after itself.
    with tempfile.TemporaryDirectory(prefix="lab_run_", ignore_cleanup_errors=True) as private:
        scratch = Path(private) / "tmp"
        scratch.mkdir()
        env = proc.marked_env(token, {**os.environ, "TMPDIR": str(scratch), "TMP": str(scratch),
                                      "TEMP": str(scratch)})
        km = _kernel_manager(private)
        km.connection_file = str(Path(private) / "connection.json")  # not a tempfile.mkstemp in $TMPDIR
        # The kernel runs in the notebook's own folder, as in JupyterLab (a student edition's
        # check cells read their notebook from there).
        client = NotebookClient(nb, km=km, timeout=max(1, math.ceil(timeout_s)), kernel_name=KERNEL_NAME,
                                resources={"metadata": {"path": str(path.resolve().parent)}},
                                record_timing=True, on_cell_execute=running.hook)
        worker = threading.Thread(target=_drive, args=(client, env, outcome), daemon=True,
                                  name=f"nbclient {path.name}")
        worker.start()
        interrupted = _watch(worker, stop, token, km)
        # nbclient registers an exit hook that shuts its kernel down, and leaves it registered when
        # the kernel dies while starting (its own clean-up already ran): at interpreter exit it then
        # fails with a traceback. The kernel is ours to stop (below), so the hook goes.
        atexit.unregister(client._cleanup_kernel)
        kernel = _kernel_process(km)
        kernel_exit = kernel.poll() if kernel is not None else None  # read before we stop anything
        proc.stop(token, root_pid=kernel.pid if kernel else None)
        if kernel is not None:
            try:
                kernel.wait(timeout=5)  # reap it: no zombie left behind
            except subprocess.TimeoutExpired:
                pass
        km.cleanup_connection_file()
    seconds = time.perf_counter() - t0
    error = outcome.get("error")
    cell = running.number
    if interrupted is not None:
        word = SIGNAL_WORDS.get(interrupted, interrupted)
        message = f"interrupted by {word}; the kernel and its processes were stopped"
    elif isinstance(error, CellTimeoutError):
        message = (f"timed out after {timeout_s:g} s (--timeout {timeout_s:g}); the kernel and its "
                   f"processes were stopped")
    elif error is not None and kernel_exit is not None:  # DeadKernelError, or death during start-up
        message = f"the kernel died: {describe_exit(kernel_exit)}"
    elif error is not None:
        cell, message = _failing_cell(nb)
        if message is None:
            last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
            message = f"{type(error).__name__}: {last}"
            cell = running.number
    else:
        message = None
    try:
        _save_notebook(nb, executed)
    except SaveError as e:  # the outcome still counts; the copy is what is missing
        why = "no space left on the device" if "No space" in str(e) else "could not be written"
        return NotebookResult(path.name, False, seconds, None, cell=cell if message else None,
                              error=f"{message + '; ' if message else ''}executed copy not saved: {why}",
                              interrupted=interrupted, save_error=str(e))
    if message is None:
        return NotebookResult(path.name, True, seconds, executed)
    return NotebookResult(path.name, False, seconds, executed, cell=cell, error=message,
                          interrupted=interrupted)


def run(names: Sequence[str] = (), profile: str | None = None, timeout_s: float = 3600,
        stream=None, stop: proc.StopSignals | None = None) -> RunResults:
    """Execute notebooks headless, print one line each, write the report; return results.

    SIGINT (Ctrl-C) and SIGTERM (``scancel``, a SLURM time limit) stop the running notebook within
    seconds (its kernel and every process it started; its copy saved, the report written) and
    ``RunResults.interrupted`` names the signal. A copy or report that cannot be written (a full
    disk) ends the run too, ``RunResults.save_error`` saying why in one sentence. ``stop``: handlers
    installed earlier by the caller (``python -m lab_utils run`` installs them before this module loads),
    with any signal they noted; by default the run installs its own.
    """
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
    print(f"profile {profile_name} ({why}); executed notebooks -> {out_dir}", file=stream, flush=True)
    results = RunResults()
    kernels: Path | None = None
    # The signal handlers cover the whole run, from the machine's description (importing torch
    # takes seconds) to the report: a SIGTERM before or during a notebook ends the run with its
    # line and report; one that comes while the report is written is noted and the report finished.
    with contextlib.nullcontext(stop) if stop is not None else proc.StopSignals() as stop:
        try:
            from lab_utils.engine.hardware import describe_machine

            machine = describe_machine()
            kernels = _kernelspec_dir()
            os.environ["JUPYTER_PATH"] = os.pathsep.join(
                p for p in (str(kernels), saved["JUPYTER_PATH"]) if p)
            for p in paths:
                if stop.signal is not None:
                    break
                r = execute_notebook(p, profile_name, timeout_s, out_dir, stop)
                results.append(r)
                print(r.line(), file=stream, flush=True)
                if r.save_error is not None:  # the next notebooks could not be saved either
                    results.save_error = r.save_error
                    break
            results.interrupted = stop.signal
        finally:
            if kernels is not None:
                shutil.rmtree(kernels, ignore_errors=True)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        try:
            report = write_report(profile_name, results, machine)
            print(f"report: {report}", file=stream, flush=True)
            print(f"hand-in: make report PROFILE={profile_name} (README, \"Handing in\")", file=stream,
                  flush=True)
        except (OSError, WriteError) as e:  # a WriteError is one sentence already
            results.save_error = results.save_error or (str(e) if isinstance(e, WriteError) else
                                                        write_failure(e, config.results_dir(profile_name),
                                                                      "the report (report.md)"))
    return results


def write_report(profile: str, results: Sequence[NotebookResult] = (), machine: dict | None = None) -> Path:
    """``results/<profile>/report.md``: machine, notebook statuses, then tables and figures by question.

    ``machine`` is :func:`lab_utils.engine.hardware.describe_machine`'s answer (taken now if not given).
    """
    from lab_utils.engine.hardware import describe_machine

    root = config.results_dir(profile)
    m = machine or describe_machine()
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
            lines.append(f"| {r.notebook} | {r.status} | {r.seconds:.1f} | {err} |")
    lines += report_sections(root)
    path = root / "report.md"
    root.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(path, "\n".join(lines) + "\n")  # an older report.md stays whole if this fails
    return path


def report_sections(root: Path) -> list[str]:
    """The report's body: each section of :data:`lab_utils.app.questions.SECTIONS` with its tables
    (``tables/<name>.md``) and figures (``figures/<name>.png``), then those no section names under
    "Other tables and figures", so nothing a notebook saved is left out."""
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


def main(names: Sequence[str], profile: str | None, timeout_s: float,
         stop: proc.StopSignals | None = None) -> int:
    """``python -m lab_utils run``: 0 when every notebook ran, 1 when one failed or could not be
    saved, 130 / 143 when Ctrl-C / SIGTERM stopped the run (as shells expect)."""
    results = run(names, profile, timeout_s, stop=stop)
    if results.save_error is not None and results.interrupted is None:
        print(f"error: {results.save_error}", file=sys.stderr)
        return 1
    if results.interrupted is not None:
        word = SIGNAL_WORDS.get(results.interrupted, results.interrupted)
        last = results[-1] if results and results[-1].interrupted else None
        if last is not None:
            where = f" in {last.notebook}, code cell {last.cell}" if last.cell else f" in {last.notebook}"
        else:
            where = " between notebooks" if results else " before the first notebook"
        copy = f"; executed copy: {last.executed_path}" if last else ""
        print(f"interrupted by {word}{where}: the kernel and its processes were stopped{copy}; "
              f"records already stored are kept (run again to resume).", file=sys.stderr)
        return SIGNAL_EXIT.get(results.interrupted, 1)
    failed = [r for r in results if not r.ok]
    for r in failed:
        print(f"error: {r.notebook}, code cell {r.cell}: {r.error} (executed copy: {r.executed_path})",
              file=sys.stderr)
    return 1 if failed else 0
