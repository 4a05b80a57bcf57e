"""The process that runs one submission's exercise functions, inside the sandbox.

``python -I -B -m lab_utils.grading.child`` reads a job (JSON) on stdin::

    {"drop_to": uid or null, "case_seconds": s,
     "questions": [{"name", "function", "code", "first_line", "cases": [[test, case, input], ...]}]}

and writes one JSON line per result on its standard output, which it keeps for itself (the
submission's own prints go to ``output.txt`` in its private folder)::

    {"q": name, "t": test, "c": case, "answer": ..., "seconds": s}
    {"q": name, "t": test, "c": case, "error": {"type", "message", "errno", "line"}}
    {"q": name, "error": {...}, "defining": true}      the code failed before any case ran
    {"tried": "open /root/.ssh/id_rsa (read)"}          what the submission's code asked for
    {"done": true}

It holds no expected answer: the grader compares in its own process. Each question's code (its
function and the imports, definitions and constants it uses, as extracted by
:func:`lab_utils.grading.notebooks.extract_exercise`) runs in a fresh namespace; each case runs
under a time limit. An audit hook notes files, sockets and processes the submission's code asks
for (the sandbox refuses them; this only names them in the gradebook).
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import signal
import sys
import time
import traceback

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
    return f"{event} {str(args[:1])[:80]}"


_LIBRARY = tuple(p for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, "/usr", "/proc/self", "/dev/null",
                             os.path.dirname(os.path.dirname(os.path.abspath(__file__)))} if p)


def _library_read(event: str, args: tuple) -> bool:
    """Reading the interpreter's and the lab's own files (imports): not worth naming."""
    if event not in ("open", "os.listdir", "os.scandir") or not args or not isinstance(args[0], (str, bytes)):
        return False
    if event == "open" and not _describe(event, args).endswith("(read)"):
        return False
    path = os.path.abspath(os.fsdecode(args[0]))
    return path.startswith(_LIBRARY)


def _audit(event: str, args: tuple) -> None:
    if event not in WATCHED or len(_tried) >= MAX_TRIED:
        return
    try:
        if _library_read(event, args) or not _in_exercise_code():
            return
        what = _describe(event, args)
        if what and what not in _tried:
            _tried.add(what)
            emit({"tried": what})
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


def run(job: dict) -> None:
    from lab_utils.grading.exercises import EXERCISES

    case_seconds = float(job.get("case_seconds", 20.0))
    for q in job["questions"]:   # imports the cases need are not the submission's time
        for module in EXERCISES[q["name"]].needs:
            importlib.import_module(module)
    sys.addaudithook(_audit)
    for q in job["questions"]:
        ex = EXERCISES[q["name"]]
        ns = {"__name__": "submission", "__builtins__": __builtins__}
        try:
            _limit(case_seconds)
            exec(compile(q["code"], f"{FILE_PREFIX}{q['name']}>", "exec"), ns)
            _limit(0)
        except (Exception, CaseTimeLimit) as e:
            _limit(0)
            emit({"q": q["name"], "defining": True, "error": _error(e, q.get("first_line", 1))})
            continue
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
        emit({"done": True})
    except BaseException as e:  # the grader's own failure: say so, with where
        emit({"internal": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1500:]})
    _proto.flush()
    os._exit(0)  # no atexit handler of the submission runs


if __name__ == "__main__":
    main()
