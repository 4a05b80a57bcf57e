"""A throw-away SLURM cluster on this machine, for tests that submit the real scripts.

:func:`start_cluster` installs Debian's ``slurm-wlm`` and ``munge`` when they are missing
(root and ``apt-get`` needed), writes a private ``slurm.conf`` under a temporary folder
and starts ``munged``, ``slurmctld`` and three ``slurmd`` daemons from it:

- partition ``lab`` (the default): one node named after this machine, with
  :data:`NODE_CPUS` (2) CPUs, the smallest node docs/cluster.md's jobs must start on, and
  ``RealMemory`` from ``/proc/meminfo`` (no GPUs, no gres);
- partition ``multi``: two nodes ``labn1`` and ``labn2``, each a ``slurmd`` in network, UTS and
  mount namespaces of its own (:class:`NodeNetwork`): its own address on a bridge of this machine,
  its own hostname, and an ``/etc/hosts`` that names both nodes, as on a real cluster. So a
  ``--nodes=2`` job really gets two nodes that reach each other only over their addresses. Where
  the namespaces cannot be made, there is no ``multi`` partition and
  :attr:`SlurmCluster.multi_why` says why (the two-node tests skip with it).

Jobs are tracked with ``proctrack/cgroup`` and bound to their CPUs with ``task/cgroup``
(``ConstrainCores``), as on most clusters (SLURM signals every process of the job at once, and a
process that leaves the job's process tree is still the job's), where this machine allows it
(:func:`cgroup_plugin`, then a job on each partition that checks its own cgroup); elsewhere with
``proctrack/linuxproc`` and ``task/affinity``, and :attr:`SlurmCluster.proctrack_why` says why.

Nothing outside the temporary folder is touched except the package installation, with cgroups
the daemons' cgroups (``/sys/fs/cgroup/<controller>/slurm_<node>``), and for the two nodes their
namespaces and links (named after this process, removed by :meth:`SlurmCluster.stop`). The daemons
use their own ports, munge socket and key, state and spool folders, and every client command
must be given ``SLURM_CONF`` (see :attr:`SlurmCluster.env`). :meth:`SlurmCluster.stop` cancels
the jobs, stops the daemons it started (by pid) and removes their (empty) cgroups.

When SLURM cannot be started (not root, no ``apt-get``, installation or start-up
failed), :func:`start_cluster` raises :class:`SlurmUnavailable` with the reason; the
tests turn it into ``pytest.skip(reason)``.
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from lab_utils.engine.dist import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo", "srun")
PACKAGES = ("slurm-wlm", "munge")
APT_TIMEOUT_S = 300
START_TIMEOUT_S = 60
MULTI_NODES = ("labn1", "labn2")
NODE_CPUS = 2  # every node's CPUs, whatever this machine has: a 2-CPU node, as in CI
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
         "BOOT_FAIL", "DEADLINE")


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be started here; the message says why."""


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


def _ip(*args: str) -> None:
    """``ip ARGS``; :class:`SlurmUnavailable` with ip's own words when it fails."""
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise SlurmUnavailable(f"`ip {' '.join(args)}` failed: {(res.stderr or res.stdout).strip()}")


@dataclass
class NodeNetwork:
    """The two-node partition's network: a bridge on this machine with an address of its own
    (:attr:`host_addr`: slurmctld is reached there), and per node a network namespace holding one
    end of a veth pair, the other end on the bridge, with the node's address (:attr:`addrs`).

    :meth:`command` runs a program as that node: in its network namespace, with its hostname (UTS
    namespace) and its ``/etc/hosts`` (bind-mounted in a mount namespace of its own whose mounts
    follow this machine's, so the cgroup hierarchies and every folder stay visible)."""

    tag: str                    # the prefix of every name made here (the process id: unique per run)
    subnet: str                 # "10.231.N"
    hostname: str               # this machine's, which the nodes' hosts file gives host_addr
    hosts: Path
    nodes: tuple[str, ...] = MULTI_NODES

    @property
    def bridge(self) -> str:
        return f"{self.tag}br"

    @property
    def host_addr(self) -> str:
        return f"{self.subnet}.1"

    @property
    def addrs(self) -> dict[str, str]:
        return {node: f"{self.subnet}.{i + 2}" for i, node in enumerate(self.nodes)}

    def namespace(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def command(self, node: str, cmd: list[str]) -> list[str]:
        """``cmd`` as ``node`` (see the class docstring); ``exec`` all the way, so its pid is cmd's."""
        return ["nsenter", f"--net=/run/netns/{self.namespace(node)}", "unshare", "--uts", "--mount",
                "--propagation", "slave", "sh", "-c",
                'hostname "$1" && mount --bind "$2" /etc/hosts && shift 2 && exec "$@"', "sh", node,
                str(self.hosts), *cmd]

    def remove(self) -> None:
        """Remove the namespaces (their veth ends go with them, and so do the bridge's) and the bridge."""
        for node in self.nodes:
            subprocess.run(["ip", "netns", "delete", self.namespace(node)], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True, timeout=30)


def _free_subnet() -> str:
    """A 10.231.N.0/24 that no address or route of this machine is in."""
    used = subprocess.run(["ip", "-4", "-o", "addr"], capture_output=True, text=True, timeout=30).stdout
    used += subprocess.run(["ip", "-4", "route"], capture_output=True, text=True, timeout=30).stdout
    for n in [os.getpid() % 200 + 20, *range(20, 220)]:
        if f"10.231.{n}." not in used:
            return f"10.231.{n}"
    raise SlurmUnavailable("no free 10.231.N.0/24 subnet for the two nodes")


def _remove_stale_networks() -> None:
    """Namespaces and links of earlier runs whose process is gone (killed before it could clean up):
    their names start with ``lt<pid>`` (:attr:`NodeNetwork.tag`)."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout.split()
    names += re.findall(r"^\d+: ([^:@\s]+)", subprocess.run(["ip", "-o", "link"], capture_output=True,
                                                            text=True, timeout=30).stdout, re.M)
    for name in names:
        m = re.fullmatch(r"lt(\d+)(-labn\d+|br|v\d+|p\d+)", name)
        if m is None or int(m.group(1)) == os.getpid() or Path(f"/proc/{m.group(1)}").exists():
            continue
        kind = ("netns", "delete") if m.group(2).startswith("-") else ("link", "delete")
        subprocess.run(["ip", *kind, name], capture_output=True, timeout=30)


def make_node_network(root: Path, hostname: str) -> NodeNetwork:
    """The namespaces, links and addresses of the two nodes (:class:`NodeNetwork`), or
    :class:`SlurmUnavailable` saying why not (made so far is removed first)."""
    apt_install(("iproute2",), ("ip",))  # Debian's `ip`, as slurm-wlm and munge: installed when missing
    missing = [c for c in ("ip", "nsenter", "unshare", "mount") if shutil.which(c) is None]
    if missing:
        raise SlurmUnavailable(f"{', '.join(missing)} not found on PATH")
    _remove_stale_networks()
    net = NodeNetwork(tag=f"lt{os.getpid()}", subnet=_free_subnet(), hostname=hostname,
                      hosts=root / "hosts")
    lines = ["127.0.0.1 localhost", f"{net.host_addr} {hostname}",
             *[f"{addr} {node}" for node, addr in net.addrs.items()]]
    net.hosts.write_text("\n".join(lines) + "\n")
    try:
        _ip("link", "add", net.bridge, "type", "bridge")
        _ip("addr", "add", f"{net.host_addr}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for i, (node, addr) in enumerate(net.addrs.items()):
            ns, outside = net.namespace(node), f"{net.tag}v{i}"
            _ip("netns", "add", ns)
            _ip("link", "add", outside, "type", "veth", "peer", "name", f"{net.tag}p{i}")
            _ip("link", "set", f"{net.tag}p{i}", "netns", ns)
            _ip("-n", ns, "link", "set", f"{net.tag}p{i}", "name", "eth0")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", outside, "master", net.bridge)
            _ip("link", "set", outside, "up")
    except BaseException:
        net.remove()
        raise
    return net


@dataclass
class SlurmCluster:
    """A running private cluster: its folder, config file and the daemons' processes."""

    root: Path
    conf: Path
    hostname: str
    cpus: int
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    proctrack: str = "linuxproc"  # how slurmd tracks a job's processes: "cgroup" or "linuxproc"
    proctrack_why: str = ""  # the cgroup plugin used, or why linuxproc
    network: NodeNetwork | None = None  # the two nodes' namespaces; None: no partition "multi"
    multi_why: str = ""  # why there are no two nodes (empty: there are)

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

    def check_cgroup_tracking(self, timeout_s: float = 60) -> None:
        """A job on each partition reads its own ``/proc/self/cgroup``: it must be in a cgroup
        named after the job (``.../job_<id>/...``). Raises :class:`SlurmUnavailable` otherwise."""
        for extra in ([], *([["--partition=multi"]] if self.network else [])):
            out = self.root / f"cgroup-probe{len(extra)}.out"
            res = self.run("sbatch", "--parsable", f"--output={out}", *extra, "--wrap",
                           "cat /proc/self/cgroup", check=False)
            job_id = res.stdout.strip()
            if res.returncode != 0 or not job_id.isdigit():
                raise SlurmUnavailable(f"sbatch failed: {res.stderr.strip()}")
            if self.wait_job(job_id, timeout_s) != ("COMPLETED", 0):
                raise SlurmUnavailable(f"the probe job {job_id} ended {self.job_state(job_id)}: "
                                       + "\n".join(self.log(f"slurmd-{self.hostname}").splitlines()[-10:]))
            text = out.read_text() if out.exists() else ""
            if f"/job_{job_id}/" not in text:
                raise SlurmUnavailable(f"the probe job {job_id} is not in a cgroup of its own: "
                                       f"{text.strip()!r}")

    def stop(self, keep_network: bool = False) -> None:
        """Cancel every job, then stop the daemons this cluster started (SIGTERM, then SIGKILL), and
        remove the two nodes' namespaces and links unless ``keep_network``."""
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
        if self.proctrack == "cgroup":  # slurmd leaves its cgroup v1 folders behind, empty
            for node in self.nodes:
                for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{node}"):
                    for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                        _rmdir(d)
                    _rmdir(top)
        if self.network is not None and not keep_network:
            self.network.remove()

    @property
    def nodes(self) -> tuple[str, ...]:
        return (self.hostname, *(MULTI_NODES if self.network else ()))

    def check_two_nodes(self, timeout_s: float = 60) -> None:
        """A two-node job on partition ``multi`` prints each node's hostname and address: two nodes,
        each with its own name and its address from the nodes' hosts file, reached over the network
        (srun on the first node starts the task on the second, whose output comes back to it).
        Raises :class:`SlurmUnavailable` otherwise."""
        out = self.root / "two-nodes-probe.out"
        script = self.root / "two-nodes-probe.sh"
        script.write_text("#!/bin/bash\nsrun --nodes=2 --ntasks-per-node=1 bash -c "
                          "'echo \"$(hostname) $(getent hosts \"$(hostname)\" | cut -d\" \" -f1)\"'\n")
        res = self.run("sbatch", "--parsable", "--partition=multi", "--nodes=2", "--ntasks-per-node=1",
                       f"--output={out}", str(script), check=False)
        job_id = res.stdout.strip()
        if res.returncode != 0 or not job_id.isdigit():
            raise SlurmUnavailable(f"sbatch of the two-node probe failed: {res.stderr.strip()}")
        ended = self.wait_job(job_id, timeout_s)
        seen = sorted(out.read_text().split("\n")) if out.exists() else []
        want = sorted(f"{node} {addr}" for node, addr in self.network.addrs.items())
        if ended != ("COMPLETED", 0) or [line for line in seen if line] != want:
            raise SlurmUnavailable(f"the two-node probe job {job_id} ended {ended}, printing {seen} "
                                   f"instead of {want}")


def cgroup_plugin(mounts: str | None = None) -> tuple[str | None, str]:
    """The cgroup plugin SLURM 22.05 can use here for ``proctrack/cgroup``, or None; and why.

    ``cgroup/v1`` needs a cgroup v1 ``freezer`` hierarchy in which this process (root) can create
    a cgroup; ``cgroup/v2`` a cgroup v2 file system at ``/sys/fs/cgroup`` it can write to (slurmd
    then runs without systemd: ``IgnoreSystemd=yes``). ``mounts``: ``/proc/mounts``'s text.
    """
    if mounts is None:
        mounts = Path("/proc/mounts").read_text()
    table = [line.split()[1:4] for line in mounts.splitlines() if len(line.split()) >= 4]
    if any(point == "/sys/fs/cgroup" and fstype == "cgroup2" for point, fstype, _ in table):
        if os.access("/sys/fs/cgroup/cgroup.subtree_control", os.W_OK):
            return "cgroup/v2", "cgroup v2 at /sys/fs/cgroup"
        return None, "cgroup v2 at /sys/fs/cgroup, but not writable here"
    freezer = next((point for point, fstype, opts in table
                    if fstype == "cgroup" and "freezer" in opts.split(",")), None)
    if freezer is None:
        return None, "no cgroup v1 freezer hierarchy and no cgroup v2 at /sys/fs/cgroup"
    if Path(freezer).parent != Path("/sys/fs/cgroup"):
        return None, f"the cgroup v1 freezer is mounted at {freezer}, not under /sys/fs/cgroup"
    probe = Path(freezer) / f"labtest_probe_{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        return None, f"cannot create a cgroup under {freezer}: {e.strerror}"
    return "cgroup/v1", f"cgroup v1 (freezer at {freezer})"


def write_cgroup_conf(root: Path, plugin: str) -> Path:
    """``cgroup.conf`` beside ``slurm.conf`` (slurmd reads it from there): cgroups track processes
    (proctrack/cgroup) and confine each job to its cores (task/cgroup, ``ConstrainCores``), as on
    most clusters; memory and devices are not constrained."""
    lines = [f"CgroupPlugin={plugin}", "CgroupMountpoint=/sys/fs/cgroup", "ConstrainCores=yes",
             "ConstrainRAMSpace=no", "ConstrainSwapSpace=no", "ConstrainDevices=no"]
    if plugin == "cgroup/v2":
        lines.append("IgnoreSystemd=yes")  # no systemd in containers and CI: slurmd makes its own subtree
    path = root / "cgroup.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def _rmdir(path: Path) -> None:
    """Remove an empty cgroup folder (one still holding a process stays)."""
    try:
        path.rmdir()
    except OSError:
        pass


def write_conf(root: Path, hostname: str, cpus: int, mem_mb: int, proctrack: str = "linuxproc",
               network: NodeNetwork | None = None) -> Path:
    """Write the cluster's ``slurm.conf`` (private ports, folders and munge socket).

    ``proctrack``: ``cgroup`` (most clusters: a job's processes are the members of its cgroup, and
    all of them are signalled at once; task/cgroup confines them to their cores) or ``linuxproc``
    (processes tracked by parentage, so one that leaves the tree escapes the job; task/affinity
    binds them). ``network``: the two nodes of partition ``multi``, at their own addresses, which
    reach slurmctld at the bridge's (None: no such partition).
    """
    ports: list[int] = []
    for _ in range(2 + (len(network.nodes) if network else 0)):  # bound seconds later: see free_port
        ports.append(free_port(avoid=ports))
    ctld_port, *node_ports = ports
    # slurmd drains a node whose configured memory exceeds what it finds: leave a margin.
    real_mb = max(1, int(mem_mb * 0.9))
    lines = [
        "ClusterName=labtest",
        f"SlurmctldHost={hostname}({network.host_addr if network else '127.0.0.1'})",
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
        f"ProctrackType=proctrack/{proctrack}",
        # each step is bound to the CPUs it was given, as on real clusters, so that a step confined
        # to fewer CPUs than its job asked for shows (os.sched_getaffinity)
        f"TaskPlugin={'task/cgroup,task/affinity' if proctrack == 'cgroup' else 'task/affinity'}",
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
        # A node may claim more CPUs than this machine has (NODE_CPUS on a 1-CPU machine).
        "SlurmdParameters=config_overrides",
        # SLURM's default: the seconds between SIGTERM and SIGKILL when a job is stopped (a time
        # limit, scancel, a requeue), which the runner needs to save the executed copy and the report.
        "KillWait=30",
        "Waittime=0",
        "MailProg=/bin/true",
        f"NodeName={hostname} NodeAddr=127.0.0.1 Port={node_ports[0]} CPUs={cpus} "
        f"RealMemory={real_mb} State=UNKNOWN",
    ]
    lines.append(f"PartitionName=lab Nodes={hostname} Default=YES MaxTime=INFINITE State=UP")
    if network is not None:
        for (name, addr), port in zip(network.addrs.items(), node_ports[1:], strict=True):
            lines.append(f"NodeName={name} NodeAddr={addr} Port={port} CPUs={cpus} RealMemory={real_mb} "
                         "State=UNKNOWN")
        lines.append(f"PartitionName=multi Nodes={','.join(network.nodes)} MaxTime=INFINITE State=UP")
    conf = root / "slurm.conf"
    conf.write_text("\n".join(lines) + "\n")
    return conf


def start_cluster(root: Path, proctrack: str = "auto", two_nodes: bool = True) -> SlurmCluster:
    """Install (if needed), configure and start a private SLURM cluster under ``root``.

    ``proctrack``: ``auto`` tries ``proctrack/cgroup`` where :func:`cgroup_plugin` finds a
    plugin, checks with a job that the job's processes are in its cgroup, and otherwise (or when
    that fails) starts again with ``proctrack/linuxproc``; ``cgroup`` or ``linuxproc`` insist.
    ``two_nodes``: partition ``multi``'s two nodes in namespaces of their own, checked by a
    two-node job; where that fails, the cluster starts without them and
    :attr:`SlurmCluster.multi_why` says why. Returns a :class:`SlurmCluster` whose nodes are idle.
    Raises :class:`SlurmUnavailable` with the reason when that is impossible; daemons started so
    far are stopped first.
    """
    if os.geteuid() != 0:
        raise SlurmUnavailable("not root: munged and slurmd must run as root in this one-machine cluster")
    apt_install(PACKAGES, DAEMONS)
    root.mkdir(parents=True, exist_ok=True)
    network, multi_why = None, "not asked for"
    if two_nodes:
        try:
            network = make_node_network(root, socket.gethostname().split(".")[0])
        except SlurmUnavailable as e:
            multi_why = f"no network namespaces for two nodes here: {e}"
    while True:
        try:
            cluster = _start_tracked(root, proctrack, network)
        except SlurmUnavailable as e:
            if network is None:
                raise
            network.remove()
            network, multi_why = None, f"the two nodes in namespaces of their own did not start: {e}"
            continue
        break
    if network is not None:
        try:
            cluster.check_two_nodes()
            multi_why = ""
        except SlurmUnavailable as e:
            multi_why = str(e)
    cluster.multi_why = multi_why
    return cluster


def _start_tracked(root: Path, proctrack: str, network: NodeNetwork | None) -> SlurmCluster:
    """:func:`start_cluster`'s choice of ``proctrack/cgroup`` or ``linuxproc`` (see there)."""
    plugin, why = cgroup_plugin() if proctrack != "linuxproc" else (None, "linuxproc asked for")
    if plugin is not None:
        try:
            cluster = _start(root / "cgroup", plugin, network)
        except SlurmUnavailable as e:
            why = f"proctrack/cgroup with {plugin} did not start here: {e}"
        else:
            try:
                cluster.check_cgroup_tracking()
                cluster.proctrack_why = f"{plugin}: {why}"
                return cluster
            except SlurmUnavailable as e:
                cluster.stop(keep_network=True)
                why = f"proctrack/cgroup with {plugin} did not track a job here: {e}"
    if proctrack == "cgroup":
        raise SlurmUnavailable(f"proctrack/cgroup impossible: {why}")
    cluster = _start(root / "linuxproc", None, network)
    cluster.proctrack_why = why
    return cluster


def _start(root: Path, cgroup: str | None, network: NodeNetwork | None) -> SlurmCluster:
    """Configure and start the daemons under ``root``: proctrack/cgroup with the ``cgroup``
    plugin (``cgroup/v1``, ``cgroup/v2``), or proctrack/linuxproc when None; the two nodes of
    ``network`` in their namespaces (none when None)."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o711)  # munged refuses a socket folder that others can write to
    for sub in ["state", "spool", *[f"spool/{n}" for n in (network.nodes if network else ())]]:
        (root / sub).mkdir(parents=True, exist_ok=True)
    hostname = socket.gethostname().split(".")[0]
    (root / "spool" / hostname).mkdir(exist_ok=True)
    conf = write_conf(root, hostname, NODE_CPUS, _mem_mb(), "cgroup" if cgroup else "linuxproc", network)
    if cgroup:
        write_cgroup_conf(root, cgroup)
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    cluster = SlurmCluster(root=root, conf=conf, hostname=hostname, cpus=NODE_CPUS,
                           proctrack="cgroup" if cgroup else "linuxproc", network=network)

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
        for node in cluster.nodes:
            slurmd = ["slurmd", "-D", "-N", node, "-f", str(conf)]
            spawn(f"slurmd-{node}", network.command(node, slurmd) if node in MULTI_NODES else slurmd)
        cluster.wait_idle(cluster.nodes)
    except BaseException:
        cluster.stop(keep_network=True)  # start_cluster removes it, or tries without it
        raise
    return cluster
