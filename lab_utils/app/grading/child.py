"""The process that runs one submission's exercise functions, inside the sandbox.

``python -I -B -m lab_utils.app.grading.child`` reads a job (JSON) on stdin::

    {"drop_to": uid or null, "case_seconds": s,
     "questions": [{"name", "function", "code", "first_line", "cases": [[test, case, input], ...]}]}

and writes one JSON line per result on its standard output, which it keeps for itself (the
submission's own prints go to ``output.txt`` in its private folder)::

    {"q": name, "t": test, "c": case, "answer": ..., "seconds": s}
    {"q": name, "t": test, "c": case, "error": {"type", "message", "errno", "line"}}
    {"q": name, "error": {...}, "defining": true}      the code failed before any case ran
    {"q": name, "ended": {"how": "exit"|"signal"|"timeout", "code": n}}
                                                         its process ended before all its cases ran
    {"q": name, "tried": "open /root/.ssh/id_rsa (read)"}  what the question's code asked for
    {"q": name, "start": true}                          the question's process is about to start
    {"done": true, "cpu_seconds": s}                    CPU time of this process and its question processes

It holds no expected answer: the grader compares in its own process.

**One process per question**, forked from this one (the *server*, which imported what the cases
need): a question's code runs where no other question's has, so it cannot rewire another's check
(``torch.sys.modules[...].EXERCISES.update(...)`` changes only its own process), and it writes to a
pipe of its own, from which the server passes on only the lines about that question. The server
cannot be traced by them (not dumpable), adopts what they leave running (a subreaper) and ends it
before the next question. A case that ignores its alarm is killed by the server. An audit hook
names the files, sockets and processes the code asks for (the sandbox refuses them).
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import json
import os
import resource
import select
import signal
import sys
import time
import traceback

import psutil

FILE_PREFIX = "<exercise "
_proto = None
_pid = os.getpid()
_tried: set[str] = set()
MAX_TRIED = 20
WATCHED = {"open", "socket.connect", "socket.bind", "socket.getaddrinfo", "os.fork", "os.forkpty",
           "os.system", "os.exec", "os.posix_spawn", "os.spawn", "subprocess.Popen", "os.remove",
           "os.rename", "os.rmdir", "shutil.rmtree", "os.kill", "os.killpg", "os.listdir", "os.scandir",
           "glob.glob", "ctypes.dlopen", "os.chmod", "os.chown", "os.symlink", "os.link"}


class CaseTimeLimit(BaseException):
    """A case ran past its time limit (a BaseException: ``except Exception`` does not catch it)."""


def emit(record: dict) -> None:
    if os.getpid() != _pid:  # a process the submission forked came back into the grader: end it
        os._exit(0)
    _proto.write(json.dumps(record, default=repr) + "\n")
    _proto.flush()


def _in_exercise_code() -> bool:
    f = sys._getframe(2)
    for _ in range(80):
        if f is None:
            return False
        if f.f_code.co_filename.startswith(FILE_PREFIX):
            return True
        f = f.f_back
    return False


def _describe(event: str, args: tuple) -> str:
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if isinstance(path, int):
            return ""
        writes = (isinstance(mode, str) and any(m in mode for m in "wax+")) or \
            (isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        return f"open {os.path.abspath(os.fsdecode(path))} ({'write' if writes else 'read'})"
    if event in ("socket.connect", "socket.bind"):
        return f"{event.split('.')[1]} to {args[1]!r}"
    if event == "socket.getaddrinfo":
        return f"look up host {args[0]!r}"
    if event in ("os.fork", "os.forkpty"):
        return "start a process (fork)"
    if event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn"):
        return f"run a program ({str(args[1] if event != 'os.system' else args[0])[:60]})"
    if event in ("os.listdir", "os.scandir", "glob.glob"):
        return f"list {args[0]!r}"
    if event in ("os.kill", "os.killpg"):
        return f"send signal {args[1]} to process {'group ' if event == 'os.killpg' else ''}{args[0]}"
    return f"{event} {str(args[:1])[:80]}"


_LAB_PKG = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # lab_utils/
_LIBRARY = tuple(p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/proc/self", "/dev/null",
                             _LAB_PKG} if p)


def _library_read(event: str, args: tuple) -> bool:
    """Reading the interpreter's and the lab's own files (imports): not worth naming."""
    if event not in ("open", "os.listdir", "os.scandir") or not args or not isinstance(args[0], (str, bytes)):
        return False
    if event == "open" and not _describe(event, args).endswith("(read)"):
        return False
    path = os.path.abspath(os.fsdecode(args[0]))
    return path.startswith(_LIBRARY)


def _audit(event: str, args: tuple) -> None:
    if event not in WATCHED or len(_tried) > MAX_TRIED:
        return
    try:
        if _library_read(event, args) or not _in_exercise_code():
            return
        what = _describe(event, args)
        if what and what not in _tried:
            _tried.add(what)
            emit({"tried": what if len(_tried) <= MAX_TRIED else f"more (the first {MAX_TRIED} are listed)"})
    except Exception:  # noting must never break the submission's run
        pass


def _error(e: BaseException, first_line: int) -> dict:
    line = None
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename.startswith(FILE_PREFIX):
            line = frame.lineno - first_line + 1 if frame.lineno else None
    num = getattr(e, "errno", None)
    return {"type": type(e).__name__, "message": str(e)[:300], "line": line,
            "errno": errno.errorcode.get(num, "") if isinstance(num, int) else ""}


def _on_alarm(signum, frame):
    raise CaseTimeLimit()


def _limit(seconds: float) -> None:
    signal.setitimer(signal.ITIMER_REAL, max(0.0, seconds))


def run_question(q: dict, ex, case_seconds: float) -> None:
    """Define one question's code in a fresh namespace and run its cases (in its own process)."""
    ns = {"__name__": "submission", "__builtins__": __builtins__}
    try:
        _limit(case_seconds)
        exec(compile(q["code"], f"{FILE_PREFIX}{q['name']}>", "exec"), ns)
        _limit(0)
    except (Exception, CaseTimeLimit) as e:
        _limit(0)
        emit({"q": q["name"], "defining": True, "error": _error(e, q.get("first_line", 1))})
        return
    fn = ns.get(q["function"])
    timed_out = False
    for test, case_no, case in q["cases"]:
        if timed_out:   # one endless loop is enough: the question's other cases are not waited for
            emit({"q": q["name"], "t": test, "c": case_no, "error": {
                "type": "CaseTimeLimit", "message": "not run: an earlier case ran past the time limit",
                "line": None, "errno": ""}})
            continue
        t0 = time.perf_counter()
        try:
            _limit(case_seconds)
            answer = ex.run(fn, case)
            _limit(0)
            emit({"q": q["name"], "t": test, "c": case_no, "answer": answer,
                  "seconds": round(time.perf_counter() - t0, 4)})
        except (Exception, CaseTimeLimit) as e:
            _limit(0)
            timed_out = isinstance(e, CaseTimeLimit)
            emit({"q": q["name"], "t": test, "c": case_no, "error": _error(e, q.get("first_line", 1))})


# --------------------------------------------------------------------------- the server

ALARM_GRACE_S = 2.0             # past the case limit, a question process that ignored its alarm is killed
QUESTION_OUTPUT_BYTES = 1_000_000   # what the server reads of one question process's lines
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER = 4, 36


def _harden() -> None:
    """No question process may trace or read this one (not dumpable); orphans they leave behind
    become this process's children (a subreaper), so that they can be found and ended."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):   # not Linux: the sandbox (bwrap) is Linux-only anyway
        pass


def _end_all_below() -> None:
    """Kill and reap every process a question left behind (a fork bomb's too)."""
    me = psutil.Process()
    for _ in range(200):
        pids = me.children(recursive=True)
        for p in pids:
            try:
                p.kill()
            except psutil.Error:
                pass
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
        if not pids:
            return
        time.sleep(0.005)


def _accept(line: bytes, name: str) -> dict | None:
    """A question process's line, if it is about that question (else None: it is dropped)."""
    try:
        rec = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(rec, dict):
        return None
    if "tried" in rec and isinstance(rec["tried"], str):
        return {"q": name, "tried": rec["tried"][:300]}
    if rec.get("q") == name and ("t" in rec or rec.get("defining") or rec.get("end")):
        return rec
    return None


def _question_process(q: dict, ex, case_seconds: float) -> None:
    """Run question ``q`` in a forked process of its own; pass its lines on; end what it left."""
    global _pid, _tried
    emit({"q": q["name"], "start": True})   # from here on, an end of this process is the submission's doing
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:   # the question's process: its lines go to its own pipe, not to the grader's stream
        try:
            os.close(read_fd)
            os.dup2(write_fd, _proto.fileno())
            os.close(write_fd)
            _pid, _tried = os.getpid(), set()
            run_question(q, ex, case_seconds)
            emit({"q": q["name"], "end": True})
        finally:
            os._exit(0)
    os.close(write_fd)
    gap = case_seconds + ALARM_GRACE_S    # the longest silence of a process that heeds its alarm
    ended: dict | None = None
    finished, buf, kept, last = False, b"", 0, time.monotonic()

    def take(chunk: bytes) -> bool:
        """Pass on the complete lines in ``chunk``; True once the process said it is done."""
        nonlocal buf, kept
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            kept += len(line)
            rec = _accept(line, q["name"]) if kept <= QUESTION_OUTPUT_BYTES else None
            if rec is not None and rec.get("end"):
                return True
            if rec is not None:
                emit(rec)
        return False

    while not finished:
        left = gap - (time.monotonic() - last)
        if left <= 0:    # silent past the case limit: it ignored the alarm
            ended = {"how": "timeout", "code": None}
            break
        if not select.select([read_fd], [], [], min(left, 0.25))[0]:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:     # it ended, but something it started keeps the pipe open: read what is there
                pid, ended = 0, _how_it_ended(status)
                os.set_blocking(read_fd, False)
                try:
                    finished = take(os.read(read_fd, QUESTION_OUTPUT_BYTES))
                except BlockingIOError:
                    pass
                break
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:    # every writer is gone: it ended (or closed its stream; then it is ended below)
            for _ in range(int(gap * 100)):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    pid, ended = 0, _how_it_ended(status)
                    break
                time.sleep(0.01)
            else:
                ended = {"how": "timeout", "code": None}
            break
        last = time.monotonic()
        finished = take(chunk)
    os.close(read_fd)
    _end_all_below()     # the question's process (if it still runs) and all it started
    if not finished:
        emit({"q": q["name"], "ended": ended or {"how": "exit", "code": None}})


def _how_it_ended(status: int) -> dict:
    if os.WIFSIGNALED(status):
        return {"how": "signal", "code": os.WTERMSIG(status)}
    return {"how": "exit", "code": os.waitstatus_to_exitcode(status)}


def run(job: dict) -> None:
    from lab_utils.app.grading.exercises import EXERCISES

    case_seconds = float(job.get("case_seconds", 20.0))
    for q in job["questions"]:   # imports the cases need are not the submission's time
        for module in EXERCISES[q["name"]].needs:
            importlib.import_module(module)
    _harden()
    sys.addaudithook(_audit)
    for q in job["questions"]:
        _question_process(q, EXERCISES[q["name"]], case_seconds)


def main() -> None:
    global _proto, _pid
    _pid = os.getpid()
    job = json.loads(sys.stdin.read())
    uid = job.get("drop_to")
    if uid is not None and os.getuid() == 0:  # inside bwrap as root: become a user of our own
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    _proto = os.fdopen(os.dup(1), "w", buffering=1)
    out = os.open("output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a too-large write is an OSError (EFBIG), not a kill
    signal.signal(signal.SIGALRM, _on_alarm)
    try:
        run(job)
        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        emit({"done": True, "cpu_seconds": round(sum(u.ru_utime + u.ru_stime for u in used), 3)})
    except BaseException as e:  # the grader's own failure: say so, with where
        emit({"internal": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1500:]})
    _proto.flush()
    os._exit(0)  # no atexit handler of the submission runs


if __name__ == "__main__":
    main()
