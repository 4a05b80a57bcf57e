"""The job scripts in ``slurm/``, submitted to a real (one-machine) SLURM cluster.

The ``cluster`` fixture (see ``tests/slurm_cluster.py``) installs Debian's slurm-wlm and
munge when missing, starts a private cluster and stops it afterwards. Where that is
impossible (not root, no apt-get, start-up failed), the tests that need it are skipped
with the reason; they never pass without having run.

Jobs run on CPU in the ``quick`` profile with synthetic data (``tests/conftest.py`` points
``LAB_DATA_DIR`` at an empty folder); each test gets its own results folder and submits
from its own job folder, where the ``slurm-<name>-<jobid>.out/.err`` files land.

The cluster tracks jobs with ``proctrack/cgroup`` and ``task/cgroup`` where this machine allows it
(as most clusters do: a stop signals every process of the job at once), else with
``proctrack/linuxproc``; ``test_cluster_tracks_jobs_with_cgroups`` is skipped with the reason in the
second case. Its two-node partition is two ``slurmd`` in network namespaces of their own, at two
addresses; where they cannot be made, the two-node tests are skipped with the reason.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from datetime import datetime
from pathlib import Path

import nbformat
import pytest

from lab_utils.engine import proc as marks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from slurm_cluster import SlurmCluster, SlurmUnavailable, apt_install, start_cluster  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((REPO / "slurm").glob("*.sbatch"))
SHELL_FILES = [*SCRIPTS, REPO / "slurm" / "job.sh", REPO / "slurm" / "agent.sh"]  # sourced, run by srun
JOB_TIMEOUT_S = 240

# Tests that submit jobs are marked slurm and slow; the static checks are neither.


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> SlurmCluster:
    """One cluster for the whole session (starting one takes seconds, installing it minutes)."""
    try:
        c = start_cluster(tmp_path_factory.mktemp("slurm") / "cluster")
    except SlurmUnavailable as e:
        pytest.skip(f"SLURM cannot be started here: {e}")
    two = (f"two nodes at {', '.join(f'{n} {a}' for n, a in c.network.addrs.items())}"
           if c.network and not c.multi_why else f"no two nodes: {c.multi_why}")
    print(f"SLURM test cluster: proctrack/{c.proctrack} ({c.proctrack_why}); {two}")
    yield c
    c.stop()


def needs_two_nodes(cluster: SlurmCluster) -> None:
    """Skip, saying why, where the cluster has no two nodes of their own (network namespaces)."""
    if cluster.network is None or cluster.multi_why:
        pytest.skip(f"the test cluster has no two nodes at two addresses here: {cluster.multi_why}")


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


@pytest.mark.parametrize("script", SHELL_FILES, ids=lambda p: p.name)
def test_bash_syntax(script):
    res = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_shellcheck_clean():
    try:
        apt_install(("shellcheck",), ("shellcheck",))
    except SlurmUnavailable as e:
        pytest.skip(f"shellcheck cannot be installed: {e}")
    assert SCRIPTS, "no slurm/*.sbatch scripts"
    res = subprocess.run(["shellcheck", "-x", "--shell=bash", *map(str, SHELL_FILES)], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
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


def test_every_script_keeps_its_output_and_passes_sigterm_on():
    """A requeued job runs again under the same id: its output files are appended to, not replaced.
    And SLURM's SIGTERM must reach the job's program: jupyter.sbatch execs JupyterLab, the others
    run their program through job.sh's run_forwarding (background, trap, wait)."""
    for script in SCRIPTS:
        text = script.read_text()
        assert re.search(r"^#SBATCH --open-mode=append$", text, re.M), script.name
        assert not re.search(r"\| tee \"[^\n]*\.txt\"", text), script.name  # tee -a: job.txt, jupyter.txt
        if script.name == "jupyter.sbatch":
            assert re.search(r'^exec "\$PY" -m jupyterlab', text, re.M)
        else:
            for needed in ("source slurm/job.sh", "job_start ", "run_forwarding "):
                assert needed in text, (script.name, needed)
    # the runner needs seconds to save the copy and the report, multinode.sbatch to store what its
    # launch finished: the time limit warns them first
    for name in ("run_all.sbatch", "multinode.sbatch"):
        assert re.search(r"^#SBATCH --signal=B:TERM@\d+$", (REPO / "slurm" / name).read_text(), re.M), name


@pytest.fixture
def local_job():
    """Start a bash script that sources slurm/job.sh and runs a body, outside SLURM (job id local):
    ``local_job(folder, body) -> (process, job.txt)``. Whatever is left of it is killed afterwards."""
    started: list[subprocess.Popen] = []

    def start(folder: Path, body: str) -> tuple[subprocess.Popen, Path]:
        script = folder / "job.bash"
        script.write_text(f"set -euo pipefail\nJOB_ID=local\ncd {REPO}\nsource slurm/job.sh\n"
                          f"job_start {folder / 'job'}\n{body}\n")
        proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        started.append(proc)
        return proc, folder / "job" / "job.txt"

    yield start
    for proc in started:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


# A program that takes its time to stop after SIGTERM (as the runner saves its copy and report),
# writes that it did, and exits 143.
SLOW_STOPPER = ("import pathlib, signal, sys, time\n"
                "def stop(*_):\n"
                "    time.sleep(1.5)\n"
                "    pathlib.Path(sys.argv[1]).write_text('saved')\n"
                "    sys.exit(143)\n"
                "signal.signal(signal.SIGTERM, stop)\n"
                "pathlib.Path(sys.argv[1] + '.started').write_text('')\n"
                "time.sleep(60)\n")


@pytest.mark.timeout(60)
def test_job_sh_passes_sigterm_on_and_waits_for_the_program(tmp_path, local_job):
    """SIGTERM to the batch shell (a time limit's --signal=B:TERM, or SLURM's stop): the program
    gets it, the shell waits until it has finished saving, and job.txt gets its exit code."""
    (tmp_path / "stopper.py").write_text(SLOW_STOPPER)
    saved = tmp_path / "saved"
    body = (f'run_forwarding {sys.executable} {tmp_path / "stopper.py"} {saved}\n'
            'echo "after the program: $status"\nexit "$status"')
    proc, job_txt = local_job(tmp_path, body)
    deadline = time.monotonic() + 30
    while not Path(f"{saved}.started").exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143, (out, err)
    assert saved.read_text() == "saved"  # the shell waited for the program's own clean-up
    lines = job_txt.read_text().splitlines()
    assert re.fullmatch(r"SIGTERM received \S+: passed on to process \d+; waiting for it to stop", lines[0])
    assert re.fullmatch(r"finished \S+ with exit code 143", lines[1]) and len(lines) == 2, lines
    assert "after the program: 143" in out


@pytest.mark.timeout(60)
def test_job_sh_run_forwarding_log_shows_the_output_live_and_keeps_it(tmp_path, local_job):
    """--log FILE: the program's output goes to FILE and into the job's output (tail), for a
    program that ends at once too (tail must find the file there when it starts)."""
    body = "\n".join(f'run_forwarding --log {tmp_path}/launch{i}.log sh -c "echo line {i}; exit {i}"\n'
                      f'echo "status $status"' for i in range(4))
    proc, _ = local_job(tmp_path, body)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and "cannot open" not in err, err
    for i in range(4):
        assert (tmp_path / f"launch{i}.log").read_text() == f"line {i}\n"
        assert f"line {i}\nstatus {i}\n" in out, out


@pytest.mark.timeout(60)
def test_job_sh_records_the_exit_code_however_the_script_ends(tmp_path, monkeypatch, local_job):
    """A failing command (set -e), a SIGTERM before the program starts, a restart (requeue)."""
    (tmp_path / "a").mkdir()
    proc, job_txt = local_job(tmp_path / "a", "false")
    proc.communicate(timeout=30)
    assert proc.returncode == 1 and job_txt.read_text().splitlines()[-1].endswith("with exit code 1")
    (tmp_path / "b").mkdir()
    proc, job_txt = local_job(tmp_path / "b", f"touch {tmp_path / 'b' / 'ready'}; sleep 30; echo never")
    deadline = time.monotonic() + 30
    while not (tmp_path / "b" / "ready").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # bash runs the trap once `sleep` (in the foreground) ends
    subprocess.run(["pkill", "-TERM", "-P", str(proc.pid), "-x", "sleep"], timeout=10)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 143 and "never" not in out
    # one line, as the lab's commands give (before it, bash's "Terminated" for the `sleep` pkill ended)
    assert [ln for ln in err.splitlines() if ln.strip() and ln != "Terminated"] == [JOB_LINE], err
    said = job_txt.read_text().splitlines()
    assert re.fullmatch(r"SIGTERM received \S+: no command of the lab running; the job stops", said[-2]), said
    assert said[-1].endswith("with exit code 143")
    (tmp_path / "c").mkdir()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    proc, job_txt = local_job(tmp_path / "c", "true")
    proc.communicate(timeout=30)
    lines = job_txt.read_text().splitlines()
    assert lines[0].startswith("=== restart 2 of job local (") and lines[-1].endswith("with exit code 0")


def test_run_all_reads_lab_profile_like_every_entry_point(tmp_path):
    """LAB_PROFILE chooses the profile; PROFILE (older instructions) is the same and wins.
    A bad value fails at once with one sentence (outside SLURM, before any set-up)."""
    def run(**env) -> subprocess.CompletedProcess:
        base = {k: v for k, v in os.environ.items() if k not in ("PROFILE", "LAB_PROFILE")}
        env = {**base, **env, "LAB_DIR": str(REPO), "LAB_RESULTS_DIR": str(tmp_path)}
        return subprocess.run(["bash", str(REPO / "slurm" / "run_all.sbatch")], capture_output=True,
                              text=True, timeout=60, env=env)

    res = run(LAB_PROFILE="quik")
    assert res.returncode == 2 and res.stderr.strip() == (
        "error: LAB_PROFILE (or PROFILE) must be quick or full, got 'quik'.")
    res = run(LAB_PROFILE="quick", PROFILE="fast")
    assert res.returncode == 2 and "got 'fast'" in res.stderr
    assert not (tmp_path / "jobs").exists()  # nothing started


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
    from slurm_cluster import NodeNetwork, write_conf

    conf = write_conf(tmp_path, "host1", 2, 24105).read_text()
    assert "NodeName=host1 NodeAddr=127.0.0.1" in conf and "CPUs=2 RealMemory=21694" in conf
    assert "TaskPlugin=task/affinity" in conf  # steps are bound to their CPUs, as on real clusters
    assert "Gres" not in conf and "PartitionName=lab Nodes=host1 Default=YES" in conf
    assert f"AuthInfo=socket={tmp_path}/munge.socket" in conf
    assert "ProctrackType=proctrack/linuxproc" in conf and "KillWait=30" in conf
    assert "SlurmctldHost=host1(127.0.0.1)" in conf and "multi" not in conf  # no two nodes: no partition
    net = NodeNetwork(tag="lt1", subnet="10.231.7", hostname="host1", hosts=tmp_path / "hosts")
    conf = write_conf(tmp_path, "host1", 2, 24105, "cgroup", net).read_text()
    assert "ProctrackType=proctrack/cgroup" in conf and "TaskPlugin=task/cgroup,task/affinity" in conf
    assert "SlurmctldHost=host1(10.231.7.1)" in conf  # where the nodes' namespaces reach slurmctld
    assert re.search(r"^NodeName=labn1 NodeAddr=10\.231\.7\.2 Port=\d+ CPUs=2 ", conf, re.M)
    assert re.search(r"^NodeName=labn2 NodeAddr=10\.231\.7\.3 Port=\d+ CPUs=2 ", conf, re.M)
    assert "PartitionName=multi Nodes=labn1,labn2" in conf
    assert net.command("labn1", ["slurmd"])[:2] == ["nsenter", "--net=/run/netns/lt1-labn1"]


V1_MOUNTS = """tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/freezer cgroup rw,relatime,freezer 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_cgroup_plugin_is_chosen_from_the_mounts(monkeypatch, tmp_path):
    """cgroup v2 at /sys/fs/cgroup: cgroup/v2 (if writable); a v1 freezer where a cgroup can be made:
    cgroup/v1; otherwise None, with the reason the tests print."""
    from slurm_cluster import cgroup_plugin, write_cgroup_conf

    monkeypatch.setattr("os.access", lambda path, mode: True)
    assert cgroup_plugin("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n") == (
        "cgroup/v2", "cgroup v2 at /sys/fs/cgroup")
    monkeypatch.setattr("os.access", lambda path, mode: False)
    assert cgroup_plugin("cgroup2 /sys/fs/cgroup cgroup2 ro 0 0\n")[0] is None
    no_freezer = V1_MOUNTS.replace("freezer", "memory")
    assert cgroup_plugin(no_freezer) == (None, "no cgroup v1 freezer hierarchy and no cgroup v2 at "
                                               "/sys/fs/cgroup")
    made: list[Path] = []
    monkeypatch.setattr(Path, "mkdir", lambda self, *a, **k: made.append(self))
    monkeypatch.setattr(Path, "rmdir", lambda self: None)
    assert cgroup_plugin(V1_MOUNTS) == ("cgroup/v1", "cgroup v1 (freezer at /sys/fs/cgroup/freezer)")
    assert made and made[0].parent == Path("/sys/fs/cgroup/freezer")

    def refused(self, *a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(Path, "mkdir", refused)
    assert cgroup_plugin(V1_MOUNTS) == (None, "cannot create a cgroup under /sys/fs/cgroup/freezer: "
                                              "Permission denied")
    monkeypatch.undo()
    text = write_cgroup_conf(tmp_path, "cgroup/v2").read_text()
    assert "CgroupPlugin=cgroup/v2" in text and "IgnoreSystemd=yes" in text and "ConstrainCores=yes" in text


def test_cluster_falls_back_to_linuxproc_and_says_why(monkeypatch, tmp_path):
    """A cgroup cluster whose probe job is not in a cgroup of its own is stopped, and a linuxproc
    one started instead; its proctrack_why is what the tests print."""
    import slurm_cluster

    started: list[str | None] = []

    class Fake:
        def __init__(self, cgroup):
            self.cgroup, self.proctrack, self.proctrack_why, self.stopped = cgroup, "linuxproc", "", False

        def check_cgroup_tracking(self):
            raise SlurmUnavailable("the probe job 1 is not in a cgroup of its own: '0::/'")

        def stop(self, keep_network=False):
            self.stopped = True

    def fake_start(root, cgroup, network):
        started.append(cgroup)
        return Fake(cgroup)

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "apt_install", lambda *a: None)
    monkeypatch.setattr(slurm_cluster, "cgroup_plugin", lambda: ("cgroup/v1", "cgroup v1"))
    monkeypatch.setattr(slurm_cluster, "_start", fake_start)
    c = slurm_cluster.start_cluster(tmp_path, two_nodes=False)
    assert started == ["cgroup/v1", None] and c.cgroup is None
    assert c.proctrack_why == ("proctrack/cgroup with cgroup/v1 did not track a job here: "
                               "the probe job 1 is not in a cgroup of its own: '0::/'")
    with pytest.raises(SlurmUnavailable, match="proctrack/cgroup impossible"):
        slurm_cluster.start_cluster(tmp_path, proctrack="cgroup", two_nodes=False)


def test_cluster_without_two_nodes_of_their_own_starts_without_them_and_says_why(monkeypatch, tmp_path):
    """No network namespaces here: the cluster starts without partition multi, and multi_why (what the
    two-node tests skip with) says why. Namespaces made, but their nodes never came up: removed, and the
    cluster started again without them. They came up, but the two-node probe job failed: that reason."""
    import slurm_cluster

    class Net:
        removed = False

        def remove(self):
            self.removed = True

    class Fake:
        multi_why = ""

        def __init__(self, network, probe_fails=False):
            self.network, self.probe_fails = network, probe_fails

        def check_two_nodes(self):
            if self.probe_fails:
                raise SlurmUnavailable("the two-node probe job 3 ended ('FAILED', 1)")

    def no_net(root, hostname):
        raise SlurmUnavailable("`ip netns add lt1-labn1` failed: Operation not permitted")

    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm_cluster, "apt_install", lambda *a: None)
    monkeypatch.setattr(slurm_cluster, "make_node_network", no_net)
    monkeypatch.setattr(slurm_cluster, "_start_tracked", lambda root, proctrack, network: Fake(network))
    c = slurm_cluster.start_cluster(tmp_path)
    assert c.network is None and c.multi_why == ("no network namespaces for two nodes here: `ip netns add "
                                                 "lt1-labn1` failed: Operation not permitted")
    net = Net()
    tried: list = []

    def nodes_never_idle(root, proctrack, network):
        tried.append(network)
        if network is not None:
            raise SlurmUnavailable("nodes not idle after 60 s: {'labn1': 'down*'}")
        return Fake(None)

    monkeypatch.setattr(slurm_cluster, "make_node_network", lambda root, hostname: net)
    monkeypatch.setattr(slurm_cluster, "_start_tracked", nodes_never_idle)
    c = slurm_cluster.start_cluster(tmp_path)
    assert tried == [net, None] and net.removed and c.network is None
    assert c.multi_why == ("the two nodes in namespaces of their own did not start: nodes not idle after "
                           "60 s: {'labn1': 'down*'}")
    monkeypatch.setattr(slurm_cluster, "_start_tracked", lambda root, proctrack, network: Fake(network, True))
    c = slurm_cluster.start_cluster(tmp_path)
    assert c.network is net and c.multi_why == "the two-node probe job 3 ended ('FAILED', 1)"
    with pytest.raises(pytest.skip.Exception, match="no two nodes at two addresses here: the two-node probe"):
        needs_two_nodes(c)


# ----------------------------------------------------------------- jobs on the cluster


@pytest.mark.slurm
@pytest.mark.slow
def test_cluster_runs_a_job(cluster, tmp_path):
    """The fixture's cluster itself: a one-line job on each partition; on the two nodes each task
    sees its node's own hostname and network (its own address, no other)."""
    script = tmp_path / "hello.sh"
    script.write_text("#!/bin/bash\nsrun bash -c 'echo $(hostname) $(hostname -I)'\n")
    has_two = cluster.network is not None and not cluster.multi_why
    two = [["--partition=multi", "--nodes=2", "--ntasks-per-node=1"]] if has_two else []
    for extra in ([], *two):
        res = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%j.out", *extra, str(script))
        job_id = res.stdout.strip()
        assert cluster.wait_job(job_id, 60) == ("COMPLETED", 0)
        lines = sorted((tmp_path / f"{job_id}.out").read_text().splitlines())
        assert cluster.job_state(job_id) == "COMPLETED"
        if extra:
            assert lines == [f"{node} {addr}" for node, addr in cluster.network.addrs.items()], lines
        else:
            assert len(lines) == 1 and lines[0].startswith(cluster.hostname), lines


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cluster_tracks_jobs_with_cgroups(cluster, tmp_path):
    """proctrack/cgroup, as most clusters: a process that leaves the job's process tree (its parent
    becomes init) is still the job's, and goes with it. Skipped, saying why, on linuxproc."""
    if cluster.proctrack != "cgroup":
        pytest.skip(f"the test cluster tracks jobs with proctrack/linuxproc here: {cluster.proctrack_why}")
    mark = uuid.uuid4().hex
    script = tmp_path / "escape.sh"
    # ( ... & ) : the sleep's parent exits at once, so it is re-parented to init (out of the job's tree)
    script.write_text(f"#!/bin/bash\n( {marks.MARKS_ENV}={mark} setsid sleep 300 & )\n"
                      f"touch {tmp_path}/ready\nsleep 300\n")
    res = cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%j.out", str(script))
    job_id = res.stdout.strip()
    deadline = time.monotonic() + 60
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline, cluster.job_info(job_id)
        time.sleep(0.2)
    assert marks.leftover(mark)  # the escaped sleep runs
    cluster.run("scancel", job_id)
    assert cluster.wait_job(job_id, 60) is not None
    assert marks.leftover(mark, wait_s=10) == []


@pytest.mark.slurm
@pytest.mark.slow
def test_jupyter_prints_tunnel_and_serves(cluster, job_env):
    """docs/cluster.md's CPU-partition line for jupyter.sbatch, as written, from the lab's folder (its output
    files sent to the test's folder by sbatch's SBATCH_OUTPUT and SBATCH_ERROR)."""
    job_dir, env = job_env
    del env["LAB_DIR"]  # the lab is where it is submitted
    job_id = submit_readme_line(r"^sbatch --gpus-per-node=0 .*slurm/jupyter\.sbatch", env, job_dir)
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
        assert cluster.job_info(job_id)["NumCPUs"] == "2"
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


def readme_line(pattern: str) -> str:
    """The command line of docs/cluster.md (where the README sends cluster users) that matches ``pattern``
    (comment cut off); the tests run it as written, from the repository root."""
    text = (REPO / "docs" / "cluster.md").read_text()
    found = [line.split("  #")[0].strip() for line in text.splitlines() if re.search(pattern, line)]
    assert len(found) == 1, f"docs/cluster.md: {len(found)} lines match {pattern!r}"
    return found[0]


def submit_readme_line(pattern: str, env: dict[str, str], job_dir: Path) -> str:
    """Run docs/cluster.md's line matching ``pattern``, as written, from the lab's folder; its output files go
    to ``job_dir`` (sbatch's SBATCH_OUTPUT and SBATCH_ERROR, which the command line would override).
    Returns the job id."""
    line = readme_line(pattern)
    env = dict(env, SBATCH_OUTPUT=str(job_dir / "slurm-%x-%j.out"),
               SBATCH_ERROR=str(job_dir / "slurm-%x-%j.err"))
    res = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    m = re.fullmatch(r"Submitted batch job (\d+)", res.stdout.strip())
    assert res.returncode == 0 and m, (line, res.stdout, res.stderr)
    return m.group(1)


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_readme_quick_run_all_line_starts_and_finishes_on_a_2_cpu_node(cluster, job_env):
    """docs/cluster.md's CPU smoke test, as written, from the lab's folder, on the cluster's 2-CPU node
    (a job asking the script's 16 CPUs would stay PENDING there). NOTEBOOKS (the script's setting)
    keeps it to notebook 00, to keep CI short; LAB_DIR is left to the script (the submit folder)."""
    line = readme_line(r"^LAB_PROFILE=quick sbatch .*slurm/run_all\.sbatch")
    assert cluster.cpus == 2
    _, env = job_env
    del env["LAB_DIR"], env["LAB_PROFILE"]  # the line sets the profile; the lab is where it is submitted
    env["NOTEBOOKS"] = "labs/00_environment.ipynb"
    res = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    m = re.fullmatch(r"Submitted batch job (\d+)", res.stdout.strip())
    assert res.returncode == 0 and m, (line, res.stdout, res.stderr)
    job_id = m.group(1)
    try:
        ended = cluster.wait_job(job_id, JOB_TIMEOUT_S)
        if ended is None:
            cluster.run("scancel", job_id, check=False)
        out, err = job_files(REPO, "lab-run-all", job_id)
    finally:
        for name in (f"slurm-lab-run-all-{job_id}.out", f"slurm-lab-run-all-{job_id}.err"):
            (REPO / name).unlink(missing_ok=True)
    assert ended == ("COMPLETED", 0), (cluster.job_info(job_id).get("Reason"), out, err)
    assert cluster.job_info(job_id)["NumCPUs"] == "2"
    results = Path(env["LAB_RESULTS_DIR"]) / "quick"  # LAB_PROFILE=quick, as the line says
    assert (results / "executed" / "00_environment.ipynb").is_file()
    report = (results / "report.md").read_text()
    assert "| 00_environment.ipynb | ok |" in report
    assert "(2 cores usable)" in report  # notebook 00 ran on the CPUs the job asked for
    assert f"report:    {results / 'report.md'}" in out
    job_txt = (Path(env["LAB_RESULTS_DIR"]) / "jobs" / job_id / "job.txt").read_text()
    assert re.search(r"^finished \S+ with exit code 0$", job_txt, re.M), job_txt


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

# experiment.sbatch runs `python -m lab_utils measure NAME --set ...`: notebook 02's experiment with its
# quick settings; a tiny run (narrow ResNet-18, 128 synthetic images) for the jobs that only check the
# plumbing. The 2-process job below runs docs/cluster.md's line.
SMALL = ["--set", "batch_sizes=32", "--set", "epochs=1", "--set", "width=8", "--set", "train_images=128",
         "--set", "seed=3"]
EXPERIMENT = "scaling"


def stored(results: Path) -> list[dict]:
    """Every record of the DDP experiment in a results folder, in order."""
    path = results / "quick" / "runs" / f"{EXPERIMENT}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def aggregates(results: Path) -> list[dict]:
    """The aggregate records of the DDP experiment in a results folder, in order."""
    return [r for r in stored(results) if r["config"]["record"] == "aggregate"]


@pytest.fixture(scope="module")
def two_process_job(cluster, tmp_path_factory):
    """docs/cluster.md's CPU line for experiment.sbatch, as written (2 CPUs, 2 gloo processes), submitted from
    the lab's folder: notebook 02's quick settings; SETTINGS (the script's setting) keeps it to batch 32.
    Its output files are then moved to the fixture's job folder. Its $TMPDIR is a folder of its own."""
    tmp = tmp_path_factory.mktemp("exp2")
    job_dir = tmp / "jobs"
    job_dir.mkdir()
    (tmp / "tmpdir").mkdir()
    env = cluster.env
    env.update(LAB_RESULTS_DIR=str(tmp / "results"), SETTINGS="batch_sizes=32", TMPDIR=str(tmp / "tmpdir"))
    env.pop("LAB_DIR", None)
    line = readme_line(r"^LAB_PROFILE=quick sbatch .*slurm/experiment\.sbatch")
    res = subprocess.run(["bash", "-c", line], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    m = re.fullmatch(r"Submitted batch job (\d+)", res.stdout.strip())
    assert res.returncode == 0 and m, (line, res.stdout, res.stderr)
    job_id = m.group(1)
    ended = cluster.wait_job(job_id, JOB_TIMEOUT_S)
    if ended is None:
        cluster.run("scancel", job_id, check=False)
    for name in (f"slurm-lab-ddp-{job_id}.out", f"slurm-lab-ddp-{job_id}.err"):
        if (REPO / name).exists():
            (REPO / name).replace(job_dir / name)
    env.update(LAB_DIR=str(REPO), LAB_PROFILE="quick")
    del env["SETTINGS"]
    return {"job_id": job_id, "code": ended and ended[1], "job_dir": job_dir, "env": env,
            "results": tmp / "results", "tmpdir_left": sorted(p.name for p in (tmp / "tmpdir").iterdir())}


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_from_the_readme_line(cluster, two_process_job):
    """The job is `python -m lab_utils measure scaling --set devices=2 --set batch_sizes=32`: one line per
    run, the records in the store, the exit code in job.txt, nothing left in $TMPDIR (torch's compile
    cache, which every rank makes, went to the job's folder and was removed)."""
    job = two_process_job
    out, err = job_files(job["job_dir"], "lab-ddp", job["job_id"])
    assert job["code"] == 0 and cluster.job_state(job["job_id"]) == "COMPLETED", out + err
    assert "scaling: measuring DDP 2 x 32 (2 process(es), cpu)" in out
    assert re.search(r"^  DDP 2 x 32 +ok +train_seconds \d", out, re.M), out
    assert f"records: {job['results'] / 'quick' / 'runs' / 'scaling.jsonl'}" in out
    [agg] = aggregates(job["results"])
    cfg, m = agg["config"], agg["metrics"]
    assert (cfg["devices"], cfg["batch_size"], cfg["global_batch"], cfg["epochs"]) == (2, 32, 64, 2)
    assert (agg["status"], agg["profile"], agg["synthetic"], m["backend"]) == ("ok", "quick", True, "gloo")
    assert m["world_size"] == 2 and len(m["epochs"]) == 2 and m["train_seconds"] > 0
    assert m["threads_per_rank"] == 1  # notebook 02's one thread per gloo process
    assert len(stored(job["results"])) == 3  # aggregate + 2 ranks
    per_job = job["results"] / "jobs" / job["job_id"]
    assert json.loads((per_job / "machine.json").read_text())["profile"] == "quick"  # `lab_utils info`
    assert "exit code 0" in (per_job / "job.txt").read_text()
    assert "measuring DDP 2 x 32" in (per_job / "measure.log").read_text()
    assert job["tmpdir_left"] == [] and not (per_job / "torchinductor").exists()


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
    records = stored(job["results"])
    assert len(records) == 3
    assert {r["hardware"]["cpu_cores"] for r in records} == {2}, [r["hardware"] for r in records]


@pytest.mark.slurm
@pytest.mark.slow
def test_notebook_02_reuses_the_jobs_records(two_process_job, monkeypatch):
    """The job ran exactly what notebook 02 would: its measure finds it stored, measures nothing."""
    from lab_utils.engine.plan import aggregates as aggregate_records
    from lab_utils.engine.plan import measure
    from lab_utils.engine.session import start
    from lab_utils.experiments.n02_scaling import experiment as scaling

    monkeypatch.setenv("LAB_RESULTS_DIR", str(two_process_job["results"]))
    lab = start("quick")
    before = len(lab.store.records("scaling"))
    settings = lab.settings(scaling.Settings, batch_sizes=(32,), devices=(2,))
    records = aggregate_records(measure(lab, scaling.SCALING_EXPERIMENT, settings))
    assert [r.status for r in records] == ["ok"] and len(lab.store.records("scaling")) == before


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_resubmitted_measures_only_what_is_missing(cluster, two_process_job):
    """After a time limit, the same job submitted again continues: stored runs are not measured again."""
    job = two_process_job
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=2", "--",
                          "scaling", "--set", "devices=2", "--set", "batch_sizes=32,128",
                          env=job["env"], cwd=job["job_dir"])
    out, err = job_files(job["job_dir"], "lab-ddp", job_id)
    assert code == 0, out + err
    assert "scaling: measured now: DDP 2 x 128" in out and "measuring DDP 2 x 32 " not in out
    assert [r["config"]["batch_size"] for r in aggregates(job["results"])] == [32, 128]


@pytest.mark.parametrize("gpus", [1, 4])
@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_on_one_and_four_processes(cluster, job_env, gpus):
    job_dir, env = job_env
    cpus = min(gpus, cluster.cpus)  # one thread per process, as notebook 02 runs gloo
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", f"--cpus-per-task={cpus}", "--",
                          "scaling", "--set", f"devices={gpus}", *SMALL, env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code == 0, out + err
    [agg] = aggregates(Path(env["LAB_RESULTS_DIR"]))
    assert (agg["config"]["devices"], agg["config"]["global_batch"]) == (gpus, 32 * gpus)
    assert agg["config"]["width"] == 8 and agg["metrics"]["epochs"][0]["images"] == 128


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
                          "scaling", "--set", "devices=1", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code != 0 and cluster.job_state(job_id) == "FAILED"
    assert "error: This node's NVIDIA driver 535.183.01 reports 2 GPUs" in err
    assert "TORCH_VARIANT=cu126" in err
    assert "measuring" not in out  # stopped before the plan and any launch


@pytest.mark.slurm
@pytest.mark.slow
def test_experiment_job_rejects_bad_input_before_work(cluster, job_env):
    """A bad profile: before the set-up; a bad setting: one sentence from measure, before any launch, and the
    exit code in job.txt."""
    job_dir, env = job_env
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=1",
                          env={**env, "LAB_PROFILE": "quik"}, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code != 0 and "LAB_PROFILE (or PROFILE) must be quick or full, got 'quik'." in err
    assert "make" not in out  # failed before the set-up
    job_id, code = submit(cluster, "experiment.sbatch", "--gpus-per-node=0", "--cpus-per-task=1", "--",
                          "scaling", "--set", "device=2", env=env, cwd=job_dir)
    out, err = job_files(job_dir, "lab-ddp", job_id)
    assert code == 2, out + err
    log = (Path(env["LAB_RESULTS_DIR"]) / "jobs" / job_id / "measure.log").read_text()
    sentence = log.splitlines()[0]  # then srun's own lines on the step's exit code
    assert sentence.startswith("error: Unknown scaling setting(s) ['device']; use: "), log
    assert sentence in out and "Traceback" not in log + out + err  # shown in the job's output too
    assert "measuring" not in out
    job_txt = (Path(env["LAB_RESULTS_DIR"]) / "jobs" / job_id / "job.txt").read_text()
    assert re.search(r"^finished \S+ with exit code 2$", job_txt, re.M), job_txt


# ----------------------------------------------------------------- stopped jobs: a time limit, a requeue

# A DDP notebook: one torchrun launch per device count (1, 2, 4 gloo processes), ~110 s in the quick
# profile on 2 busy cores. The runs below share one results folder, so its configurations are
# measured once in all: each run resumes where the one before stopped.
STOP_NOTEBOOK = "02_multi_gpu_scaling.ipynb"
STOP_TIMEOUT_S = 300
LINE = (rf"interrupted by SIGTERM in {STOP_NOTEBOOK}(, code cell \d+)?: the kernel and its processes were "
        rf"stopped; executed copy: \S+/quick/executed/{STOP_NOTEBOOK}; records already stored are kept "
        rf"\(run again to resume\)\.")
EARLY_LINE = ("interrupted by SIGTERM before the first notebook: the kernel and its processes were stopped; "
              "records already stored are kept (run again to resume).")
# SLURM's SIGTERM while the job script sets up, before the runner starts (slurm/job.sh's job_stopped)
JOB_LINE = ("interrupted by SIGTERM outside the lab's command (while the job set up or wrapped up): nothing "
            "of the lab was running; records already stored are kept (run again to resume).")


def store_files(results: Path) -> dict[str, list[str]]:
    """The quick profile's result store: every runs/*.jsonl file's lines."""
    runs = results / "quick" / "runs"
    return {p.name: p.read_text().splitlines() for p in sorted(runs.glob("*.jsonl"))} if runs.exists() else {}


def record_keys(files: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(file, configuration) of every stored record: a configuration measured twice appears twice."""
    return [(name, json.dumps(json.loads(line)["config"], sort_keys=True)) for name, lines in files.items()
            for line in lines]


def count(files: dict[str, list[str]]) -> int:
    return sum(len(lines) for lines in files.values())


def new_records(before: dict[str, list[str]], after: dict[str, list[str]]) -> list[tuple]:
    """(devices, per-device batch, record kind) of what was stored between ``before`` and ``after``."""
    return [((c := json.loads(line)["config"]).get("devices"), c.get("batch_size"), c.get("record"))
            for name, lines in after.items() for line in lines[len(before.get(name, [])):]]


def _time_in(text: str, pattern: str) -> float:
    """Epoch seconds of the time in the last line of ``text`` matching ``pattern`` (group 1)."""
    found = re.findall(pattern, text, re.M)
    assert found, f"no line matching {pattern!r} in:\n{text}"
    return datetime.fromisoformat(found[-1]).timestamp()


def observe_stop(cluster: SlurmCluster, run: dict, job_id: str, how: str, before: dict) -> dict:
    """What a stopped run_all.sbatch left, read as soon as it ended (before any restart)."""
    out, err = job_files(run["cwd"], "lab-run-all", job_id)
    job_txt = (run["results"] / "jobs" / job_id / "job.txt").read_text()
    signal_at = _time_in(job_txt, r"^SIGTERM received (\S+): ")  # passed on, or no command ran
    exited_at = _time_in(job_txt, r"^finished (\S+) with exit code 143$")
    copy = run["results"] / "quick" / "executed" / STOP_NOTEBOOK
    report = run["results"] / "quick" / "report.md"
    after = store_files(run["results"])
    return {
        "how": how, "job_id": job_id, "out": out, "err": err, "job_txt": job_txt,
        "seconds_signal_to_exit": round(exited_at - signal_at, 2),
        "lines": [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("slurmstepd")],
        "slurm_said": [ln for ln in err.splitlines() if ln.startswith("slurmstepd")],
        "copy_written": copy.is_file() and copy.stat().st_mtime >= signal_at,
        "copy": nbformat.read(str(copy), as_version=4) if copy.is_file() else None,
        "report_row": next((ln for ln in (report.read_text().splitlines() if report.is_file() else [])
                            if ln.startswith(f"| {STOP_NOTEBOOK} |")), None),
        "report_written": report.is_file() and report.stat().st_mtime >= signal_at,
        "records_before": count(before), "records_after": count(after), "before": before, "after": after,
        "measured": new_records(before, after),
        "processes_left": marks.leftover(run["mark"], wait_s=5),
        "tmpdir_left": sorted(p.name for p in run["tmpdir"].iterdir()),
        "state": cluster.job_state(job_id),
    }


def _until(condition, timeout_s: float, why) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, why()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def stops(cluster, tmp_path_factory) -> dict:
    """run_all.sbatch on notebook 02 (quick, 2 CPUs), four times on one results folder:

    1. ``limit``: ``--time=00:01:00``. The script's own ``--signal=B:TERM@60`` reaches the batch shell
       at SLURM's first time-limit check (within the first minute; SLURM checks about once a minute),
       while the runner starts or during the notebook;
    2. ``warning``: the same command again; once it has stored a record of its own, what that
       signal does, at a moment of our choosing: SIGTERM to the batch shell alone
       (``scancel --batch --signal=TERM``), during the notebook's DDP launches;
    3. ``requeue``: again; once it has stored a record of its own, ``scontrol requeue`` (SIGTERM to
       every process of the job at once, under cgroups);
    4. ``resumed``: that job's restart (SLURM holds a requeued job for 2 minutes: released at once),
       to the end of the notebook.
    """
    tmp = tmp_path_factory.mktemp("stops")
    run = {"cwd": tmp / "jobs", "results": tmp / "results", "tmpdir": tmp / "tmpdir",
           "mark": uuid.uuid4().hex}
    run["cwd"].mkdir()
    run["tmpdir"].mkdir()
    env = cluster.env
    # torch makes its compile cache ($TMPDIR/torchinductor_<user>) at import, in every process: kept
    # apart here, so that anything else the jobs leave in $TMPDIR shows.
    env.update(LAB_DIR=str(REPO), LAB_RESULTS_DIR=str(run["results"]), LAB_PROFILE="quick",
               TMPDIR=str(run["tmpdir"]), TORCHINDUCTOR_CACHE_DIR=str(tmp / "torch_cache"),
               **{marks.MARKS_ENV: run["mark"]})  # every process of the jobs inherits it: none may be left
    args = ("--gpus-per-node=0", "--cpus-per-task=2", "--", f"labs/{STOP_NOTEBOOK}")
    found: dict = {}
    results = run["results"]

    before = store_files(results)
    job_id, _ = submit(cluster, "run_all.sbatch", "--time=00:01:00", *args, env=env, cwd=run["cwd"],
                       timeout=STOP_TIMEOUT_S)
    found["limit"] = observe_stop(cluster, run, job_id, "time limit (1 min)", before)

    def start_measuring() -> tuple[str, dict, dict]:
        """Submit again; return once the job has stored a record of its own (a launch is running)."""
        before = store_files(results)
        job_id, _ = submit(cluster, "run_all.sbatch", *args, env=env, cwd=run["cwd"], wait=False)
        _until(lambda: count(store_files(results)) > count(before), STOP_TIMEOUT_S,
               lambda: f"{cluster.job_state(job_id)}\n{_outputs(run['cwd'])}")
        return job_id, before, store_files(results)

    job_id, before, at_signal = start_measuring()
    cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    _until(lambda: cluster.job_state(job_id) not in ("RUNNING", "COMPLETING"), 120,
           lambda: _outputs(run["cwd"]))
    found["warning"] = observe_stop(cluster, run, job_id, "time-limit warning (batch shell alone)", before)
    found["warning"]["records_at_signal"] = count(at_signal)

    job_id, before, at_signal = start_measuring()
    job_txt = results / "jobs" / job_id / "job.txt"
    t0 = time.monotonic()
    cluster.run("scontrol", "requeue", job_id)
    _until(lambda: re.search(r"^finished \S+ with exit code", job_txt.read_text(), re.M), 120,
           lambda: _outputs(run["cwd"]))
    seen_exit = time.monotonic() - t0
    _until(lambda: cluster.job_state(job_id) == "PENDING", 120, lambda: cluster.job_info(job_id))  # requeued
    found["requeue"] = observe_stop(cluster, run, job_id, "requeue", before)
    found["requeue"].update(records_at_signal=count(at_signal),
                            seconds_requeue_to_exit_seen=round(seen_exit, 2))

    stopped = store_files(results)
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    ended = cluster.wait_job(job_id, STOP_TIMEOUT_S)
    if ended is None:
        cluster.run("scancel", job_id, check=False)
    out, err = job_files(run["cwd"], "lab-run-all", job_id)
    after = store_files(results)
    found["resumed"] = {
        "ended": ended, "out": out, "err": err, "job_txt": job_txt.read_text(), "before": stopped,
        "after": after, "records_before": count(stopped), "records_after": count(after),
        "measured": new_records(stopped, after), "report": (results / "quick" / "report.md").read_text(),
        "processes_left": marks.leftover(run["mark"], wait_s=5),
        "tmpdir_left": sorted(p.name for p in run["tmpdir"].iterdir()),
    }
    print(f"proctrack/{cluster.proctrack} ({cluster.proctrack_why})")
    for key in ("limit", "warning", "requeue"):
        f = found[key]
        print(f"{f['how']}: {f['state']}, {f['seconds_signal_to_exit']} s from SIGTERM to exit; "
              f"line: {f['lines']}; "
              f"copy written: {f['copy_written']}; report written: {f['report_written']} "
              f"({f['report_row']}); records {f['records_before']} -> {f['records_after']}, "
              f"{f.get('records_at_signal', '-')} at the signal; measured {f['measured']}")
    print(f"requeue: exit seen {found['requeue']['seconds_requeue_to_exit_seen']} s after `scontrol requeue`")
    r = found["resumed"]
    print(f"resumed: {r['ended']}; records {r['records_before']} -> {r['records_after']}; "
          f"measured {r['measured']}")
    return found


def assert_kept_and_measured_once(before: dict[str, list[str]], after: dict[str, list[str]]) -> None:
    """What was stored before is still there, unchanged, and no configuration is stored twice, but for
    the plan's one exception (lab_utils.engine.plan, "reuse"): a ``together`` group (one comparison, e.g. the
    all-reduce benchmark's sizes of one rank count) is reused only whole, from one launch, so a launch
    stopped part-way through its group is measured again whole. A configuration may then be stored
    twice, when its earlier launch (``run_id``) stored fewer runs than its group holds (``group_runs``)."""
    for name, lines in before.items():
        assert after[name][:len(lines)] == lines, name
    keys = record_keys(after)
    twice = {k for k in keys if keys.count(k) > 1}
    stored = [(name, json.loads(line)) for name, lines in after.items() for line in lines]
    runs_of: dict[tuple[str, str], int] = {}  # (file, run_id) -> its aggregate records in the store
    for name, rec in stored:
        if (run_id := rec["metrics"].get("run_id")) is not None and rec["config"].get("record") != "rank":
            runs_of[(name, run_id)] = runs_of.get((name, run_id), 0) + 1
    for (name, rec), key in zip(stored, keys, strict=True):
        if key in twice and rec is not [r for n, r in stored if (n, json.dumps(r["config"], sort_keys=True))
                                        == key][-1]:  # an earlier copy: its launch must be incomplete
            run_id, group = rec["metrics"].get("run_id"), rec["metrics"].get("group_runs")
            assert run_id is not None and group is not None, f"{key} measured twice, outside a together group"
            assert runs_of[(name, run_id)] < group, \
                f"{key} measured again although its launch {run_id} had stored all {group} runs of its group"



def assert_stopped_cleanly(stop: dict, in_notebook: bool = True) -> None:
    """One line, the executed copy and report.md (STOPPED) written after the signal, exit code 143
    in job.txt, within KillWait (30 s), nothing left running or in $TMPDIR, stored records kept.
    ``in_notebook=False``: the signal may also have come before the notebook started (no copy), or while
    its kernel started (no cell yet), or while the job script set up (no report: the runner had not
    started)."""
    assert len(stop["lines"]) == 1, stop["err"]
    line = stop["lines"][0]
    if in_notebook or line not in (EARLY_LINE, JOB_LINE):
        assert re.fullmatch(LINE, line), line
        assert "code cell" in line or not in_notebook, line
        assert f"STOPPED {STOP_NOTEBOOK}" in stop["out"]
        assert stop["copy_written"], stop["out"]
        assert stop["report_row"].startswith(f"| {STOP_NOTEBOOK} | STOPPED | ")
        assert "interrupted by SIGTERM" in stop["report_row"]
        cell = int(re.search(r"code cell (\d+)", line).group(1)) if "code cell" in line else 1
        code = [c for c in stop["copy"].cells if c.cell_type == "code"]
        assert all(c.get("execution_count") for c in code[:cell - 1])  # the cells before ran: in the copy
    assert "Traceback" not in stop["err"] and "Traceback" not in stop["out"]
    assert stop["report_written"] or line == JOB_LINE, stop["out"]
    assert re.search(r"^finished \S+ with exit code 143$", stop["job_txt"], re.M), stop["job_txt"]
    assert 0 < stop["seconds_signal_to_exit"] < 30, stop["seconds_signal_to_exit"]  # before SLURM's SIGKILL
    assert stop["processes_left"] == []
    assert stop["tmpdir_left"] == []  # the kernel's connection file, lab_ddp_*, torchelastic_*, the runner's
    assert_kept_and_measured_once(stop["before"], stop["after"])


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_one_minute_time_limit_stops_run_all_cleanly(stops):
    """SLURM's own time-limit warning (the script's --signal=B:TERM@60): wherever it finds the run."""
    stop = stops["limit"]
    assert_stopped_cleanly(stop, in_notebook=False)
    # FAILED: it exited (143) before the limit, warned in time; TIMEOUT if SLURM's check came only
    # at the limit (the SIGTERM then reaches every process, and the runner stops just the same)
    assert stop["state"] in ("FAILED", "TIMEOUT")


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_time_limit_warning_during_a_ddp_launch_stops_run_all_cleanly(stops):
    """SIGTERM to the batch shell alone, as the warning sends it: only run_forwarding passes it on."""
    stop = stops["warning"]
    assert_stopped_cleanly(stop)
    assert stop["records_before"] < stop["records_at_signal"] <= stop["records_after"]
    assert stop["state"] == "FAILED"


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_requeue_stops_run_all_cleanly(stops):
    stop = stops["requeue"]
    assert_stopped_cleanly(stop)
    assert any("DUE TO JOB REQUEUE" in line for line in stop["slurm_said"]), stop["err"]
    assert stop["records_before"] < stop["records_at_signal"] <= stop["records_after"]
    assert stop["seconds_requeue_to_exit_seen"] < 30


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_requeued_job_resumes_keeps_its_output_and_measures_nothing_twice(stops):
    r = stops["resumed"]
    assert r["ended"] == ("COMPLETED", 0), r["out"] + r["err"]
    # the output of both starts, in order, in the same files (--open-mode=append)
    out = r["out"]
    first, restart, second = f"STOPPED {STOP_NOTEBOOK}", "=== restart 1 of job", f"ok     {STOP_NOTEBOOK}"
    assert out.index(first) < out.index(restart) < out.index(second), out
    assert "interrupted by SIGTERM" in r["err"]
    starts_and_ends = re.findall(r"^(=== restart \d+|finished) .*?(exit code \d+)?$", r["job_txt"], re.M)
    assert starts_and_ends == [("finished", "exit code 143"), ("=== restart 1", ""),
                               ("finished", "exit code 0")], r["job_txt"]
    assert f"| {STOP_NOTEBOOK} | ok |" in r["report"]
    # nothing measured twice: each stopped run's records are there, unchanged, and each next run
    # (the warning's after the time limit, and so on) added only configurations not stored
    assert_kept_and_measured_once(r["before"], r["after"])
    assert r["records_after"] > r["records_before"] and r["measured"]
    assert r["processes_left"] == [] and r["tmpdir_left"] == []


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_warning_while_the_runner_loads_stops_run_all_with_its_line(cluster, job_env):
    """The time-limit warning 0.4 s after the runner started, while it still loads (seconds: nbclient, the
    GPU-node guard): one line and the report, 143. Until 61d64d8 the runner died from it, silently (the
    one-minute limit above, once, on a slow machine). The first ~0.1 s, Python's own start-up, is not
    covered."""
    job_dir, env = job_env
    job_id, _ = submit(cluster, "run_all.sbatch", "--gpus-per-node=0", "--cpus-per-task=2", "--",
                       "labs/00_environment.ipynb", env=env, cwd=job_dir, wait=False)
    results = Path(env["LAB_RESULTS_DIR"])
    job_txt = results / "jobs" / job_id / "job.txt"
    deadline = time.monotonic() + 120
    while not (job_txt.is_file() and "\nresults: " in job_txt.read_text()):  # printed just before the runner
        assert time.monotonic() < deadline and cluster.job_state(job_id) in ("PENDING", "RUNNING"), \
            _outputs(job_dir)
        time.sleep(0.02)
    time.sleep(0.4)
    cluster.run("scancel", "--batch", "--signal=TERM", job_id)
    assert cluster.wait_job(job_id, 120) is not None, _outputs(job_dir)
    _, err = job_files(job_dir, "lab-run-all", job_id)
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("slurmstepd")]
    # on a fast node the runner may already be in the notebook: its own line then
    assert len(lines) == 1 and (lines[0] == EARLY_LINE or lines[0].startswith(
        "interrupted by SIGTERM in 00_environment.ipynb")), err
    assert re.search(r"^finished \S+ with exit code 143$", job_txt.read_text(), re.M), job_txt.read_text()
    assert (results / "quick" / "report.md").is_file()


# ----------------------------------------------------------------- multi-node DDP: two nodes, two addresses

# One multinode.sbatch launch of notebook 02's batch 32, measured MULTI_REPEATS times (each repeat a
# configuration of its own, ~2-4 s): the first is stored, then SLURM stops the launch during a later one.
MULTI_REPEATS = 20
MULTI_SETTINGS = f"batch_sizes=32 repeats={MULTI_REPEATS}"
ROW = re.compile(r"^  (DDP 2 x 32(?: \(repeat \d+\))?) +(ok|stopped|skipped|error|missing) +(.*)$", re.M)


def stop_multinode(cluster: SlurmCluster, job_id: str, run: dict, stop) -> dict:
    """Wait until the job has stored its first configuration's records (its launch is on a later one),
    ``stop(job_id)``, wait for its end; what it left, read at once."""
    launch = run["results"] / "jobs" / job_id / "launch" / "records.jsonl"
    _until(lambda: launch.is_file() and launch.stat().st_size > 0, JOB_TIMEOUT_S,
           lambda: f"{cluster.job_info(job_id)}\n{_outputs(run['cwd'])}")
    how = stop(job_id)
    ended = cluster.wait_job(job_id, 180)
    if ended is None:
        cluster.run("scancel", job_id, check=False)
    out, err = job_files(run["cwd"], "lab-multinode", job_id)
    folder = run["results"] / "jobs" / job_id
    job_txt = (folder / "job.txt").read_text()
    signal_at = _time_in(job_txt, r"^SIGTERM received (\S+): ")
    exited_at = _time_in(job_txt, r"^finished (\S+) with exit code \d+$")
    return {
        "how": how, "job_id": job_id, "ended": ended, "out": out, "err": err, "job_txt": job_txt,
        "seconds_signal_to_exit": round(exited_at - signal_at, 2),
        "rows": ROW.findall(out), "rows_in_job_txt": ROW.findall(job_txt),
        "records": stored(run["results"]), "processes_left": marks.leftover(run["mark"], wait_s=5),
        "tmpdir_left": sorted(p.name for p in run["tmpdir"].iterdir()),
        "torchrun_logs": sorted(p.name for p in (folder / "torchrun").glob("*.log")),
    }


def multinode_run(cluster: SlurmCluster, tmp: Path) -> dict:
    """A results folder, a submit folder and an empty $TMPDIR for one job; every process of the job
    carries a mark (none may be left)."""
    run = {"cwd": tmp / "jobs", "results": tmp / "results", "tmpdir": tmp / "tmpdir",
           "mark": uuid.uuid4().hex}
    run["cwd"].mkdir()
    run["tmpdir"].mkdir()
    run["env"] = dict(cluster.env, LAB_RESULTS_DIR=str(run["results"]), TMPDIR=str(run["tmpdir"]),
                      SETTINGS=MULTI_SETTINGS, **{marks.MARKS_ENV: run["mark"]})
    return run


@pytest.fixture(scope="module")
def multinode_limit(cluster, two_process_job, tmp_path_factory) -> dict:
    """docs/cluster.md's CPU line for multinode.sbatch, as written (2 nodes, --cpus-per-task=2, the quick
    profile), submitted from the lab's folder to partition multi (SBATCH_PARTITION); SETTINGS: the
    one-node job's batch 32, MULTI_REPEATS times. Once its first configuration is stored, its time
    limit is cut to what leaves 30-90 s, so that SLURM's next time-limit check (every 30 s) sends the
    script's warning (--signal=B:TERM@60) during the launch: a real time limit, at a moment of the
    launch instead of a random one (of the set-up, as often as not)."""
    needs_two_nodes(cluster)
    run = multinode_run(cluster, tmp_path_factory.mktemp("multi_limit"))
    pattern = r"^LAB_PROFILE=quick sbatch .*slurm/multinode\.sbatch"
    job_id = submit_readme_line(pattern, dict(run["env"], SBATCH_PARTITION="multi"), run["cwd"])

    def cut_the_limit(job_id: str) -> str:
        h, mnt, sec = (int(x) for x in cluster.job_info(job_id)["RunTime"].split(":")[-3:])
        minutes = (h * 3600 + mnt * 60 + sec + 90) // 60
        cluster.run("scontrol", "update", f"JobId={job_id}", f"TimeLimit={minutes}")
        return f"time limit cut to {minutes} min at {h:02d}:{mnt:02d}:{sec:02d}"

    found = stop_multinode(cluster, job_id, run, cut_the_limit)
    found["line"] = readme_line(pattern)
    found["state"] = cluster.job_state(job_id)
    print(f"multinode, {found['how']}: {found['ended']}, {found['seconds_signal_to_exit']} s from SIGTERM to "
          f"exit; rows: {[status for _, status, _ in found['rows']]}")
    return found


@pytest.fixture(scope="module")
def multinode_cancelled(cluster, tmp_path_factory) -> dict:
    """multinode.sbatch on the two nodes (1 CPU each), SETTINGS as above, cancelled (scancel: SIGTERM to
    every process of the job at once) once its first configuration is stored."""
    needs_two_nodes(cluster)
    run = multinode_run(cluster, tmp_path_factory.mktemp("multi_scancel"))
    env = dict(run["env"], LAB_DIR=str(REPO), LAB_PROFILE="quick")
    job_id, _ = submit(cluster, "multinode.sbatch", "--partition=multi", "--nodes=2", "--gpus-per-node=0",
                       "--cpus-per-task=1", env=env, cwd=run["cwd"], wait=False)

    def cancel(job_id: str) -> str:
        cluster.run("scancel", job_id)
        return "scancel"

    found = stop_multinode(cluster, job_id, run, cancel)
    found["state"] = cluster.job_state(job_id)
    print(f"multinode, scancel: {found['ended']}, {found['seconds_signal_to_exit']} s from SIGTERM to exit; "
          f"rows: {[status for _, status, _ in found['rows']]}")
    return found


def assert_multinode_stopped(stop: dict) -> None:
    """Each node said in one line that SLURM stopped it, nothing else said so, no traceback; what global
    rank 0 finished is stored, the configuration it was on reads "stopped" (in the output and job.txt),
    the rest "not run"; exit code 143 within KillWait of the signal; nothing left running or in $TMPDIR."""
    out, err = stop["out"], stop["err"]
    for node in ("labn1", "labn2"):
        said = [line for line in out.splitlines() if line.startswith(f"{node}: ")]
        assert len(said) == 1 and re.fullmatch(
            rf"{node}: stopped by SLURM \(SIGTERM, \d\d:\d\d:\d\d\): its torchrun agent and ranks stop; "
            rf"their output: \S+/torchrun/{node}\.log", said[0]), (node, out)
    assert stop["torchrun_logs"] == ["labn1.log", "labn2.log"]  # one agent on each node
    for word in ("Traceback", "Logging error"):  # torchrun's stay in its logs
        assert word not in out and word not in err, (word, out, err)
    statuses = [status for _, status, _ in stop["rows"]]
    finished = statuses.index("stopped")
    assert finished >= 1 and statuses == (["ok"] * finished + ["stopped"]
                                          + ["skipped"] * (MULTI_REPEATS - finished - 1)), stop["rows"]
    assert stop["rows"][finished][2] == ("stopped by SIGTERM (SLURM) before it finished; not stored: submit "
                                         "again to measure it")
    assert stop["rows_in_job_txt"] == stop["rows"]  # the job's own report says so too
    aggregates_stored = [r for r in stop["records"] if r["config"]["record"] == "aggregate"]
    assert [r["status"] for r in aggregates_stored] == ["ok"] * finished  # what it finished, no more
    assert len(stop["records"]) == 3 * finished  # and each one's two ranks
    assert re.search(r"^finished \S+ with exit code 143$", stop["job_txt"], re.M), stop["job_txt"]
    assert 0 < stop["seconds_signal_to_exit"] < 30, stop["seconds_signal_to_exit"]  # before SLURM's SIGKILL
    assert "CANCELLED AT" in err  # SLURM's own line, for a time limit's warning as for scancel
    assert stop["processes_left"] == [] and stop["tmpdir_left"] == []


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_multinode_readme_line_with_two_cpus_per_task_gives_the_one_node_records(multinode_limit,
                                                                                  two_process_job):
    """docs/cluster.md's line, --cpus-per-task=2: each rank runs the profile's one thread, as the
    one-node job's ranks (its experiment.sbatch line, also --cpus-per-task=2) do, so the first configuration's
    records are the one-node job's: the same configuration but the tag, the same losses, accuracies and
    parameter-derived figures. Over two nodes at two addresses: the rendezvous on the first's."""
    job = multinode_limit
    assert "--cpus-per-task=2" in job["line"]
    assert re.search(r"^job \d+: 2 nodes \(labn\[1-2\]\) x 1 gloo processes = 2 \(GPUs per node: 0, CPUs per "
                     r"node: 2\)$", job["out"], re.M), job["out"]
    assert re.search(r"^rendezvous: c10d at 10\.231\.\d+\.2:\d+ \(first node labn1\)$", job["out"], re.M)
    assert ("launch: 1 process(es) per node of lab_utils.experiments.n02_scaling.ddp_worker, "
            "1 torch thread(s) each" in job["out"])
    multi = [r for r in job["records"] if r["config"]["record"] == "aggregate"][0]
    single = next(r for r in aggregates(two_process_job["results"]) if r["config"]["batch_size"] == 32)
    assert multi["config"]["tag"] == "nodes=2" and {**multi["config"], "tag": ""} == single["config"]
    assert multi["hardware"]["cpu_cores"] == 2  # each node's step: the 2 CPUs per task the job asked for
    for k in ("threads_per_rank", "parameters", "gradient_bytes", "steps_per_epoch", "global_batch",
              "world_size", "backend"):
        assert multi["metrics"][k] == single["metrics"][k], k
    assert multi["metrics"]["threads_per_rank"] == 1
    for a, b in zip(multi["metrics"]["epochs"], single["metrics"]["epochs"], strict=True):
        for k in ("train_loss", "train_accuracy", "images", "steps"):
            assert a[k] == pytest.approx(b[k], rel=1e-6), k


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_time_limit_stops_a_multinode_job_cleanly_and_stores_what_it_finished(multinode_limit):
    """SLURM's time-limit warning (the script's --signal=B:TERM@60) to the batch shell alone: it passes the
    signal on to the srun step's processes (srun itself would SIGKILL them). The job ends FAILED 143,
    with SLURM's "CANCELLED AT" line, as docs/cluster.md says; TIMEOUT if SLURM's check came only at the
    limit."""
    stop = multinode_limit
    assert_multinode_stopped(stop)
    assert "passed on to the launch on every node (scancel --signal=TERM); waiting" in stop["out"]
    assert stop["state"] in ("FAILED", "TIMEOUT") and stop["ended"][1] == 143, stop["ended"]


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_scancel_stops_a_multinode_job_cleanly_and_stores_what_it_finished(multinode_cancelled):
    stop = multinode_cancelled
    assert_multinode_stopped(stop)
    assert stop["state"] == "CANCELLED"
