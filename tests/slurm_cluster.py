"""A throw-away SLURM cluster on this machine, for tests that submit the real scripts.

:func:`start_cluster` installs Debian's ``slurm-wlm`` and ``munge`` when they are missing
(root and ``apt-get`` needed), writes a private ``slurm.conf`` under a temporary folder
and starts ``munged``, ``slurmctld`` and three ``slurmd`` daemons from it:

- partition ``lab`` (the default): one node named after this machine, with its CPU
  count and ``RealMemory`` from ``/proc/meminfo`` (no GPUs, no gres);
- partition ``multi``: two nodes ``labn1`` and ``labn2`` that are two ``slurmd`` daemons on
  this same machine (``slurmd -N``), so that a ``--nodes=2`` job really gets two nodes.

Nothing outside the temporary folder is touched except the package installation: the
daemons use their own ports, munge socket and key, state and spool folders, and every
client command must be given ``SLURM_CONF`` (see :attr:`SlurmCluster.env`).
:meth:`SlurmCluster.stop` cancels the jobs and stops the daemons it started (by pid).

When SLURM cannot be started (not root, no ``apt-get``, installation or start-up
failed), :func:`start_cluster` raises :class:`SlurmUnavailable` with the reason; the
tests turn it into ``pytest.skip(reason)``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
PACKAGES = ("slurm-wlm", "munge")
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 60
MULTI_NODES = ("labn1", "labn2")
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be started here; the message says why."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _missing(commands: tuple[str, ...]) -> list[str]:
    return [c for c in commands if shutil.which(c) is None and not Path("/usr/sbin", c).exists()]


def apt_install(packages: tuple[str, ...], commands: tuple[str, ...]) -> None:
    """Install Debian ``packages`` unless every one of ``commands`` is already there.

    Raises :class:`SlurmUnavailable` saying why when it cannot (not root, no apt-get,
    apt failed). ``apt-get update`` is run only when the first install attempt fails.
    """
    if not _missing(commands):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{', '.join(_missing(commands))} not installed and not root, "
                               f"so `apt-get install {' '.join(packages)}` is impossible")
    if shutil.which("apt-get") is None:
        raise SlurmUnavailable(f"{', '.join(_missing(commands))} not installed and no apt-get here")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *packages]
    last = ""
    for step in (None, ["apt-get", "update", "-q"]):
        if step is not None:
            subprocess.run(step, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        try:
            res = subprocess.run(install, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"`{' '.join(install)}` did not finish in {APT_TIMEOUT_S} s") from None
        if res.returncode == 0 and not _missing(commands):
            return
        last = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
        last = last[0]
    raise SlurmUnavailable(f"`{' '.join(install)}` failed: {last}")


def _mem_mb() -> int:
    """Total memory in MiB from /proc/meminfo (what slurmd compares RealMemory with)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    raise SlurmUnavailable("no MemTotal in /proc/meminfo")


@dataclass
class SlurmCluster:
    """A running private cluster: its folder, config file and the daemons' processes."""

    root: Path
    conf: Path
    hostname: str
    cpus: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """The environment for client commands (sbatch, squeue, ...): ``SLURM_CONF`` set."""
        return dict(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, timeout: float = 60, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster and return its result."""
        res = subprocess.run(list(cmd), env=kw.pop("env", self.env), capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and res.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {res.returncode}: {res.stderr.strip()}")
        return res

    def log(self, name: str) -> str:
        p = self.root / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else f"(no {p})"

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, StdOut, ...); empty if unknown."""
        out = self.run("scontrol", "show", "job", "-o", job_id, check=False).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def job_state(self, job_id: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)."""
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_job(self, job_id: str, timeout_s: float) -> tuple[str, int] | None:
        """Poll (every 0.5 s) until the job ends; ``(state, exit code)``, or None on timeout.

        Faster than ``sbatch --wait``, whose polling interval grows to tens of seconds.
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            state = info.get("JobState", "UNKNOWN")
            if state in ENDED:
                return state, int(info.get("ExitCode", "0:0").split(":")[0])
            time.sleep(0.5)
        return None

    def wait_idle(self, nodes: tuple[str, ...], timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until every node in ``nodes`` reports idle; raise SlurmUnavailable if not."""
        deadline = time.monotonic() + timeout_s
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise SlurmUnavailable(f"{name} exited with {p.returncode} during start-up:\n"
                                           + "\n".join(self.log(name).splitlines()[-15:]))
            res = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=20)
            states = dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)
            if all(states.get(n, "").rstrip("*") == "idle" for n in nodes):
                return
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout_s:.0f} s: {states}")

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this cluster started (SIGTERM, then SIGKILL)."""
        if self.procs.get("slurmctld") and self.procs["slurmctld"].poll() is None:
            self.run("scancel", "--full", "--user", str(os.getuid()), check=False, timeout=20)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                res = self.run("squeue", "-h", "-o", "%i", check=False, timeout=20)
                if res.returncode != 0 or not res.stdout.strip():
                    break
                time.sleep(0.5)
        order = [n for n in self.procs if n.startswith("slurmd")] + ["slurmctld", "munged"]
        for name in order:
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)


def write_conf(root: Path, hostname: str, cpus: int, mem_mb: int) -> Path:
    """Write the cluster's ``slurm.conf`` (private ports, folders and munge socket)."""
    ctld_port, node_ports = _free_port(), [_free_port() for _ in range(1 + len(MULTI_NODES))]
    # slurmd drains a node whose configured memory exceeds what it finds: leave a margin.
    real_mb = max(1, int(mem_mb * 0.9))
    lines = [
        "ClusterName=labtest",
        f"SlurmctldHost={hostname}(127.0.0.1)",
        f"SlurmctldPort={ctld_port}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={root}/munge.socket",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool/%n",
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        # No cgroups (containers rarely allow them): processes are tracked by parentage.
        "ProctrackType=proctrack/linuxproc",
        # task/affinity binds each step to the CPUs it was given, as on real clusters, so that
        # a step confined to fewer CPUs than its job asked for shows (os.sched_getaffinity).
        "TaskPlugin=task/affinity",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "MpiDefault=none",
        "SchedulerType=sched/builtin",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "ReturnToService=2",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
        "MinJobAge=600",
        "KillWait=5",
        "Waittime=0",
        "MailProg=/bin/true",
        f"NodeName={hostname} NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs={cpus} "
        f"RealMemory={real_mb} State=UNKNOWN",
    ]
    for name, port in zip(MULTI_NODES, node_ports[1:]):
        lines.append(f"NodeName={name} NodeHostname={hostname} NodeAddr=127.0.0.1 Port={port} "
                     f"CPUs={cpus} RealMemory={real_mb} State=UNKNOWN")
    lines += [
        f"PartitionName=lab Nodes={hostname} Default=YES MaxTime=INFINITE State=UP",
        f"PartitionName=multi Nodes={','.join(MULTI_NODES)} MaxTime=INFINITE State=UP",
    ]
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start_cluster(root: Path) -> SlurmCluster:
    """Install (if needed), configure and start a private SLURM cluster under ``root``.

    Returns a :class:`SlurmCluster` whose nodes are idle. Raises :class:`SlurmUnavailable`
    with the reason when that is impossible; daemons started so far are stopped first.
    """
    if os.geteuid() != 0:
        raise SlurmUnavailable("not root: munged and slurmd must run as root in this one-machine cluster")
    apt_install(PACKAGES, DAEMONS)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # munged refuses a socket folder that others can write to
    for sub in ["state", "spool", *[f"spool/{n}" for n in MULTI_NODES]]:
        (root / sub).mkdir(parents=True, exist_ok=True)
    hostname = socket.gethostname().split(".")[0]
    (root / "spool" / hostname).mkdir(exist_ok=True)
    cpus = os.cpu_count() or 1
    conf = write_conf(root, hostname, cpus, _mem_mb())
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster = SlurmCluster(root=root, conf=conf, hostname=hostname, cpus=cpus)

    def spawn(name: str, cmd: list[str]) -> None:
        log = (root / f"{name}.log").open("wb")
        cluster.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)

    atexit.register(cluster.stop)  # also when the test session is interrupted
    try:
        spawn("munged", ["munged", "--foreground", "--force", f"--socket={root}/munge.socket",
                         f"--key-file={key}", f"--pid-file={root}/munged.pid",
                         f"--seed-file={root}/munged.seed", f"--log-file={root}/munged.file.log"])
        deadline = time.monotonic() + 20
        while not (root / "munge.socket").exists():
            if cluster.procs["munged"].poll() is not None or time.monotonic() > deadline:
                raise SlurmUnavailable("munged did not start:\n" + cluster.log("munged"))
            time.sleep(0.1)
        spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(conf)])
        for node in (hostname, *MULTI_NODES):
            spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(conf)])
        cluster.wait_idle((hostname, *MULTI_NODES))
    except BaseException:
        cluster.stop()
        raise
    return cluster
