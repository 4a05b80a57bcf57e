"""``python -m lab_utils measure NAME``: what SLURM's job scripts run. Bad input is one sentence (exit 2)
before any work; SIGTERM (scancel, a time limit, a requeue) stops the running launch with everything it
started, keeps what was stored and exits 143. (A whole run through it: tests/test_multinode.py, whose
one-node half is this command, and tests/test_slurm.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from lab_utils.app.cli import main, parse_sets
from lab_utils.engine import proc, profiles
from lab_utils.experiments.n02_scaling import experiment as scaling

REPO = Path(__file__).resolve().parent.parent


def test_settings_are_python_literals_and_a_single_value_becomes_a_tuple():
    base = profiles.settings(scaling.Settings, "quick")
    got = parse_sets(scaling.Settings, base, ["batch_sizes=32,128", "devices=2", "epochs=1",
                                              "dataset='synthetic'", "label=a b", "bucket_cap_mb=None"])
    assert got == {"batch_sizes": (32, 128), "devices": (2,), "epochs": 1, "dataset": "synthetic",
                   "label": "a b", "bucket_cap_mb": None}


@pytest.mark.parametrize("argv, sentence", [
    (["measure", "nope"], "error: No experiment 'nope'; use one of: batch_sweep, scaling, compute_vs_comm"),
    (["measure", "scaling", "--set", "epochs"], "error: --set takes KEY=VALUE, got 'epochs'"),
    (["measure", "scaling", "--set", "device=2"], "error: Unknown scaling setting(s) ['device']; use: "),
    (["measure", "scaling", "--set", "epochs=0"], "error: epochs must be a whole number of at least 1"),
    (["measure", "scaling", "--profile", "quik"], "error: "),
    (["measure", "scaling", "--nodes", "2"], "error: --nodes needs --job DIR"),
])
def test_bad_input_is_one_sentence_before_any_work(argv, sentence, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS_DIR", str(tmp_path))
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err.startswith(sentence) and err.count("\n") == 1, err
    assert "measuring" not in out and not (tmp_path / "quick").exists()


@pytest.mark.timeout(120)
def test_a_sigterm_before_torch_has_loaded_is_one_line(tmp_path):
    """The handler is there from the command's first line, not once torch and the plan have loaded (seconds
    on a busy node, where SLURM's time-limit warning can come): the signal comes from the GPU-node guard,
    before torch is imported. Without the handler the process died from it, silently; and it is the
    caller's again afterwards."""
    code = ("import os, signal, sys\nfrom lab_utils.app import cli\n"
            "cli._gpu_node_guard = lambda profile: os.kill(os.getpid(), signal.SIGTERM)\n"
            "code = cli.main(['measure', 'scaling', '--profile', 'quick'])\n"
            "assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL\n"
            "assert 'torch' not in sys.modules\nsys.exit(code)\n")
    env = dict(os.environ, LAB_RESULTS_DIR=str(tmp_path / "results"))
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=100)
    assert res.returncode == 143, (res.returncode, res.stdout, res.stderr)
    assert res.stderr.strip().splitlines() == [
        "stopped by SIGTERM: the running launch and its processes were stopped; records already stored are "
        "kept (run again to resume)."]
    assert not (tmp_path / "results" / "quick" / "runs").exists() or \
        not any(p.read_text().strip() for p in (tmp_path / "results" / "quick" / "runs").glob("*.jsonl"))


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sigterm_stops_the_launch_and_leaves_nothing(tmp_path):
    """As SLURM's SIGTERM reaches the command (job.sh passes it on): the torchrun tree stops, its temporary
    folder goes, one line says so, exit 143; a run finished before it stays stored."""
    mark = uuid.uuid4().hex
    # torch makes its compile cache in $TMPDIR at import: kept apart, so that what the launch leaves shows
    env = proc.marked_env(mark, {**os.environ, "LAB_RESULTS_DIR": str(tmp_path / "results"),
                                 "TMPDIR": str(tmp_path / "tmp"),
                                 "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "tc")})
    (tmp_path / "tmp").mkdir()
    base = [sys.executable, "-m", "lab_utils", "measure", "scaling", "--profile", "quick",
            "--set", "batch_sizes=32", "--set", "width=4", "--set", "train_images=128"]
    first = subprocess.run([*base, "--set", "devices=1"], cwd=REPO, env=env, capture_output=True, text=True,
                           timeout=150)
    assert first.returncode == 0, first.stderr  # DDP 1 x 32 stored
    stored = (tmp_path / "results" / "quick" / "runs" / "scaling.jsonl").read_text().splitlines()
    # 500 epochs: the signal comes during the first launch, DDP on 2 ranks under torchrun
    child = subprocess.Popen([*base, "--set", "devices=2", "--set", "epochs=500"], cwd=REPO, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not list((tmp_path / "tmp").glob("lab_ddp_*/records.jsonl")) and \
                not list((tmp_path / "tmp").glob("lab_ddp_*/torchrun")):
            assert time.monotonic() < deadline and child.poll() is None, child.communicate(timeout=10)
            time.sleep(0.1)
        time.sleep(2)  # the ranks are training
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 143, (out, err)
    assert err.strip().splitlines() == [
        "stopped by SIGTERM: the running launch and its processes were stopped; records already stored are "
        "kept (run again to resume)."]
    assert proc.leftover(mark, wait_s=5) == []
    assert list((tmp_path / "tmp").iterdir()) == []
    after = (tmp_path / "results" / "quick" / "runs" / "scaling.jsonl").read_text().splitlines()
    assert after[:len(stored)] == stored
