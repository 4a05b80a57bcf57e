"""Start a multi-process (DDP) run under ``torchrun`` from a notebook or a script.

A notebook cannot spawn DDP workers defined in its own cells (they cannot be pickled
into new processes), so every DDP worker lives in a ``lab_utils`` module and is started
here as ``python -m torch.distributed.run ... -m <module> <args>``:

- on a free local port (or a given rendezvous endpoint),
- with each rank's stdout/stderr captured into ``<log_dir>/rank<R>.log``,
- with a timeout, after which the *whole process tree* is terminated,
- and when any rank dies, the group is torn down and a :class:`LaunchError` quotes
  the failing rank's last log lines.

Every process of a launch carries ``LAB_LAUNCH_ID=<unique id>`` in its environment, so
that processes which left the tree (reparented after their parent died) are found in
``/proc`` and stopped too.

Worker protocol (the one way back from a worker): the launcher appends ``--out <file>`` to
the worker's arguments; rank 0 appends its records there as whole JSON lines, one call per
finished configuration (:func:`lab_utils.core.records.append_records`). :func:`stream` yields
each record as soon as its line is whole, while the run goes on, and :func:`launch` returns
them all (:class:`LaunchResult`). A failed run raises :class:`LaunchError` after yielding
the records that were finished, so the caller can store them. Workers never write the
result store: the parent does, through :meth:`lab_utils.store.ResultStore.run`. No zombie
or orphaned processes are left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.core.config import check_positive_int
from lab_utils.core.dist import free_port  # noqa: F401  (also launcher.free_port for callers)
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import cpu_cores
from lab_utils.core.records import Record, RecordsReader

TAIL_LINES = 25
LAUNCH_ID_ENV = "LAB_LAUNCH_ID"


@dataclass
class LaunchResult:
    """What a finished run left: rank 0's records, per-rank logs, wall seconds."""

    records: list[Record]
    log_dir: Path | None  # None: the logs were in a temporary folder, removed after the run
    wall_seconds: float
    logs: dict[int, Path] = field(default_factory=dict)
    launch_id: str = ""

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace") if rank in self.logs else ""


def torchrun_command(module: str, args: Sequence[str], nproc: int, port: int,
                     nnodes: int = 1, node_rank: int = 0, rdzv: str | None = None,
                     agent_dir: str | Path | None = None) -> list[str]:
    """The ``torchrun`` command line (as ``python -m torch.distributed.run``).

    ``agent_dir``: torchrun's own ``--log-dir``; without it, torchrun leaves a ``torchelastic_*``
    folder in ``$TMPDIR`` after every run, even a successful one.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]
    if agent_dir is not None:
        cmd.append(f"--log-dir={agent_dir}")
    if rdzv is not None:  # multi-node: c10d rendezvous at host:port
        cmd += [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}",
                "--rdzv-id=lab", f"--node-rank={node_rank}"]
    else:
        cmd += ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={port}"]
    return cmd + ["-m", module, *args]


def launch(module: str, args: Sequence[str] = (), nproc: int = 2, timeout_s: float = 600,
           log_dir: str | Path | None = None, env: dict[str, str] | None = None,
           threads_per_rank: int | None = None) -> LaunchResult:
    """Run ``module`` on ``nproc`` ranks under torchrun and return rank 0's records.

    :func:`stream`, collected: the same arguments, the same errors.
    """
    info: dict = {}
    records = list(stream(module, args, nproc, timeout_s, log_dir, env, threads_per_rank, info))
    return LaunchResult(records=records, **info)


POLL_S = 0.2  # how often a running launch's records file is read


def stream(module: str, args: Sequence[str] = (), nproc: int = 2, timeout_s: float = 600,
           log_dir: str | Path | None = None, env: dict[str, str] | None = None,
           threads_per_rank: int | None = None, info: dict | None = None) -> Iterator[Record]:
    """Run ``module`` on ``nproc`` ranks under torchrun; yield rank 0's records as they are written.

    ``timeout_s`` bounds the whole run (start-up included). ``threads_per_rank`` sets
    ``OMP_NUM_THREADS`` for CPU (gloo) runs; by default ``$OMP_NUM_THREADS`` when set,
    else the cores are shared evenly. Logs of an earlier run in the same ``log_dir`` are
    removed first. After the run, raises :class:`LaunchError` when a rank failed or the run
    timed out (the records yielded before are whole: store them). ``info`` (a dict) receives
    the log folder, the rank logs, the wall seconds and the launch id. Leaving the loop early
    (or an interrupt) stops the whole process tree. Without ``log_dir`` the logs go to a
    temporary folder (``$TMPDIR/lab_ddp_*``, which also holds torchrun's own folder), removed however
    the run ends (success, failure, timeout, an interrupt, the caller leaving the loop): a failure's
    error quotes the logs' last lines, and ``info`` then holds no log paths. A process killed outright
    (SIGKILL, or a SIGTERM it does not handle) runs no clean-up: the runner gives each kernel a
    ``$TMPDIR`` of its own for that.
    """
    check_positive_int(nproc, "number of processes (nproc)")
    if timeout_s <= 0:
        raise LabError(f"timeout_s must be positive, got {timeout_s!r}.")
    if threads_per_rank is not None:
        check_positive_int(threads_per_rank, "threads_per_rank")
    # A folder of our own for torchrun's agent (and for the logs when no log_dir is given): it
    # goes however the run ends (success, failure, timeout, an interrupt, the caller leaving early).
    scratch = Path(tempfile.mkdtemp(prefix="lab_ddp_"))
    try:
        yield from _run(module, args, nproc, timeout_s, Path(log_dir) if log_dir else scratch, scratch,
                        env, threads_per_rank, info)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(module: str, args: Sequence[str], nproc: int, timeout_s: float, log_root: Path, scratch: Path,
         env: dict[str, str] | None, threads_per_rank: int | None, info: dict | None) -> Iterator[Record]:
    """:func:`stream`'s body. ``scratch`` is removed after the run: when the logs are there, the
    errors quote them without naming files that will be gone."""
    temporary = log_root == scratch
    log_root.mkdir(parents=True, exist_ok=True)
    out_file = log_root / "records.jsonl"
    out_file.unlink(missing_ok=True)
    for old in [*log_root.glob("rank*.log"), log_root / "torchrun.log"]:
        old.unlink(missing_ok=True)  # rank logs are appended to: never quote a previous run
    port = free_port()
    cmd = torchrun_command(module, [*args, "--out", str(out_file)], nproc, port,
                           agent_dir=scratch / "torchrun")
    run_env = dict(os.environ)
    run_env.update(env or {})
    if threads_per_rank is not None:
        run_env["OMP_NUM_THREADS"] = str(threads_per_rank)
    elif "OMP_NUM_THREADS" not in run_env:
        run_env["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // nproc))
    run_env["PYTHONUNBUFFERED"] = "1"
    run_env["LAB_RANK_LOG_DIR"] = str(log_root)
    run_env["LAB_HEADLESS"] = "1"
    launch_id = uuid.uuid4().hex
    run_env[LAUNCH_ID_ENV] = launch_id

    def shown(path: Path) -> str:
        """How an error names a log: not by a path that is gone when the message is read."""
        if not temporary:
            return str(path)
        return f"{path.name}, in a temporary folder now removed: pass log_dir to keep it"

    agent_log = log_root / "torchrun.log"
    reader = RecordsReader(out_file)
    start = time.perf_counter()
    with agent_log.open("wb") as agent_out:
        # A new session makes the agent and its workers one group we can signal.
        proc = subprocess.Popen(cmd, stdout=agent_out, stderr=subprocess.STDOUT, env=run_env,
                                start_new_session=True)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    rc = None
                yield from reader.new()
                if rc is not None:
                    break
                if time.perf_counter() - start > timeout_s:
                    kill_tree(proc, launch_id=launch_id)
                    logs = rank_logs(log_root, nproc)
                    raise LaunchError(
                        f"The {nproc}-process run of {module} did not finish within {timeout_s:.0f} s and "
                        f"was stopped; raise timeout_s or shrink the run. "
                        + _quote_all(logs, agent_log, shown=shown))
        finally:  # normal exit, failure, interrupt, or the caller leaving the loop: nothing stays
            kill_tree(proc, launch_id=launch_id)
    wall = time.perf_counter() - start
    logs = rank_logs(log_root, nproc)
    if info is not None:  # a temporary folder is removed when the run ends: no paths into it
        info.update(log_dir=None if temporary else log_root, wall_seconds=wall,
                    logs={} if temporary else logs, launch_id=launch_id)
    if rc != 0:
        rank = failing_rank(agent_log.read_text(errors="replace"), logs)
        raise LaunchError(
            f"The {nproc}-process run of {module} failed (torchrun exit code {rc}); "
            f"fix the error below and re-run (records already stored are kept). "
            + _quote_failure(rank, logs, agent_log, shown=shown))
    if not out_file.exists():
        raise LaunchError(f"The run of {module} finished but rank 0 wrote no records ({shown(out_file)}); "
                          "check that the worker calls lab_utils.core.records.append_records. "
                          + _quote_failure(0, logs, agent_log, shown=shown))


def rank_logs(log_root: Path, nproc: int) -> dict[int, Path]:
    """The per-rank log files the workers wrote (see :func:`setup_rank_logging`)."""
    return {r: log_root / f"rank{r}.log" for r in range(nproc) if (log_root / f"rank{r}.log").exists()}


def failing_rank(agent_text: str, logs: dict[int, Path]) -> int | None:
    """Which rank failed first: of the ranks torchrun's summary lists as failed, the one whose log
    stopped first (torchrun's 'Root Cause' breaks a tie within its one-second clock by the lowest
    rank, which may be a peer that only failed because the first one had left); else from the logs."""
    failed = [int(r) for r in re.findall(r"\brank\s*:\s*(\d+)", agent_text.partition("Failures:")[2])]
    if len(set(failed)) > 1 and all(r in logs for r in failed):
        return min(set(failed), key=lambda r: (logs[r].stat().st_mtime, r))
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", agent_text, re.S)
    if m:
        return int(m.group(1))
    for r, p in sorted(logs.items()):
        try:
            if "Traceback" in p.read_text(errors="replace"):
                return r
        except OSError:
            continue
    return None


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) if lines else "(empty log)"


def _quote_failure(rank: int | None, logs: dict[int, Path], agent_log: Path, shown=str) -> str:
    """The failing rank's last lines; torchrun's too when that log shows no error."""
    if rank is not None and rank in logs:
        text = f"Last lines of rank {rank} ({shown(logs[rank])}):\n{_tail(logs[rank])}"
        body = logs[rank].read_text(errors="replace")
        if not any(w in body for w in ("Traceback", "Error", "error:")):
            text += f"\nLast lines of torchrun ({shown(agent_log)}):\n{_tail(agent_log)}"
        return text
    return f"Last lines of torchrun ({shown(agent_log)}):\n{_tail(agent_log)}"


def _quote_all(logs: dict[int, Path], agent_log: Path, n: int = 8, shown=str) -> str:
    """Every rank's last ``n`` lines (where each one was when the run was stopped)."""
    if not logs:
        return f"Last lines of torchrun ({shown(agent_log)}):\n{_tail(agent_log)}"
    return "\n".join(f"Last lines of rank {r} ({shown(p)}):\n{_tail(p, n)}" for r, p in sorted(logs.items()))


def _proc_pids() -> list[int]:
    """Every process id listed in /proc (Linux); empty elsewhere."""
    try:
        return [int(e) for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []


def _children(pid: int) -> list[int]:
    """Direct children of ``pid`` from /proc (Linux); empty elsewhere."""
    kids = []
    for p in _proc_pids():
        try:
            with open(f"/proc/{p}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            kids.append(p)
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (workers may start sessions of their own)."""
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo.extend(_children(p))
    return tree


def tagged_processes(launch_id: str) -> list[int]:
    """Live processes of this user whose environment holds ``LAB_LAUNCH_ID=<launch_id>``."""
    if not launch_id:
        return []
    needle = f"{LAUNCH_ID_ENV}={launch_id}".encode()
    found = []
    for p in _proc_pids():
        if p == os.getpid():
            continue
        try:
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
        except OSError:  # another user's process, or gone
            continue
        if needle in env.split(b"\0") and _alive(p):
            found.append(p)
    return found


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0, launch_id: str = "") -> None:
    """SIGTERM the process, its group, every descendant and every process tagged with
    ``launch_id`` (orphans included); SIGKILL what remains; reap."""
    tagged = tagged_processes(launch_id)
    if proc.poll() is not None and not _children(proc.pid) and not tagged:
        return
    pids = sorted(set(process_tree(proc.pid)) | set(tagged))
    if proc.poll() is not None:  # reaped: its pid may belong to someone else by now
        pids = [p for p in pids if p != proc.pid]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            try:
                proc.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
        if not any(_alive(p) for p in pids):
            break
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie whose parent will reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


# --------------------------------------------------------------------------- worker side


def setup_rank_logging() -> Path | None:
    """In a worker: send this rank's stdout and stderr to ``$LAB_RANK_LOG_DIR/rank<R>.log``.

    Redirects the file descriptors themselves, so a crash in C code is captured too.
    Returns the log path, or None when not started by :func:`launch`.
    """
    log_dir = os.environ.get("LAB_RANK_LOG_DIR")
    rank = os.environ.get("RANK")
    if not log_dir or rank is None:
        return None
    path = Path(log_dir) / f"rank{rank}.log"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path
