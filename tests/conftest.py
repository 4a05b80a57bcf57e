"""Test-wide settings: results and data go to temporary folders, never into the repo.

Every test has a time limit (pytest-timeout, ``timeout`` in pyproject.toml for plain
tests). Tests marked ``slow`` (processes, launches, notebooks) get :data:`SLOW_TIMEOUT_S`
and ``slurm`` ones :data:`SLURM_TIMEOUT_S` (the first installs and starts SLURM), unless
they carry their own ``@pytest.mark.timeout``. Inside those limits, every subprocess and
launch has its own, shorter timeout, so it fails with its own message first.

Tests run offline on CPU. ``LAB_DATA_DIR`` points at an empty folder so the synthetic
CIFAR-10 stand-in is used even where real data was prepared; ``LAB_RESULTS_DIR`` points
at a per-session folder. Each test that needs a clean store uses the ``store`` fixture.
"""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="lab_tests_"))
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)  # each pytest process (xdist: each worker)
os.environ["LAB_RESULTS_DIR"] = str(_SESSION_DIR / "results")
os.environ["LAB_DATA_DIR"] = str(_SESSION_DIR / "data")
os.environ.setdefault("LAB_PROFILE", "quick")
os.environ["LAB_HEADLESS"] = "1"
os.environ.setdefault("MPLBACKEND", "agg")
# The suite runs three workers and their children on two cores. OpenMP's threads (torch's intra-op
# pool, 2 here) spin while they wait for work, which on an oversubscribed machine burns the CPU the
# other processes need: tests/test_train.py's two-epoch run beside two busy loops used 14.5 s of CPU,
# 7.1 s with passive waiting (17.9 -> 10.5 s wall). Set before torch loads; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.pop("LAB_DATASET", None)
(_SESSION_DIR / "data").mkdir(parents=True, exist_ok=True)


SLOW_TIMEOUT_S = 420
SLURM_TIMEOUT_S = 900


#: The test files that take longest (minutes: the whole lab in the quick profile, a SLURM cluster's jobs),
#: collected first so that `make test`'s workers (pytest-xdist, one file at a time) start them at once
#: and share the rest, instead of one worker starting them last.
LONGEST_FIRST = ("test_notebooks.py", "test_slurm.py", "test_grading.py")


def _machine_cpu() -> tuple[float, float] | None:
    """(busy, idle) CPU seconds of the whole machine since boot, from /proc/stat (Linux), else None."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
        user, nice, system, idle, iowait, irq, softirq, steal = fields
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq + steal) / tick, (idle + iowait) / tick


_STARTED, _MACHINE_AT_START = time.monotonic(), _machine_cpu()


def pytest_terminal_summary(terminalreporter, config):
    """The suite's CPU time and this machine's speed, after every run: the test-time bar depends on
    both (the same commit took 12 min on one day's machine and 18 on a 1.6x slower one)."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller, its parent, counts it
        return
    import resource

    used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
    user, system = sum(u.ru_utime for u in used), sum(u.ru_stime for u in used)
    now = _machine_cpu()
    if now is not None and _MACHINE_AT_START is not None:
        busy, idle = (b - a for a, b in zip(_MACHINE_AT_START, now))
        # the SLURM tests' jobs and daemons, and processes that outlive their parent, count here only
        machine = f"; the machine's cores were busy {busy:,.0f} s of {busy + idle:,.0f} s"
    else:
        machine = ""
    start, total = time.perf_counter(), 0
    for i in range(10_000_000):  # the machine's speed, measured now that the suite has ended
        total += i
    loop = time.perf_counter() - start
    terminalreporter.write_line(
        f"suite CPU: {user + system:,.0f} s (user {user:,.0f} + system {system:,.0f}; pytest and every "
        f"process it waited for) in {time.monotonic() - _STARTED:,.0f} s on {os.cpu_count()} cores"
        f"{machine}; this machine adds 10 million numbers in Python in {loop:.2f} s")


#: ``LAB_TEST_CPU_LOG=<file>``: each test's share of the machine's CPU (its busy seconds, /proc/stat,
#: setup and teardown included), a JSON line per test. Exact with one process (``make test
#: TEST_WORKERS=0``), where every busy second of the machine belongs to the running test: that is how
#: the suite's CPU per test file was measured (issue 34's closing notes).
_CPU_LOG = os.environ.get("LAB_TEST_CPU_LOG")
_CPU_LOG = os.path.abspath(_CPU_LOG) if _CPU_LOG else None  # where make test started: a test may chdir


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    if _CPU_LOG is None:  # not asked for: no /proc reads around every test
        yield
        return
    before, t0 = _machine_cpu(), time.monotonic()
    yield
    after = _machine_cpu()
    if before is not None and after is not None:
        import json

        with open(_CPU_LOG, "a") as f:
            f.write(json.dumps({"test": item.nodeid, "busy_s": round(after[0] - before[0], 2),
                                "wall_s": round(time.monotonic() - t0, 2)}) + "\n")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    for item in items:
        if item.get_closest_marker("timeout"):
            continue
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.timeout(SLURM_TIMEOUT_S))
        elif item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))


@pytest.fixture
def results_dir(tmp_path, monkeypatch) -> Path:
    """A fresh, empty results root for one test."""
    root = tmp_path / "results"
    monkeypatch.setenv("LAB_RESULTS_DIR", str(root))
    return root


@pytest.fixture
def store(results_dir):
    """A ResultStore for the quick profile under a fresh results root."""
    from lab_utils.engine.store import ResultStore

    return ResultStore("quick")


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """Make a :class:`fake_gpu.FakeGPU` (keyword arguments: its fields) and apply it: ``torch.cuda``
    patched, and its ``nvidia-smi`` first on PATH. Undone after the test, which fails if the lab sent
    that nvidia-smi a query it does not answer."""
    from fake_gpu import FakeGPU

    made: list[FakeGPU] = []

    def make(**fields) -> FakeGPU:
        gpu = FakeGPU(**fields).patch(monkeypatch)
        gpu.install_nvidia_smi(tmp_path / "fake_gpu_bin", monkeypatch)
        made.append(gpu)
        return gpu

    yield make
    for gpu in made:   # a query the fake nvidia-smi does not answer fails the test (tests/fake_gpu.py)
        gpu.check_smi_queries()


@pytest.fixture
def int_mm_on_cpu(monkeypatch):
    """notebook 07's torch._int_mm probe (quant_variants.int_mm_probe) with its operands made on the CPU:
    under the fake GPU, cuBLAS int8 is this CPU's _int_mm; the probe's cache starts empty."""
    from lab_utils.experiments.n07_quantization import quant_variants

    on_cpu = quant_variants._int8_operands
    monkeypatch.setattr(quant_variants, "_int8_operands", lambda device, k=32: on_cpu("cpu", k))
    monkeypatch.setattr(quant_variants, "_INT_MM_PROBES", {})
    return quant_variants


@pytest.fixture
def one_rank(monkeypatch):
    """torchrun's environment of a 1-rank job; the process group (if made) is destroyed afterwards."""
    import torch.distributed as dist

    from lab_utils.engine.dist import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def launch_here(monkeypatch):
    """The launcher's one-process launches run in this process instead (the worker's harness over its
    job, as the launched process would run it): a plan's GPU runs under the fake GPU (tests/fake_gpu.py)
    without a child process. Returns the list of (module, processes, job) launched."""
    import importlib

    import torch

    from lab_utils.engine import launcher
    from lab_utils.engine.dist import DistContext
    from lab_utils.engine.harness import Job, execute

    launched: list = []

    def stream(module, job, nproc=2, timeout_s=600, log_dir=None, env=None, threads_per_rank=None, info=None):
        assert nproc == 1, "launch_here runs one-process launches only"
        launched.append((module, nproc, job))
        worker = importlib.import_module(module)
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        for records in execute(worker, Job.from_dict(job), DistContext(device=device)):
            yield from records

    monkeypatch.setattr(launcher, "stream", stream)
    return launched


@pytest.fixture
def tiny_disk(tmp_path):
    """A 1 MiB tmpfs, to fill (root only: CI runs as root; skipped elsewhere): test_runner, test_handin."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)
