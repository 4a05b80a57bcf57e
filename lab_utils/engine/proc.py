"""THE child-process helper: start a command, bound it by a time limit, stop it with all it started.

Every process the lab starts (a notebook's kernel in the headless runner, ``torchrun`` and its
ranks in the launcher, a doctor check, a graded submission in its sandbox) is started by
:func:`start`, in a session of its own, with a **mark** in its environment that its children
inherit: ``LAB_PROCESS_MARKS=<token>:<token>...`` (each level adds its own token, so a launch
inside a notebook's kernel carries both the kernel's mark and its own). When the process ends,
however it ends (success, failure, time limit, a signal to the parent), :meth:`Child.stop` sends
SIGTERM to every process carrying its mark and to its descendants, waits a grace period, then
SIGKILLs what is left and reaps the child. Marks find what a process tree no longer does: a rank
whose parent died is re-parented to init, and walking the tree from the dead parent misses it.

Linux in practice (another process's environment is read through ``/proc``); where it cannot be
read, the descendants of the child are still found through their parent links.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import psutil

MARKS_ENV = "LAB_PROCESS_MARKS"
GRACE_S = 3.0  # SIGTERM -> SIGKILL


class TimeLimit(Exception):
    """A child did not finish within its time limit; it and everything it started were stopped."""


def new_token() -> str:
    """A fresh mark for one child (and everything it starts)."""
    return secrets.token_hex(8)


def marked_env(token: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with ``token`` added to :data:`MARKS_ENV`."""
    out = dict(os.environ if env is None else env)
    marks = [m for m in out.get(MARKS_ENV, "").split(":") if m]
    out[MARKS_ENV] = ":".join([*marks, token])
    return out


def marked(token: str, root_pid: int | None = None) -> list[psutil.Process]:
    """Live processes whose mark list holds ``token``, plus ``root_pid`` and its descendants.

    The calling process is never included, even when it carries the mark itself.
    """
    found: dict[int, psutil.Process] = {}
    me = os.getpid()
    if root_pid is not None:
        try:
            root = psutil.Process(root_pid)
            for p in [root, *root.children(recursive=True)]:
                found[p.pid] = p
        except psutil.Error:
            pass
    for p in psutil.process_iter():
        if p.pid == me or p.pid in found:
            continue
        try:
            if token in p.environ().get(MARKS_ENV, "").split(":"):
                found[p.pid] = p
        except psutil.Error:  # gone, a zombie, or another user's process
            continue
    found.pop(me, None)
    return list(found.values())


def stop(token: str, root_pid: int | None = None, grace_s: float = GRACE_S) -> int:
    """SIGTERM every process marked ``token`` (and ``root_pid``'s tree); SIGKILL survivors after
    ``grace_s`` seconds. Returns how many were signalled; bounded by about ``grace_s + 2`` s."""
    procs = marked(token, root_pid)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # anything started during the grace period (a dying agent may still spawn): sweep once more
    known = {a.pid for a in alive}
    alive += [p for p in marked(token) if p.pid not in known]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return len(procs) + len(alive)


def leftover(token: str, wait_s: float = 0.0) -> list[int]:
    """PIDs still running with ``token`` after waiting up to ``wait_s`` seconds (for tests)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p.pid for p in marked(token) if _running(p)]
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.1)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class Child:
    """A started command: its ``Popen``, its mark, and when it started (``time.monotonic``)."""

    popen: subprocess.Popen
    token: str
    started: float = field(default_factory=time.monotonic)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def seconds(self) -> float:
        return time.monotonic() - self.started

    def stop(self, grace_s: float = GRACE_S) -> None:
        """Stop the child and everything marked with its token (idempotent), and reap it."""
        root = self.popen.pid if self.popen.poll() is None else None  # a reaped pid may be reused
        stop(self.token, root_pid=root, grace_s=grace_s)
        try:
            self.popen.wait(timeout=grace_s + 2)
        except subprocess.TimeoutExpired:
            pass


def start(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, token: str | None = None,
          **popen_kwargs) -> Child:
    """Start ``cmd`` in a new session, marked (:func:`marked_env`); ``popen_kwargs`` go to ``Popen``."""
    token = token or new_token()
    popen = subprocess.Popen(list(cmd), env=marked_env(token, env), start_new_session=True, **popen_kwargs)
    return Child(popen, token)


def run(cmd: Sequence[str], timeout_s: float, *, input: str | bytes | None = None,
        env: Mapping[str, str] | None = None, what: str = "", grace_s: float = GRACE_S,
        **popen_kwargs) -> subprocess.CompletedProcess:
    """Run ``cmd`` to its end with output captured; at ``timeout_s`` seconds stop it and all it
    started and raise :class:`TimeLimit`. Nothing it started is left running in either case.

    ``what`` names the child in the error ("the nccl_allreduce check"). ``popen_kwargs``: e.g.
    ``cwd``, ``text=True``, ``stdout``/``stderr`` (default: both captured).
    """
    popen_kwargs.setdefault("stdout", subprocess.PIPE)
    popen_kwargs.setdefault("stderr", subprocess.PIPE)
    if input is not None:
        popen_kwargs["stdin"] = subprocess.PIPE
    child = start(cmd, env=env, **popen_kwargs)
    try:
        out, err = child.popen.communicate(input, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.stop(grace_s)
        for stream in (child.popen.stdout, child.popen.stderr, child.popen.stdin):
            if stream is not None:
                stream.close()
        raise TimeLimit(f"{what or cmd[0]} did not finish within {timeout_s:g} s and was stopped, "
                        "with everything it started") from None
    finally:
        child.stop(grace_s)  # grandchildren that outlived it (a finished child: nothing to wait for)
    return subprocess.CompletedProcess(child.popen.args, child.popen.returncode, out, err)


class StopSignals:
    """SIGINT/SIGTERM handlers that only note the signal, for as long as the ``with`` block lasts.

    The headless runner acts on it (``runner._watch``): it stops the kernel and everything it started,
    saves the executed copy and ends with the shell's status (130, 143). ``python -m lab_utils run``
    installs them first, before the runner loads (seconds on a busy node): SLURM's time-limit warning
    can come at any moment, and a Python process without a handler dies at once, saying nothing.
    Installed only in the main thread (Python delivers signals there); elsewhere the caller's stay.
    """

    def __init__(self) -> None:
        self.signal: str | None = None  # "SIGINT" or "SIGTERM": the first that came
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._saved[sig] = signal.signal(sig, self._note)
        return self

    def _note(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
