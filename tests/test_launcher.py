"""The torchrun launcher: records come back, a dead rank or a timeout raises a LaunchError
that quotes the right log, and no process of the launch survives it (checked in /proc)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lab_utils.engine import dist as labdist
from lab_utils.engine import launcher, proc
from lab_utils.engine.launcher import error_in_log, failing_rank, launch, stream
from lab_utils.learn.errors import LabError, LaunchError

TESTS = Path(__file__).resolve().parent
TOY = "ddp_toy_worker"


def toy_env(token: str = "") -> dict[str, str]:
    """The toy worker on the path; with ``token``, a mark every process of the launch inherits
    (:mod:`lab_utils.engine.proc`: the launcher adds its own mark after it)."""
    path = os.environ.get("PYTHONPATH", "")
    env = {"PYTHONPATH": str(TESTS) + (os.pathsep + path if path else "")}
    return proc.marked_env(token, env) if token else env


def job(mode: str, **config) -> dict:
    """A one-configuration job for the toy worker (what lab_utils.engine.plan.measure writes)."""
    return {"experiment": "toy", "profile": "quick", "configs": [{"mode": mode, **config}]}


def zombie_children() -> list[int]:
    """Children of this test process that exited but were never reaped."""
    me = os.getpid()
    out = []
    for e in os.listdir("/proc"):
        if not e.isdigit():
            continue
        try:
            stat = Path(f"/proc/{e}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == me and fields[0] == "Z":
            out.append(int(e))
    return out


def assert_nothing_left(token: str) -> None:
    left = proc.leftover(token)
    assert not left, f"processes {left} of the launch are still running"
    assert not zombie_children(), "the launcher left unreaped (zombie) children"


@pytest.mark.slow
def test_launch_returns_rank0_records_and_splits_threads(tmp_path, monkeypatch):
    token = uuid.uuid4().hex
    # a port another process took after it was found free: the launch must not depend on it (a
    # --master-port chosen before torchrun started failed a CI run with EADDRINUSE)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        for module in (labdist, launcher):
            monkeypatch.setattr(module, "free_port", lambda: taken.getsockname()[1], raising=False)
        res = launch(TOY, job("ok"), nproc=2, timeout_s=120, log_dir=tmp_path, env=toy_env(token),
                     threads_per_rank=1)
    [rec] = res.records  # rank 0's, with every rank's view gathered
    assert [m["rank"] for m in rec.metrics["ranks"]] == [0, 1]
    assert all(m["world"] == 2 and m["omp"] == "1" for m in rec.metrics["ranks"])
    assert "toy worker rank 1/2" in res.log(1)
    assert_nothing_left(token)


@pytest.mark.slow
def test_a_stream_leaves_no_temporary_folder_however_it_ends(tmp_path, monkeypatch):
    """The experiments stream without a log folder: its temporary logs (lab_ddp_*) are removed after
    a success, a failure (whose error still quotes the failing rank's lines) and a timeout."""
    import tempfile

    from ddp_toy_worker import FAIL_MARKER  # noqa: E402 (tests/ is on sys.path under pytest)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # for torchrun too (it left a torchelastic_* there)
    token = uuid.uuid4().hex
    recs = list(stream(TOY, job("ok"), nproc=2, timeout_s=120, env=toy_env(token), threads_per_rank=1))
    assert [m["rank"] for m in recs[0].metrics["ranks"]] == [0, 1]
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LaunchError) as failed:
        list(stream(TOY, job("fail", fail_rank=1), nproc=2, timeout_s=120, env=toy_env(token),
                    threads_per_rank=1))
    assert FAIL_MARKER in str(failed.value)  # quoted before the folder went
    assert "rank1.log, in a temporary folder now removed: pass log_dir to keep it" in str(failed.value)
    assert str(tmp_path) not in str(failed.value)  # no path that no longer exists
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(LaunchError, match="did not finish within 6 s"):
        list(stream(TOY, job("sleep"), nproc=2, timeout_s=6, env=toy_env(token), threads_per_rank=1))
    assert list(tmp_path.iterdir()) == []
    assert_nothing_left(token)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_interrupted_stream_leaves_no_temporary_folder(tmp_path):
    """Ctrl-C (SIGINT) in a process that streams a launch: the tree is stopped and the temporary
    logs removed (the KeyboardInterrupt runs the launch's clean-up)."""
    token = uuid.uuid4().hex
    # Ctrl-C raises KeyboardInterrupt, as in a terminal's Python or a Jupyter kernel; a shell's background
    # job (CI started with `&`) passes SIGINT on ignored, and then nothing would happen
    code = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "from lab_utils.engine.launcher import stream\n"
            "job = {'experiment': 'toy', 'profile': 'quick', 'configs': [{'mode': 'sleep'}]}\n"
            "list(stream('ddp_toy_worker', job, nproc=2, timeout_s=120, threads_per_rank=1))")
    env = {**os.environ, **toy_env(token), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob("lab_ddp_*/rank1.log")):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=10)
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
    assert list(tmp_path.iterdir()) == []
    assert_nothing_left(token)


@pytest.mark.slow
def test_dead_rank_raises_with_its_log_and_leaves_nothing(tmp_path):
    from ddp_toy_worker import FAIL_MARKER  # noqa: E402 (tests/ is on sys.path under pytest)

    (tmp_path / "rank0.log").write_text("Traceback: a stale log of an earlier run\n")
    token = uuid.uuid4().hex
    with pytest.raises(LaunchError) as info:
        launch(TOY, job("fail", fail_rank=1), nproc=2, timeout_s=120, log_dir=tmp_path,
               env=toy_env(token), threads_per_rank=1)
    msg = str(info.value)
    assert "rank 1" in msg and FAIL_MARKER in msg
    assert "deliberate failure on rank 1" in msg
    assert "stale log" not in (tmp_path / "rank0.log").read_text()
    assert_nothing_left(token)


@pytest.mark.slow
def test_a_launch_that_fails_outside_a_rank_gives_its_error_line_as_the_reason(tmp_path):
    """No rank wrote a failure (here the worker module does not exist): the row's reason is the
    log's error line, not the message's first line, whose log is gone with the temporary folder."""
    with pytest.raises(LaunchError) as info:
        launch("no_such_worker_module", job("ok"), nproc=1, timeout_s=120, threads_per_rank=1)
    reason = info.value.failure["reason"]
    assert reason.startswith("torchrun exit code 1: ") and "No module named no_such_worker_module" in reason
    assert info.value.failure["status"] == "error" and info.value.failure["config_index"] is None


@pytest.mark.slow
def test_timeout_stops_every_process(tmp_path):
    token = uuid.uuid4().hex
    with pytest.raises(LaunchError, match="did not finish within 8 s") as info:
        launch(TOY, job("sleep"), nproc=2, timeout_s=8, log_dir=tmp_path, env=toy_env(token),
               threads_per_rank=1)
    # the message shows where each rank was when it was stopped (if it got that far)
    assert "Last lines of" in str(info.value)
    assert_nothing_left(token)


def test_bad_arguments_fail_before_starting_anything(tmp_path):
    with pytest.raises(LabError, match="nproc"):
        launch(TOY, job("ok"), nproc=0, log_dir=tmp_path)
    with pytest.raises(LabError, match="timeout_s"):
        launch(TOY, job("ok"), nproc=1, timeout_s=0, log_dir=tmp_path)
    with pytest.raises(LabError, match="threads_per_rank"):
        launch(TOY, job("ok"), nproc=1, threads_per_rank=0, log_dir=tmp_path)
    assert not (tmp_path / "torchrun.log").exists()


def test_failing_rank_is_read_from_torchrun_summary(tmp_path):
    agent = """
Root Cause (first observed failure):
[0]:
  time      : 2025-01-01_00:00:00
  host      : node
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 123)
"""
    assert failing_rank(agent, {}) == 3
    log = tmp_path / "rank2.log"
    log.write_text("Traceback (most recent call last):\nRuntimeError: x\n")
    assert failing_rank("no summary", {0: tmp_path / "missing.log", 2: log}) == 2
    assert failing_rank("no summary", {}) is None
    # Two failures in the same second (rank 0 failed because rank 1 had left): the log that stopped first
    both = ("Failures:\n[1]:\n  rank      : 1 (local_rank: 1)\n  exitcode  : 1\n"
            "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1\n")
    first, second = tmp_path / "rank1.log", tmp_path / "rank0.log"
    first.write_text("Traceback\nRuntimeError on rank 1 of 2: x\n")
    second.write_text("Traceback\nRuntimeError: Connection reset by peer\n")
    os.utime(first, (1000, 1000))
    os.utime(second, (1000.05, 1000.05))
    assert failing_rank(both, {0: second, 1: first}) == 1


def test_the_error_line_of_a_launch_comes_from_the_log_that_has_it(tmp_path):
    """The row's reason when no rank wrote its failure (each case as torchrun 2.14 prints it)."""
    agent = tmp_path / "torchrun.log"
    report = ("E1129 00:26:21.590000 16885 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
              "(exitcode: -9) local_rank: 0 (pid: 16892) of binary: /x/python\nTraceback (most recent call "
              "last):\n  File \"run.py\", line 1142, in <module>\ntorch.distributed.elastic.multiprocessing."
              "errors.ChildFailedError:\n=====\nRoot Cause (first observed failure):\n  exitcode  : -9\n")
    # torchrun itself crashed before any rank started: its own last error
    agent.write_text("Traceback (most recent call last):\n  File \"static_tcp_rendezvous.py\", line 67\n"
                     "torch.distributed.DistNetworkError: The server socket has failed to listen on any "
                     "local network address. port: 38939, code: -98, name: EADDRINUSE\n")
    assert error_in_log(None, {}, agent).startswith("torch.distributed.DistNetworkError: The server socket")
    # a rank's traceback went to the rank log: that, not torchrun's report
    rank0 = tmp_path / "rank0.log"
    rank0.write_text("epoch 1\nTraceback (most recent call last):\nRuntimeError: shapes do not match\nbye\n")
    agent.write_text(report)
    assert error_in_log(0, {0: rank0}, agent) == "RuntimeError: shapes do not match"
    # a rank killed by a signal says nothing: torchrun's line with the exit code
    rank0.write_text("epoch 1\nepoch 2\n")
    assert error_in_log(0, {0: rank0}, agent).startswith("failed (exitcode: -9) local_rank: 0")
    # output before torchrun's report (python -m with a missing module): its last line
    agent.write_text("/x/python: No module named nope\n" + report)
    assert error_in_log(None, {}, agent) == "/x/python: No module named nope"
    assert error_in_log(None, {}, tmp_path / "missing.log") == "(no log)"
    assert len(error_in_log(None, {}, agent, limit=10)) == 10


def test_a_free_port_is_free_below_the_ephemeral_range_and_not_one_to_avoid(monkeypatch):
    """The kernel hands out ports of its ephemeral range to new connections at any time: a port for
    a server that starts seconds later (torchrun, a SLURM daemon) is chosen below it."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    port = labdist.free_port()
    assert 10_000 <= port < low
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", labdist.free_port()))
        taken.listen()
        busy, avoided = taken.getsockname()[1], labdist.free_port()
        chosen = labdist.free_port(avoid=[avoided])
        draws = iter([busy, avoided, chosen])
        monkeypatch.setattr(labdist.random, "SystemRandom",
                            lambda: type("Draws", (), {"randrange": lambda self, a, b: next(draws)})())
        assert labdist.free_port(avoid=[avoided]) == chosen  # the taken one and the avoided one skipped
