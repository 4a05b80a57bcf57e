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
import socket
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

# Tests that submit jobs are marked slurm and slow; the static checks are neither.


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
    env.update(LAB_DIR=str(REPO), LAB_RESULTS_DIR=str(tmp_path / "results"), LAB_PROFILE="quick",
               JUPYTER_RUNTIME_DIR=str(tmp_path / "jupyter_runtime"))
    return job_dir, env


def submit(cluster: SlurmCluster, script: str, *args: str, env: dict[str, str], cwd: Path,
           wait: bool = True, timeout: float = JOB_TIMEOUT_S) -> tuple[str, int | None]:
    """``sbatch OPTIONS slurm/SCRIPT SCRIPT_ARGS`` (``args`` = OPTIONS [``--`` SCRIPT_ARGS]).

    Returns the job id and, with ``wait``, the job's exit code once it has ended (the
    test fails if it does not end within ``timeout``).
    """
    split = args.index("--") if "--" in args else len(args)
    cmd = ["sbatch", "--parsable", *args[:split], str(REPO / "slurm" / script), *args[split + 1:]]
    res = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=60)
    job_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job_id.isdigit():
        pytest.fail(f"sbatch {script} failed ({res.returncode}): {res.stderr}")
    if not wait:
        return job_id, None
    ended = cluster.wait_job(job_id, timeout)
    if ended is None:
        cluster.run("scancel", job_id, check=False)
        pytest.fail(f"{script} (job {job_id}) did not finish in {timeout} s; outputs:\n{_outputs(cwd)}")
    return job_id, ended[1]


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
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_shellcheck_clean():
    try:
        apt_install(("shellcheck",), ("shellcheck",))
    except SlurmUnavailable as e:
        pytest.skip(f"shellcheck cannot be installed: {e}")
    assert SCRIPTS, "no slurm/*.sbatch scripts"
    res = subprocess.run(["shellcheck", "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_scripts_take_account_partition_time_from_the_command_line():
    """No script fixes an account or partition; each sets a time limit sbatch can override."""
    for script in SCRIPTS:
        text = script.read_text()
        assert not re.search(r"^#SBATCH\s+(-A|--account|-p|--partition)", text, re.M), script.name
        assert re.search(r"^#SBATCH --time=", text, re.M), script.name
        assert re.search(r"^#SBATCH --output=\S*%j", text, re.M), script.name
        assert re.search(r"^#SBATCH --error=\S*%j", text, re.M), script.name


def test_every_srun_step_is_given_the_jobs_cpus():
    """Slurm 22.05-23.02 do not hand SLURM_CPUS_PER_TASK on to srun, so a step started without
    --cpus-per-task may be confined to one core (all ranks and their loader workers on it)."""
    started = 0
    for script in SCRIPTS:
        lines = [line for line in script.read_text().splitlines() if not line.lstrip().startswith("#")]
        for i, line in enumerate(lines):
            if not re.search(r"(^|[\s(])srun\s", line):
                continue
            started += 1
            command = line
            while command.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                command += lines[i]
            assert re.search(r"--cpus-per-task=\S+", command), f"{script.name}: {line.strip()}"
    assert started >= 2  # experiment.sbatch and multinode.sbatch


def test_unavailable_slurm_gives_a_reason(monkeypatch, tmp_path):
    """Not root: start_cluster raises SlurmUnavailable saying why (the fixture skips with it)."""
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match="not root"):
        start_cluster(tmp_path / "c")
    monkeypatch.setattr(slurm_cluster, "_missing", lambda commands: list(commands))
    with pytest.raises(SlurmUnavailable, match="not installed and not root"):
        apt_install(("slurm-wlm",), ("sbatch",))
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster.shutil, "which", lambda name: None)
    with pytest.raises(SlurmUnavailable, match="no apt-get"):
        apt_install(("slurm-wlm",), ("sbatch",))


def test_conf_describes_this_machine(tmp_path):
    from slurm_cluster import write_conf

    conf = write_conf(tmp_path, "host1", 2, 24105).read_text()
    assert "NodeName=host1 NodeAddr=127.0.0.1" in conf and "CPUs=2 RealMemory=21694" in conf
    assert "TaskPlugin=task/affinity" in conf  # steps are bound to their CPUs, as on real clusters
    assert "Gres" not in conf and "PartitionName=lab Nodes=host1 Default=YES" in conf
    assert f"AuthInfo=socket={tmp_path}/munge.socket" in conf


def test_job_plan_skips_what_is_stored_and_stops_at_an_oom(results_dir):
    """The plan: notebook 02's worker options; stored sizes skipped; after an OOM row, nothing larger."""
    def plan(mode: str, sizes: str, *extra: str) -> list[str]:
        res = subprocess.run([sys.executable, "-m", "lab_utils.job_plan", mode, "scaling", "quick", "2",
                              "gloo", sizes, "0",
                              "", "--", *extra], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()

    lines = plan("plan", "")
    assert lines[0] == "32 128 512" and lines[1] == "-" and lines[-1] == "end"
    argv = lines[2:-1]
    assert "--batch-size" not in argv  # given per launch
    assert argv[argv.index("--width") + 1] == "8" and argv[argv.index("--bucket-cap-mb") + 1] == "0.4"
    assert plan("plan", "128,32")[0] == "32 128"  # smallest first, whatever the order given
    plan("oom", "128")  # as the job does when the launch for 128 ran out of memory
    lines = plan("plan", "32,128,512,1024")
    assert lines[0] == "32"
    assert lines[1] == "128: in the store (oom)"  # 512 and larger not tried after an OOM
    lines = plan("plan", "32,1024")
    assert lines[0] == "32" and "1024: global batch 2048 > 1024 training images" in lines[1]
    assert plan("plan", "32", "--epochs", "1")[2:-1][-2:] == ["--epochs", "1"]  # worker options last


# ----------------------------------------------------------------- jobs on the cluster


@pytest.mark.slurm
@pytest.mark.slow
def test_cluster_runs_a_job(cluster, tmp_path):
    """The fixture's cluster itself: a one-line job on each partition."""
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/bash\nsrun hostname\n")
    for extra in ([], ["--partition=multi", "--nodes=2", "--ntasks-per-node=1"]):
        res = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%j.out", *extra, str(script))
        job_id = res.stdout.strip()
        assert cluster.wait_job(job_id, 60) == ("COMPLETED", 0)
        lines = (tmp_path / f"{job_id}.out").read_text().split()
        assert len(lines) == (2 if extra else 1) and cluster.job_state(job_id) == "COMPLETED"


@pytest.mark.slurm
@pytest.mark.slow
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
                try:
                    addr = socket.gethostbyname(host)
                except OSError:  # a node name this machine cannot resolve: JupyterLab listens everywhere
                    addr = "127.0.0.1"
                url = urllib.request.Request(f"http://{addr}:{port}/api/status?token={m_url.group(2)}",
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


@pytest.mark.slurm
@pytest.mark.slow
def test_run_all_executes_a_notebook_and_leaves_the_report(cluster, job_env):
    job_dir, env = job_env
    env["PROFILE"] = "quick"
    job_id, code = submit(cluster, "run_all.sbatch", "--gpus-per-node=0", f"--cpus-per-task={cluster.cpus}",
                         "--", "labs/00_environment.ipynb", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-run-all", job_id)
    assert code == 0 and cluster.job_state(job_id) == "COMPLETED", out + err
    results = Path(env["LAB_RESULTS_DIR"]) / "quick"
    assert (results / "executed" / "00_environment.ipynb").is_file()
    report = (results / "report.md").read_text()
    assert "| 00_environment.ipynb | ok |" in report
    assert f"report:    {results / 'report.md'}" in out
    assert f"({cluster.cpus} cores usable)" in report  # notebook 00 ran on the CPUs the job asked for
    job_txt = (Path(env["LAB_RESULTS_DIR"]) / "jobs" / job_id / "job.txt").read_text()
    assert "exit code 0" in job_txt


@pytest.mark.slurm
@pytest.mark.slow
def test_run_all_fails_clearly_outside_the_lab(cluster, job_env, tmp_path):
    job_dir, env = job_env
    env["LAB_DIR"] = str(tmp_path)
    job_id, code = submit(cluster, "run_all.sbatch", "--gpus-per-node=0", "--cpus-per-task=1",
                         env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-run-all", job_id)
    assert code != 0 and cluster.job_state(job_id) == "FAILED"
    assert "is not the lab's folder" in err


# ----------------------------------------------------------------- DDP jobs (CPU, gloo)

# A tiny run (narrow ResNet-18, 96 synthetic images, evaluation) for the jobs that only
# check the plumbing; the 2-process job below runs notebook 02's own quick settings.
WORKER_ARGS = ["--width", "8", "--train-images", "96", "--test-images", "40", "--eval", "--seed", "3"]
EXPERIMENT = "scaling"


def aggregates(results: Path) -> list[dict]:
    """The aggregate records of the DDP experiment in a results folder, in order."""
    path = results / "quick" / "runs" / f"{EXPERIMENT}.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in recs if r["config"]["record"] == "aggregate"]


@pytest.fixture(scope="module")
def two_process_job(cluster, tmp_path_factory):
    """experiment.sbatch with GPUS=2 (environment) on CPU: notebook 02's quick settings, batch 32."""
    tmp = tmp_path_factory.mktemp("exp2")
    job_dir = tmp / "jobs"
    job_dir.mkdir()
    env = cluster.env
    env.update(LAB_DIR=str(REPO), LAB_RESULTS_DIR=str(tmp / "results"), LAB_PROFILE="quick", GPUS="2")
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=2", "--",
                          "--batch-sizes", "32", env=env, cwd=job_dir)
    return {"job_id": job_id, "code": code, "job_dir": job_dir, "env": env, "results": tmp / "results"}


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_with_gpus_from_the_environment(cluster, two_process_job):
    job = two_process_job
    out, err = job_files(job["job_dir"], "lab-ddp", job["job_id"])
    assert job["code"] == 0 and cluster.job_state(job["job_id"]) == "COMPLETED", out + err
    assert "2 x gloo" in out and "to measure now (per-GPU batch): 32" in out
    [agg] = aggregates(job["results"])
    cfg, m = agg["config"], agg["metrics"]
    assert (cfg["devices"], cfg["batch_size"], cfg["global_batch"], cfg["epochs"]) == (2, 32, 64, 2)
    assert (agg["status"], agg["profile"], agg["synthetic"], m["backend"]) == ("ok", "quick", True, "gloo")
    assert m["world_size"] == 2 and len(m["epochs"]) == 2 and m["train_seconds"] > 0
    assert m["threads_per_rank"] == 1  # the job's 2 CPUs shared by its 2 processes
    per_job = job["results"] / "jobs" / job["job_id"]
    lines = (per_job / "records-batch32.jsonl").read_text().splitlines()
    assert len(lines) == 3  # aggregate + 2 ranks, one JSON line each
    assert json.loads((per_job / "machine.json").read_text())["profile"] == "quick"  # `lab_utils info`
    assert "exit code 0" in (per_job / "job.txt").read_text()


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_experiment_step_gets_the_cpus_the_job_asked_for(two_process_job):
    """Inside the srun step, every rank's os.sched_getaffinity(0) (its record's hardware.cpu_cores)
    holds the 2 CPUs the job asked for (--cpus-per-task=2): the step is not confined to one core.

    The fixture's cluster binds steps with TaskPlugin=task/affinity, so a step given fewer CPUs
    than its job would show here.
    """
    job = two_process_job
    assert job["code"] == 0
    path = job["results"] / "jobs" / job["job_id"] / "records-batch32.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3
    assert {r["hardware"]["cpu_cores"] for r in records} == {2}, [r["hardware"] for r in records]


@pytest.mark.slurm
@pytest.mark.slow
def test_notebook_02_reuses_the_jobs_records(two_process_job, monkeypatch):
    """The job ran exactly what notebook 02 would: scaling.measure finds it stored, measures nothing."""
    from lab_utils.experiments import scaling
    from lab_utils.session import start

    monkeypatch.setenv("LAB_RESULTS_DIR", str(two_process_job["results"]))
    lab = start("quick")
    stored = len(lab.store.records("scaling"))
    settings = lab.settings(scaling.Settings, batch_sizes=(32,), devices=(2,))
    records = [r for r in scaling.measure(lab, settings) if r.config["method"] == scaling.DDP]
    assert [r.status for r in records] == ["ok"] and len(lab.store.records("scaling")) == stored


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_resubmitted_measures_only_what_is_missing(cluster, two_process_job):
    """After a time limit, the same job submitted again continues: stored sizes are skipped."""
    job = two_process_job
    env = dict(job["env"])
    del env["GPUS"]  # this time from the script's --gpus argument
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=2", "--",
                          "--gpus", "2", "--batch-sizes", "32,512", env=env, cwd=job["job_dir"])
    out, err = job_files(job["job_dir"], "lab-ddp", job_id)
    assert code == 0, out + err
    assert "to measure now (per-GPU batch): 512" in out and "32: in the store (ok)" in out
    assert [r["config"]["batch_size"] for r in aggregates(job["results"])] == [32, 512]


@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_on_one_and_four_processes(cluster, job_env, gpus):
    job_dir, env = job_env
    cpus = min(gpus, cluster.cpus)  # one thread per process, as notebook 02 runs gloo
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0",
                          f"--cpus-per-task={cpus}", "--", "--gpus", str(gpus), "--batch-sizes", "8",
                          "--epochs", "1", "--", *WORKER_ARGS, env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code == 0, out + err
    [agg] = aggregates(Path(env["LAB_RESULTS_DIR"]))
    assert (agg["config"]["devices"], agg["config"]["global_batch"]) == (gpus, 8 * gpus)
    assert agg["config"]["width"] == 8 and agg["metrics"]["epochs"][0]["test_images"] == 40


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_experiment_job_stops_on_a_gpu_node_its_torch_cannot_use(cluster, job_env, tmp_path):
    """A fake nvidia-smi (driver 535, two A100s) on the job's PATH and this CPU machine's torch:
    the full-profile job stops before any launch with the one sentence, instead of running on the CPU."""
    import torch
    from test_gpu_node import fake_nvidia_smi

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    job_dir, env = job_env
    env["PATH"] = f"{fake_nvidia_smi(tmp_path / 'bin')}{os.pathsep}{env['PATH']}"
    env["LAB_PROFILE"] = "full"
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=1", "--",
                          "--gpus", "1", "--batch-sizes", "8", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code != 0 and cluster.job_state(job_id) == "FAILED"
    assert "error: This node's NVIDIA driver 535.183.01 reports 2 GPUs" in err
    assert "TORCH_VARIANT=cu126" in err
    assert "to measure now" not in out  # stopped before the plan and any launch


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_rejects_bad_input_before_work(cluster, job_env):
    job_dir, env = job_env
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=1", "--",
                          "--gpus", "two", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code != 0 and "--gpus (GPUS) must be a positive whole number" in err
    assert "make" not in out  # failed before the set-up


@pytest.mark.slurm
@pytest.mark.slow
def test_multinode_job_matches_two_processes_on_one_node(cluster, two_process_job, tmp_path):
    """Two SLURM nodes x 1 process (c10d rendezvous on the first node) = 1 node x 2 processes."""
    job_dir = tmp_path / "jobs"
    job_dir.mkdir()
    env = dict(two_process_job["env"], LAB_RESULTS_DIR=str(tmp_path / "results"))
    del env["GPUS"]
    job_id, code = submit(cluster, "multinode.sbatch", "--partition=multi", "--nodes=2", "--gpus-per-node=0",
                          "--cpus-per-task=1", "--", "--batch-sizes", "32", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-multinode", job_id)
    assert code == 0 and cluster.job_state(job_id) == "COMPLETED", out + err
    assert "2 nodes (labn[1-2]) x 1 gloo processes = 2" in out
    assert re.search(r"rendezvous: c10d at 127\.0\.0\.1:\d+ \(first node labn1\)", out)
    [multi] = aggregates(tmp_path / "results")
    single = next(r for r in aggregates(two_process_job["results"]) if r["config"]["batch_size"] == 32)
    assert multi["config"]["tag"] == "nodes=2"
    assert multi["hardware"]["cpu_cores"] == 1  # each node's step: the 1 CPU per task the job asked for
    assert {**multi["config"], "tag": ""} == single["config"]
    for a, b in zip(multi["metrics"]["epochs"], single["metrics"]["epochs"], strict=True):
        for k in ("train_loss", "train_accuracy", "images", "steps"):
            assert a[k] == pytest.approx(b[k], rel=1e-6), k
