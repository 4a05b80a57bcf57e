"""Find and stop every process a run started, even those that outlived their parent.

The headless runner starts a Jupyter kernel, and a notebook cell may start more processes
(``torchrun`` and its ranks, in a session of their own, or a data loader's workers). When the
kernel dies (the out-of-memory killer sends SIGKILL) its children are re-parented to init, so
walking the kernel's process tree no longer finds them. Instead, every process of one run
carries a marker in its environment, which children inherit: ``LAB_RUN_TOKEN=<random hex>``.
:func:`stop` sends SIGTERM to every process with that marker (and to the known root's
descendants), waits a grace period, then SIGKILLs what is left.

Linux only in practice (reading another process's environment); where that cannot be read,
the descendants of ``root_pid`` are still found through their parent links.
"""

from __future__ import annotations

import os
import secrets
import time

import psutil

TOKEN_ENV = "LAB_RUN_TOKEN"


def new_token() -> str:
    """A fresh marker value for one run (one notebook's kernel and everything it starts)."""
    return secrets.token_hex(8)


def marked(token: str, root_pid: int | None = None, var: str = TOKEN_ENV) -> list[psutil.Process]:
    """Live processes carrying ``var=token`` (``LAB_RUN_TOKEN``), plus ``root_pid`` and its descendants.

    The calling process is never included, even when it carries the marker itself.
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
            if p.environ().get(var) == token:
                found[p.pid] = p
        except psutil.Error:  # gone, a zombie, or another user's process
            continue
    found.pop(me, None)
    return list(found.values())


def stop(token: str, root_pid: int | None = None, grace_s: float = 3.0) -> int:
    """SIGTERM every marked process, SIGKILL survivors after ``grace_s`` seconds.

    Returns how many processes were signalled. Bounded in time: at most about
    ``grace_s + 2`` seconds (the SIGKILL is not ignorable; a process stuck in the kernel
    may still take a moment to go, and is not waited for beyond that).
    """
    procs = marked(token, root_pid)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # Children started during the grace period (a dying torchrun may spawn nothing, but a
    # cell's loop might): sweep once more.
    alive += [p for p in marked(token) if p.pid not in {a.pid for a in alive}]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2.0)
    return len(procs) + len(alive)


def leftover(token: str, wait_s: float = 0.0, var: str = TOKEN_ENV) -> list[int]:
    """PIDs still running with ``var=token`` after waiting up to ``wait_s`` seconds (for tests)."""
    deadline = time.monotonic() + wait_s
    while True:
        pids = [p.pid for p in marked(token, var=var) if _running(p)]
        if not pids or time.monotonic() >= deadline:
            return pids
        time.sleep(0.1)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
