"""The job scripts in ``slurm/``, submitted to a real (one-machine) SLURM cluster.

The ``cluster`` fixture (see ``tests/slurm_cluster.py``) installs Debian's slurm-wlm and
munge when missing, starts a private cluster and stops it afterwards. Where that is
impossible (not root, no apt-get, start-up failed), the tests that need it are skipped
with the reason; they never pass without having run.

Jobs run on CPU in the ``quick`` profile with synthetic data (``tests/conftest.py`` points
``LAB_DATA_DIR`` at an empty folder); each test gets its own results folder and submits
from its own job folder, where the ``slurm-<name>-<jobid>.out/.err`` files land.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, SlurmUnavailable, apt_install, start_cluster  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
JOB_TIMEOUT_S = 240

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> SlurmCluster:
    try:
        c = start_cluster(tmp_path_factory.mktemp("slurm") / "cluster")
    except SlurmUnavailable as e:
        pytest.skip(f"SLURM cannot be started here: {e}")
    yield c
    c.stop()


@pytest.fixture
def job_env(tmp_path, cluster) -> tuple[Path, dict[str, str]]:
    """A folder to submit from, and the environment for the job (own results folder)."""
    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    env = cluster.env
    env.update(LAB_DIR=str(REPO), LAB_RESULTS_DIR=str(tmp_path / "results"), LAB_PROFILE="quick")
    return job_dir, env


def submit(cluster: SlurmCluster, script: str, *args: str, env: dict[str, str], cwd: Path,
           wait: bool = True, timeout: float = JOB_TIMEOUT_S) -> tuple[str, subprocess.CompletedProcess]:
    """``sbatch [--wait] OPTIONS slurm/SCRIPT SCRIPT_ARGS`` (``args`` = OPTIONS [``--`` SCRIPT_ARGS]).

    Returns the job id and sbatch's result (with ``--wait``, its exit code is the job's).
    """
    split = args.index("--") if "--" in args else len(args)
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), *args[:split],
           str(REPO / "slurm" / script), *args[split + 1:]]
    try:
        res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        cluster.run("scancel", "--user", str(os.getuid()), check=False)
        pytest.fail(f"{script} did not finish in {timeout} s; job outputs: {_outputs(cwd)}")
    job_id = res.stdout.strip().split(";")[0].splitlines()[0] if res.stdout.strip() else ""
    if not job_id:
        pytest.fail(f"sbatch {script} failed ({res.returncode}): {res.stderr}")
    return job_id, res


def _outputs(cwd: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(cwd.glob("*")))


def job_files(cwd: Path, name: str, job_id: str) -> tuple[str, str]:
    """The job's stdout and stderr, from the files named by job id in the submit folder."""
    out, err = cwd / f"slurm-{name}-{job_id}.out", cwd / f"slurm-{name}-{job_id}.err"
    assert out.exists() and err.exists(), f"no output files named by job id {job_id}: {sorted(cwd.iterdir())}"
    return out.read_text(errors="replace"), err.read_text(errors="replace")


# ----------------------------------------------------------------- static checks (no cluster)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_syntax(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_shellcheck_clean():
    try:
        apt_install(("shellcheck",), ("shellcheck",))
    except SlurmUnavailable as e:
        pytest.skip(f"shellcheck cannot be installed: {e}")
    assert SCRIPTS, "no slurm/*.sbatch scripts"
    res = subprocess.run(["shellcheck", "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scripts_take_account_partition_time_from_the_command_line():
    """No script fixes an account or partition; each sets a time limit sbatch can override."""
    for script in SCRIPTS:
        text = script.read_text()
        assert not re.search(r"^#SBATCH\s+(-A|--account|-p|--partition)", text, re.M), script.name
        assert re.search(r"^#SBATCH --time=", text, re.M), script.name
        assert re.search(r"^#SBATCH --output=\S*%j", text, re.M), script.name
        assert re.search(r"^#SBATCH --error=\S*%j", text, re.M), script.name


# ----------------------------------------------------------------- jobs on the cluster


def test_cluster_runs_a_job(cluster, tmp_path):
    """The fixture's cluster itself: a one-line job on each partition."""
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/bash\nsrun hostname\n")
    for extra in ([], ["--partition=multi", "--nodes=2", "--ntasks-per-node=1"]):
        res = cluster.run("sbatch", "--wait", "--parsable", f"--output={tmp_path}/%j.out", *extra,
                          str(script), timeout=60)
        job_id = res.stdout.strip()
        lines = (tmp_path / f"{job_id}.out").read_text().split()
        assert len(lines) == (2 if extra else 1) and cluster.job_state(job_id) == "COMPLETED"


def test_jupyter_prints_tunnel_and_serves(cluster, job_env):
    job_dir, env = job_env
    job_id, _ = submit(cluster, "jupyter.sbatch", "--gpus-per-node=0", "--cpus-per-task=1",
                       env=env, cwd=job_dir, wait=False)
    out_file = job_dir / f"slurm-lab-jupyter-{job_id}.out"
    err_file = job_dir / f"slurm-lab-jupyter-{job_id}.err"
    try:
        deadline = time.monotonic() + 120
        url = None
        while time.monotonic() < deadline and url is None:
            text = out_file.read_text() if out_file.exists() else ""
            m_ssh = re.search(r"ssh -N -L (\d+):(\S+):(\d+) \S+@\S+", text)
            m_url = re.search(r"http://localhost:(\d+)/lab\S*\?token=([0-9a-f]+)", text)
            if m_ssh and m_url:
                port, host = m_ssh.group(1), m_ssh.group(2)
                assert m_ssh.group(3) == port == m_url.group(1)
                # What the tunnel does: connect to the node, with the browser's Host header.
                url = urllib.request.Request(f"http://{host}:{port}/api/status?token={m_url.group(2)}",
                                             headers={"Host": f"localhost:{port}"})
            else:
                assert cluster.job_state(job_id) in ("PENDING", "RUNNING", "CONFIGURING"), \
                    _outputs(job_dir)
                time.sleep(0.5)
        assert url, f"no ssh/URL lines in time:\n{_outputs(job_dir)}"
        assert os.stat(out_file).st_mode & 0o077 == 0, "the file showing the token is readable by others"
        status = None
        while time.monotonic() < deadline:  # the server starts after the lines are printed
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    status = json.load(r)
                break
            except OSError:
                assert cluster.job_state(job_id) == "RUNNING", _outputs(job_dir)
                time.sleep(0.5)
        assert status is not None and "started" in status, f"JupyterLab did not answer:\n{_outputs(job_dir)}"
        assert "JupyterLab" in err_file.read_text() or "Jupyter" in err_file.read_text()
    finally:
        cluster.run("scancel", job_id, check=False)
    deadline = time.monotonic() + 30
    ended = ("CANCELLED", "COMPLETED", "FAILED")
    while cluster.job_state(job_id) not in ended and time.monotonic() < deadline:
        time.sleep(0.5)
    assert cluster.job_state(job_id) == "CANCELLED"
    time.sleep(1)
    with pytest.raises(OSError):  # the server went away with the job
        urllib.request.urlopen(url, timeout=5)


def test_run_all_executes_a_notebook_and_leaves_the_report(cluster, job_env):
    job_dir, env = job_env
    env["PROFILE"] = "quick"
    job_id, res = submit(cluster, "run_all.sbatch", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}",
                         "--", "labs/00_environment.ipynb", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-run-all", job_id)
    assert res.returncode == 0 and cluster.job_state(job_id) == "COMPLETED", out + err
    results = Path(env["LAB_RESULTS_DIR"]) / "quick"
    assert (results / "executed" / "00_environment.ipynb").is_file()
    report = (results / "report.md").read_text()
    assert "| 00_environment.ipynb | ok |" in report
    assert f"report:    {results / 'report.md'}" in out
    job_txt = (Path(env["LAB_RESULTS_DIR"]) / "jobs" / job_id / "job.txt").read_text()
    assert "exit code 0" in job_txt


def test_run_all_fails_clearly_outside_the_lab(cluster, job_env, tmp_path):
    job_dir, env = job_env
    env["LAB_DIR"] = str(tmp_path)
    job_id, res = submit(cluster, "run_all.sbatch", "--gpus-per-node=0", "--cpus-per-task=1",
                         env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-run-all", job_id)
    assert res.returncode != 0 and cluster.job_state(job_id) == "FAILED"
    assert "is not the lab's folder" in err
