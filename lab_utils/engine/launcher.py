"""Start a worker under ``torchrun`` from a notebook or a script: a JSON job file in, records out.

A notebook cannot spawn workers defined in its own cells (they cannot be pickled into new
processes), so every worker lives in a module of its notebook's package
(``lab_utils.experiments.nNN_name.*worker``) and is started here as
``python -m torch.distributed.run ... -m <module> <folder>/job.json``. The job (what
:class:`lab_utils.engine.harness.Job` holds) is the worker's only input; each rank's output goes to
``<log_dir>/rank<R>.log``; torchrun is one child of :mod:`lab_utils.engine.proc`, so a time limit, a failure,
an interrupt or the caller leaving the loop stops the *whole* tree. When a rank fails, a
:class:`LaunchError` says why, from the failure file it wrote (``oom`` or ``error``, its reason, which
configuration) and its last log lines.

Rank 0 appends each finished configuration's records to the records file as whole JSON lines;
:func:`stream` yields them as they come, and a failed run raises after yielding those, so the caller
can store them. Workers never write the result store.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lab_utils.engine import proc
from lab_utils.engine.hardware import cpu_cores
from lab_utils.engine.records import Record, RecordsReader, read_failures
from lab_utils.learn.errors import LabError, LaunchError, check_positive_int

TAIL_LINES = 25
POLL_S = 0.2  # how often a running launch's records file is read
JOB_FILE = "job.json"
STAGE_FILE = "stage-rank{rank}.txt"   # where each rank is (mark_stage), read when a run is stopped


def nccl_environment(log_root: Path) -> dict[str, str]:
    """What every launch sets for NCCL unless the user set it: NCCL's warnings in the rank logs
    (``NCCL_DEBUG=WARN``: a start-up that fails or hangs says why there, not nothing), and PyTorch's
    flight recorder (its ring buffer is on by default, ``TORCH_NCCL_TRACE_BUFFER_SIZE`` 2000) dumped
    when a collective times out, into the log folder (``nccl_trace_rank_<R>``)."""
    return {"NCCL_DEBUG": "WARN", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(log_root / "nccl_trace_rank_")}


@dataclass
class LaunchResult:
    """What a finished run left: rank 0's records, per-rank logs, wall seconds."""

    records: list[Record]
    log_dir: Path | None  # None: the logs were in a temporary folder, removed after the run
    wall_seconds: float
    logs: dict[int, Path] = field(default_factory=dict)

    def log(self, rank: int) -> str:
        return self.logs[rank].read_text(errors="replace") if rank in self.logs else ""


def torchrun_command(module: str, args: Sequence[str], nproc: int,
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
    else:  # one node: torchrun's store binds a port the system picks as it listens. A port chosen
        # here and passed as --master-port can be taken by another process in the seconds torchrun
        # takes to start (EADDRINUSE, exit code 1), most likely what failed a CI run of this lab.
        cmd += ["--standalone", "--local-addr=127.0.0.1"]
    return cmd + ["-m", module, *args]


def write_job(job: Mapping[str, Any], folder: Path) -> Path:
    """``job`` as ``<folder>/job.json``, with its records file and folder filled in."""
    data = {**job, "out": str(folder / "records.jsonl"), "folder": str(folder)}
    path = folder / JOB_FILE
    path.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
    return path


def launch(module: str, job: Mapping[str, Any], nproc: int = 2, timeout_s: float = 600,
           log_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
           threads_per_rank: int | None = None) -> LaunchResult:
    """Run ``job`` with ``module`` on ``nproc`` ranks and return rank 0's records (:func:`stream`,
    collected: the same arguments, the same errors)."""
    info: dict = {}
    records = list(stream(module, job, nproc, timeout_s, log_dir, env, threads_per_rank, info))
    return LaunchResult(records=records, **info)


def stream(module: str, job: Mapping[str, Any], nproc: int = 2, timeout_s: float = 600,
           log_dir: str | Path | None = None, env: Mapping[str, str] | None = None,
           threads_per_rank: int | None = None, info: dict | None = None) -> Iterator[Record]:
    """Run ``job`` with ``module`` on ``nproc`` ranks under torchrun; yield rank 0's records as they
    are written; :class:`LaunchError` (``.failure``: what the failing rank wrote, or None) when a rank
    failed or the run outlived ``timeout_s`` (start-up included).

    ``threads_per_rank``: ``OMP_NUM_THREADS`` for CPU (gloo) runs (default: ``$OMP_NUM_THREADS``, else
    the cores shared evenly). ``log_dir`` keeps the rank logs; without it they go to the launch's
    temporary folder (``$TMPDIR/lab_ddp_*``, with the job and records), removed however the run ends.
    ``info`` (a dict) receives the log folder, the rank logs and the wall seconds.
    """
    check_positive_int(nproc, "number of processes (nproc)")
    if timeout_s <= 0:
        raise LabError(f"timeout_s must be positive, got {timeout_s!r}.")
    if threads_per_rank is not None:
        check_positive_int(threads_per_rank, "threads_per_rank")
    scratch = Path(tempfile.mkdtemp(prefix="lab_ddp_"))
    try:
        yield from _run(module, job, nproc, timeout_s, Path(log_dir) if log_dir else scratch, scratch,
                        env, threads_per_rank, info)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run(module: str, job: Mapping[str, Any], nproc: int, timeout_s: float, log_root: Path, scratch: Path,
         env: Mapping[str, str] | None, threads_per_rank: int | None, info: dict | None) -> Iterator[Record]:
    """:func:`stream`'s body. ``scratch`` is removed after the run: when the logs are there, the
    errors quote them without naming files that will be gone."""
    temporary = log_root == scratch
    log_root.mkdir(parents=True, exist_ok=True)
    for old in [*log_root.glob("rank*.log"), log_root / "torchrun.log"]:
        old.unlink(missing_ok=True)  # rank logs are appended to: never quote a previous run
    job_file = write_job(job, scratch)
    cmd = torchrun_command(module, [str(job_file)], nproc, agent_dir=scratch / "torchrun")
    run_env = dict(os.environ if env is None else {**os.environ, **env})
    if threads_per_rank is not None:
        run_env["OMP_NUM_THREADS"] = str(threads_per_rank)
    elif "OMP_NUM_THREADS" not in run_env:
        run_env["OMP_NUM_THREADS"] = str(max(1, cpu_cores() // nproc))
    run_env.update(PYTHONUNBUFFERED="1", LAB_RANK_LOG_DIR=str(log_root), LAB_HEADLESS="1")
    for key, value in nccl_environment(log_root).items():
        run_env.setdefault(key, value)

    def shown(path: Path) -> str:
        """How an error names a log: not by a path that is gone when the message is read."""
        if not temporary:
            return str(path)
        return f"{path.name}, in a temporary folder now removed: pass log_dir to keep it"

    agent_log = log_root / "torchrun.log"
    reader = RecordsReader(scratch / "records.jsonl")
    with agent_log.open("wb") as agent_out:
        child = proc.start(cmd, env=run_env, stdout=agent_out, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    rc = child.popen.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    rc = None
                yield from reader.new()
                if rc is not None:
                    break
                if child.seconds() > timeout_s:
                    child.stop()
                    yield from reader.new()
                    where = where_ranks_were(scratch, nproc)
                    raise LaunchError(
                        f"The {nproc}-process run of {module} did not finish within {timeout_s:.0f} s and "
                        f"was stopped{where and f' ({where})'}; raise the time limit or shrink the run. "
                        + _quote_all(rank_logs(log_root, nproc), agent_log, shown=shown),
                        failure={"status": "error", "config_index": None,
                                 "reason": f"did not finish within {timeout_s:.0f} s"
                                           + (where and f": {where}")})
        finally:  # normal exit, failure, interrupt, or the caller leaving the loop: nothing stays
            child.stop()
    logs = rank_logs(log_root, nproc)
    if info is not None:  # a temporary folder is removed when the run ends: no paths into it
        info.update(log_dir=None if temporary else log_root, wall_seconds=child.seconds(),
                    logs={} if temporary else logs)
    if rc != 0:
        failures = read_failures(scratch)
        first = failures[0] if failures else None
        rank = first["rank"] if first else failing_rank(agent_log.read_text(errors="replace"), logs)
        why = f"{first['status']} on rank {first['rank']}: {first['reason']}; " if first else ""
        # no rank wrote its failure (torchrun itself failed, or a rank died in C code): the row's
        # reason is the log's error line, since the log goes with the temporary folder
        failure = first or {"status": "error", "config_index": None,
                            "reason": f"torchrun exit code {rc}: {error_in_log(rank, logs, agent_log)}"}
        raise LaunchError(
            f"The {nproc}-process run of {module} failed (torchrun exit code {rc}): {why}"
            f"fix the error below and re-run (records already stored are kept). "
            + _quote_failure(rank, logs, agent_log, shown=shown), failure=failure)


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


def error_in_log(rank: int | None, logs: dict[int, Path], agent_log: Path, limit: int = 300) -> str:
    """The line that says what went wrong, cut to ``limit`` characters: the last line naming an error
    in the failing rank's log; else in what torchrun's log holds before torchrun's own report (the
    workers' output, or torchrun's own crash); else that part's last line; else the report's
    ``failed (exitcode: ...)`` line (a rank killed by a signal)."""
    def lines(path: Path) -> list[str]:
        return [line.strip() for line in _tail(path, 10_000).splitlines() if line.strip()]

    agent = lines(agent_log)
    report = next((i for i, line in enumerate(agent) if "failed (exitcode:" in line
                   or "ChildFailedError" in line), len(agent))
    before = agent[:report]
    rank_lines = lines(logs[rank]) if rank is not None and rank in logs else []
    for part in (rank_lines, before):
        named = [line for line in part if re.search(r"Error\b|Exception\b|\berror:", line)]
        if named:
            return named[-1][:limit]
    summary = [re.sub(r"^.*\] ", "", line) for line in agent[report:] if "failed (exitcode:" in line]
    return ((before or summary or rank_lines or ["(no log)"])[-1])[:limit]


def _tail(path: Path, n: int = TAIL_LINES) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:]) if lines else "(empty log)"


def _quote_failure(rank: int | None, logs: dict[int, Path], agent_log: Path, shown=str) -> str:
    """The failing rank's last lines; torchrun's too when that log shows no error."""
    torchrun = f"Last lines of torchrun ({shown(agent_log)}):\n{_tail(agent_log)}"
    if rank is not None and rank in logs:
        text = f"Last lines of rank {rank} ({shown(logs[rank])}):\n{_tail(logs[rank])}"
        body = logs[rank].read_text(errors="replace")
        return text if any(w in body for w in ("Traceback", "Error", "error:")) else f"{text}\n{torchrun}"
    return torchrun


def _quote_all(logs: dict[int, Path], agent_log: Path, n: int = 8, shown=str) -> str:
    """Every rank's last ``n`` lines (where each one was when the run was stopped)."""
    if not logs:
        return _quote_failure(None, logs, agent_log, shown)
    return "\n".join(f"Last lines of rank {r} ({shown(p)}):\n{_tail(p, n)}" for r, p in sorted(logs.items()))


def where_ranks_were(folder: Path, nproc: int) -> str:
    """Where each rank of a stopped run was (:func:`mark_stage`), e.g. ``rank 0 in configuration 2 of 3;
    rank 1 joining the process group (NCCL communicator)``; empty when no rank said."""
    said = []
    for r in range(nproc):
        try:
            stage = (folder / STAGE_FILE.format(rank=r)).read_text(encoding="utf-8").strip()
        except OSError:
            continue
        said.append(f"rank {r} {stage}")
    return "; ".join(said)


# --------------------------------------------------------------------------- worker side


def mark_stage(folder: str | Path | None, rank: int, stage: str) -> None:
    """In a worker: say where this rank is now (``<folder>/stage-rank<R>.txt``, one line), so that a run
    stopped at its time limit says where each rank hung (:func:`where_ranks_were`). Best effort."""
    if folder:
        try:
            (Path(folder) / STAGE_FILE.format(rank=rank)).write_text(stage, encoding="utf-8")
        except OSError:
            pass


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
