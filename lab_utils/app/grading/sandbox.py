"""Running a submission's code where it can harm nothing: bubblewrap (``bwrap``) plus resource limits.

What the sandbox shows and which limits hold: ``docs/grading.md``, "The sandbox". The limits
(``resource``) are set by a small launcher before ``bwrap`` starts and inherited by everything inside;
when the grader runs as root, the child drops to a user id of its own per parallel slot
(:data:`UID_BASE`), so that the process limit holds (the kernel does not count root's processes). Without
``bwrap``, :func:`probe` says why, and only ``--no-sandbox`` grades: the same child and limits in a
private temporary folder, with the instructor's rights.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

import lab_utils
from lab_utils.engine import proc

SANDBOX_HOME = "/grading"          # the submission's private folder inside the sandbox
# Root: the child becomes a user id of its own (no account needed), one per parallel slot and per
# grading run (two runs at once must not share a process count).
UID_BASE = 2_100_000_000 + (os.getpid() % 100_000) * 64
MAX_OUTPUT_BYTES = 4_000_000       # what the grader reads of a child's result stream
CHILD = [sys.executable, "-I", "-B", "-m", "lab_utils.app.grading.child"]
INSTALL_HINT = ("install bubblewrap (make sandbox, i.e. apt-get install bubblewrap; RHEL: dnf install "
                "bubblewrap), or grade without a sandbox on purpose with --no-sandbox (make grade "
                "GRADE_ARGS=--no-sandbox), knowing that the submissions' code then runs with your rights: it "
                "can read and change your files and use the network")

# Runs before bwrap (python -I -S -c): set the limits, then exec the command. A launcher instead of
# Popen(preexec_fn=...), which is unsafe in a process with threads (the grader runs several at once).
_LAUNCH = """import os, resource, sys
a = sys.argv[1:]
i = a.index("--")
for spec in a[:i]:
    name, value = spec.split("=")
    v = int(value)
    resource.setrlimit(getattr(resource, name), (v, v))
os.execvp(a[i + 1], a[i + 1:])
"""


@dataclass(frozen=True)
class Limits:
    """What one submission may use (all sizes in bytes, times in seconds)."""
    wall_seconds: float = 120.0       # the whole submission, start to end
    case_seconds: float = 20.0        # one case (or one question's definitions)
    cpu_seconds: int = 150            # CPU time of each process (RLIMIT_CPU)
    memory_bytes: int = 6 << 30       # address space of each process (RLIMIT_AS; torch maps ~3 GB)
    file_bytes: int = 64 << 20        # largest file it may write (RLIMIT_FSIZE)
    folder_bytes: int = 128 << 20     # its private folder and /tmp (tmpfs size)
    processes: int = 64               # processes and threads (RLIMIT_NPROC)

    def describe(self) -> str:
        return (f"{self.wall_seconds:g} s per notebook, {self.case_seconds:g} s per case, "
                f"{self.memory_bytes / 2 ** 30:g} GiB of memory, {self.file_bytes / 2 ** 20:g} MiB per file, "
                f"{self.processes} processes")


@dataclass
class Outcome:
    """What came back from one child: its result lines and how it ended."""
    lines: list[dict] = field(default_factory=list)
    returncode: int | None = None
    timed_out: bool = False
    seconds: float = 0.0
    stderr: str = ""
    sandbox: str = "bwrap"            # "bwrap" or "none"

    @property
    def done(self) -> bool:
        return any(r.get("done") for r in self.lines)

    @property
    def cpu_seconds(self) -> float:
        """CPU time (user + system, s) the child and its question processes used, as it reported at
        its end (0 when it did not end normally): bwrap does not pass its children's time on."""
        return next((float(r.get("cpu_seconds") or 0) for r in self.lines if r.get("done")), 0.0)

    @property
    def internal(self) -> str:
        return next((r["internal"] for r in self.lines if "internal" in r), "")


def _is_root() -> bool:
    return os.geteuid() == 0


def library_paths() -> list[Path]:
    """What the child needs to read: the interpreter, the environment, the lab's package only."""
    lab_pkg = Path(lab_utils.__file__).resolve().parent
    checkout = lab_pkg.parent
    paths = {Path(sys.prefix), Path(sys.base_prefix), Path(sys.exec_prefix), Path(sys.base_exec_prefix)}
    import sysconfig

    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        paths.add(Path(sysconfig.get_paths()[key]))
    paths = {p.resolve() for p in paths if p.exists()} | {lab_pkg}
    paths = {lab_pkg if p == checkout else p for p in paths}
    keep = []
    for p in sorted(paths, key=lambda p: len(p.parts)):
        if str(p).startswith("/usr/") or p == Path("/usr"):
            continue
        if not any(p == k or k in p.parents for k in keep):
            keep.append(p)
    return keep


def exposed(private: list[Path]) -> list[str]:
    """Private folders (submissions, bundle, gradebook) that a library bind would show the sandbox."""
    binds = library_paths()
    out = []
    for p in private:
        p = Path(p).resolve()
        out += [f"{p} is inside {b}" for b in binds if b == p or b in p.parents]
    return out


def bwrap_command(bwrap: str, notebook_fd: int | None, notebook_name: str, limits: Limits) -> list[str]:
    """The ``bwrap`` arguments that build the sandbox (before the command it runs)."""
    args = [bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
            "--die-with-parent", "--new-session"]
    if _is_root():
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user"]
    args += ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        top = Path("/") / name
        if top.is_symlink():
            args += ["--symlink", os.readlink(top), str(top)]
        elif top.is_dir():
            args += ["--ro-bind", str(top), str(top)]
    args += ["--perms", "0755", "--dir", "/etc"]
    for f in ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "passwd", "group"):
        args += ["--ro-bind-try", f"/etc/{f}", f"/etc/{f}"]
    size = str(limits.folder_bytes)
    # mounts first, binds after: an environment under /tmp must stay visible over the private /tmp
    args += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", size, "--tmpfs", "/tmp"]
    made = {"/", "/etc", "/usr", "/tmp", "/proc", "/dev"}
    for p in library_paths():
        for parent in reversed(p.parents):
            if str(parent) not in made:
                made.add(str(parent))
                args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(p), str(p)]
    args += ["--perms", "0777", "--size", size, "--tmpfs", SANDBOX_HOME]
    if notebook_fd is not None:
        args += ["--perms", "0644", "--file", str(notebook_fd), f"{SANDBOX_HOME}/{notebook_name}"]
    args += ["--chdir", SANDBOX_HOME, "--clearenv", "--setenv", "HOME", SANDBOX_HOME,
             "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "LANG", "C.UTF-8", "--setenv", "TMPDIR", "/tmp",
             "--setenv", "OMP_NUM_THREADS", "1", "--setenv", "MKL_NUM_THREADS", "1"]
    return args


def _user_tasks() -> int:
    """Processes and threads of this user now (RLIMIT_NPROC counts them all)."""
    uid = os.getuid()
    return sum(p.info["num_threads"] or 1 for p in psutil.process_iter(["uids", "num_threads"])
               if p.info["uids"] and p.info["uids"].real == uid)


def _rlimits(limits: Limits, jobs: int) -> list[str]:
    nproc = limits.processes if _is_root() else _user_tasks() + limits.processes * max(1, jobs) + 64
    return [f"RLIMIT_CPU={limits.cpu_seconds}", f"RLIMIT_AS={limits.memory_bytes}",
            f"RLIMIT_FSIZE={limits.file_bytes}", f"RLIMIT_NPROC={nproc}", "RLIMIT_CORE=0"]


def probe(limits: Limits = Limits()) -> str:
    """"" when a sandbox can be made here, else one sentence saying why not and what to do."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return f"bwrap is not installed: {INSTALL_HINT}"
    cmd = bwrap_command(bwrap, None, "", limits) + [sys.executable, "-I", "-S", "-c", "pass"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bwrap could not start ({e}): {INSTALL_HINT}"
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["no message"])[-1]
        return (f"bwrap cannot make a sandbox here ({why}; user namespaces may be disabled: "
                f"sysctl kernel.unprivileged_userns_clone=1): {INSTALL_HINT}")
    return ""


def _read(stream, sink: list, cap: int) -> None:
    """Read a pipe to its end, keeping at most ``cap`` bytes."""
    kept = 0
    while True:
        chunk = stream.read(65536)
        if not chunk:
            break
        if kept < cap:
            sink.append(chunk[:cap - kept])
            kept += len(chunk)


def run(job: dict, notebook: Path, limits: Limits, slot: int = 0, jobs: int = 1,
        sandbox: bool = True) -> Outcome:
    """Run the child on ``job`` (a sandbox unless ``sandbox=False``); collect its result lines."""
    job = {**job, "case_seconds": limits.case_seconds,
           "drop_to": UID_BASE + slot if (sandbox and _is_root()) else None}
    launch = [sys.executable, "-I", "-S", "-c", _LAUNCH, *_rlimits(limits, jobs), "--"]
    out = Outcome(sandbox="bwrap" if sandbox else "none")
    fd, tmp = None, None
    try:
        if sandbox:
            fd = os.open(notebook, os.O_RDONLY)
            cmd = launch + bwrap_command(shutil.which("bwrap"), fd, notebook.name, limits) + CHILD
            cwd, env = "/", {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        else:
            tmp = tempfile.mkdtemp(prefix="grade-nosandbox-")
            shutil.copy(notebook, Path(tmp) / notebook.name)
            cmd, cwd = launch + CHILD, tmp
            env = {"HOME": tmp, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "TMPDIR": tmp,
                   "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        t0 = time.perf_counter()
        # its own session, marked: Child.stop ends it and whatever it started (in the sandbox, the
        # pid namespace goes with bwrap; without one, the question processes carry the mark)
        child = proc.start(cmd, cwd=cwd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, pass_fds=(fd,) if fd is not None else ())
        popen = child.popen
        got_out: list[bytes] = []
        got_err: list[bytes] = []
        readers = [threading.Thread(target=_read, args=(popen.stdout, got_out, MAX_OUTPUT_BYTES),
                                    daemon=True),
                   threading.Thread(target=_read, args=(popen.stderr, got_err, 20_000), daemon=True)]
        for r in readers:
            r.start()
        try:
            popen.stdin.write(json.dumps(job).encode())
            popen.stdin.close()
        except BrokenPipeError:
            pass
        try:
            popen.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            out.timed_out = True
        child.stop(grace_s=0.0)   # SIGKILL at once, also when it ended: nothing it started may outlive it
        popen.wait()
        for r in readers:
            r.join(timeout=10)
        out.seconds = time.perf_counter() - t0
        out.returncode = popen.returncode
        out.stderr = b"".join(got_err).decode(errors="replace")
        for line in b"".join(got_out).decode(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.lines.append(rec)
    finally:
        if fd is not None:
            os.close(fd)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out
