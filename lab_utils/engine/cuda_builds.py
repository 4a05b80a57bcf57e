"""Which torch build a node can run: the NVIDIA driver, and the CUDA variant that fits it.

The lab's one table of torch builds (:data:`VARIANTS`, sources cited there) and the one way to
read the driver (:func:`query_driver`), standard library only: ``tools/cuda_wheels.py`` imports
it before the lab's packages exist (``make venv``), and :mod:`lab_utils.engine.environment` names
the fix when this torch cannot use the node's GPUs. ``requirements.txt`` and ``constraints.txt``
give the tested torch/torchvision pair; this module decides *which build* of it a driver runs:

- no NVIDIA driver here (no ``nvidia-smi``, no ``/proc/driver/nvidia/version``): PyPI's build;
- a driver: the newest CUDA build in :data:`VARIANTS` that it runs *and* that has kernels for
  every GPU's compute capability (:func:`arch_runs`; a V100, sm_70, needs the CUDA 12.6 build):
  PyPI's build when it fits, else PyTorch's wheel index (or ``$LAB_PYTORCH_INDEX``, a mirror);
- ``TORCH_VARIANT=cu126|cu130|cu132|cpu|pypi|<index URL>|auto`` forces one.
"""

from __future__ import annotations

import operator
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PYTORCH_INDEX = "https://download.pytorch.org/whl"
NVIDIA_SMI_TIMEOUT_S = 10.0


# --------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Variant:
    """One build of the tested torch release: ``name`` is its folder in PyTorch's wheel index and its
    wheels' local label (``torch==2.14.1+cu126``); ``min_driver`` the oldest Linux driver that runs it
    (the floor of its CUDA major), ``toolkit_driver`` the one its CUDA release shipped with; ``auto``:
    picked by driver and GPU; ``archs`` as ``torch.cuda.get_arch_list()`` reports them (``sm_XY``:
    kernels for compute capability X.Y; ``compute_XY``: PTX, compiled on load).
    """

    name: str
    cuda: str | None
    min_driver: str | None
    toolkit_driver: str | None = None
    auto: bool = False
    on_pypi: bool = False
    archs: tuple[str, ...] = ()


# The one table of builds and driver minimums, newest CUDA first.
# Sources (checked while writing it; download.pytorch.org itself was not reachable, so the
# index contents for torch 2.14.1 could not be listed):
# - Which CUDA builds exist for torch 2.14: PyTorch's RELEASE.md, "Release Compatibility
#   Matrix": 2.14 -> stable CUDA 12.6 (cuDNN 9.10.2.21, NCCL 2.29.3), CUDA 13.0 (cuDNN
#   9.24.0.43, NCCL 2.30.7), CUDA 13.2. PyPI's torch 2.14.1 is the CUDA 13.0 build (its
#   dependencies are nvidia-*-cu13, nvidia-nccl-cu13 2.30.7).
# - min_driver: NVIDIA, "CUDA Compatibility", section Minor Version Compatibility, table
#   "CUDA Toolkit 11.x, 12.x, and 13.x Driver Version Ranges": CUDA 13.x needs >= 580,
#   CUDA 12.x >= 525 (525.60.13 on Linux in the CUDA 12 release notes' minor-version table).
# - toolkit_driver: NVIDIA CUDA Toolkit Release Notes, table "CUDA Toolkit and
#   Corresponding Driver Versions": CUDA 12.6 GA >= 560.28.03, CUDA 13.0 GA >= 580.65.06.
# - archs (each build's architecture list, Linux x86_64), from PyTorch's RELEASE.md "PyTorch CUDA
#   Support Matrix" for release 2.14 (pytorch/pytorch#197555, "the same" for 2.12-2.14; rows added in
#   #182849): CUDA 12.6.3 Maxwell(5.0), Pascal(6.0), Volta(7.0), Turing(7.5), Ampere(8.0, 8.6),
#   Hopper(9.0); CUDA 13.0.2 and 13.2.1 Turing(7.5), Ampere(8.0, 8.6), Hopper(9.0), Blackwell(10.0,
#   12.0+PTX). The builds' TORCH_CUDA_ARCH_LIST is in .ci/manywheel/build_cuda.sh: base
#   "7.0;7.5;8.0;8.6;9.0", "12.6) 5.0;6.0;${base}" ("Only 12.6 includes Legacy Maxwell/Pascal"),
#   "13.0) 7.5;8.0;8.6;9.0;10.0;12.0+PTX". PyPI's torch 2.14.1+cu130 as installed by this lab's
#   `make venv` reports torch.cuda.get_arch_list() == ['sm_75', 'sm_80', 'sm_86', 'sm_90', 'sm_100',
#   'sm_120'] (PTX is not listed by torch; compute_120 here keeps the matrix's "+PTX"). Volta was
#   dropped from the CUDA 12.8 builds in 2.11 (pytorch/pytorch#172352): from then on a V100 needs cu126.
# cu132 is published but not tested here: used only when forced (TORCH_VARIANT=cu132).
_CUDA13_ARCHS = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120", "compute_120")
VARIANTS: tuple[Variant, ...] = (
    Variant("cu132", "13.2", "580", None, auto=False, archs=_CUDA13_ARCHS),
    Variant("cu130", "13.0", "580", "580.65.06", auto=True, on_pypi=True, archs=_CUDA13_ARCHS),
    Variant("cu126", "12.6", "525.60.13", "560.28.03", auto=True,
            archs=("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")),
    Variant("cpu", None, None, None, auto=False),
)
# The floor of each CUDA major (minor-version compatibility), for torch builds not in the table.
CUDA_MAJOR_MIN_DRIVER = {"13": "580", "12": "525.60.13", "11": "450.80.02"}


def pytorch_index() -> str:
    """PyTorch's wheel index, or the mirror ``$LAB_PYTORCH_INDEX`` names (its folders: cu126, cu130, ...)."""
    return (os.environ.get("LAB_PYTORCH_INDEX") or PYTORCH_INDEX).rstrip("/")


def _arch_number(arch: str) -> tuple[str, int] | None:
    """``"sm_86"`` -> ("sm", 86), ``"compute_120"`` -> ("compute", 120), ``"sm_90a"`` -> ("sm", 90)."""
    m = re.fullmatch(r"(sm|compute)_(\d+)[a-z]?", arch.strip())
    return (m.group(1), int(m.group(2))) if m else None


def sm_name(compute_cap: str) -> str:
    """``"7.0"`` -> ``"sm_70"``."""
    major, minor = compute_cap.split(".")[:2]
    return f"sm_{int(major)}{int(minor)}"


def arch_runs(compute_cap: str, archs: Iterable[str]) -> bool:
    """True when a build with architecture list ``archs`` has kernels for a GPU of ``compute_cap`` ("7.0").

    CUDA's rules (CUDA C++ Programming Guide, "Binary Compatibility" and "PTX Compatibility"): a cubin
    for sm_XY runs on compute capability X.Z with Z >= Y (same major); PTX for compute_XY is compiled
    on load for any compute capability >= X.Y. (torch's own start-up check only compares the major,
    so it accepts a CUDA 13 build, sm_75, on a V100, sm_70, where every kernel then fails with "no
    kernel image is available".)
    """
    major, minor = (int(x) for x in compute_cap.split(".")[:2])
    parsed = [p for a in archs if (p := _arch_number(a))]
    return any((kind == "sm" and n // 10 == major and n % 10 <= minor)
               or (kind == "compute" and n <= major * 10 + minor) for kind, n in parsed)


def arch_summary(archs: Sequence[str]) -> str:
    """``"sm_75 and later"`` style: the lowest kernel architecture of a list."""
    sms = sorted(n for a in archs if (p := _arch_number(a)) and p[0] == "sm" for n in [p[1]])
    return f"sm_{sms[0]} and later" if sms else "no GPU kernels"


def variant_named(name: str) -> Variant | None:
    return next((v for v in VARIANTS if v.name == name), None)


def min_driver_for_cuda(cuda: str | None) -> str | None:
    """The oldest driver that runs a torch built for ``cuda`` (e.g. ``"13.0"``), if known."""
    if not cuda:
        return None
    known = next((v.min_driver for v in VARIANTS if v.cuda == cuda), None)
    return known or CUDA_MAJOR_MIN_DRIVER.get(cuda.split(".")[0])


# --------------------------------------------------------------------------- versions


_VERSION = re.compile(
    r"^\s*v?(?:\d+!)?(?P<release>\d+(?:\.\d+)*)"
    r"(?P<pre>[-_.]?(?:a|b|c|rc|alpha|beta|pre|preview)[-_.]?\d*)?"
    r"(?P<post>[-_.]?(?:post|rev|r)[-_.]?\d*)?"
    r"(?P<dev>[-_.]?dev[-_.]?\d*)?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$", re.I)


@dataclass(frozen=True)
class Version:
    """A PEP 440 version reduced to what these checks need (release, pre-release, local)."""

    release: tuple[int, ...]
    pre: bool = False
    post: bool = False
    local: str = ""

    def key(self, width: int = 4) -> tuple:
        rel = self.release + (0,) * max(0, width - len(self.release))
        return (*rel, 0 if self.pre else (2 if self.post else 1))


def parse_version(text: str) -> Version:
    """``"2.14.1+cu126"`` -> Version((2, 14, 1), local="cu126"); ValueError if unreadable."""
    m = _VERSION.match(str(text))
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return Version(tuple(int(p) for p in m["release"].split(".")), pre=bool(m["pre"] or m["dev"]),
                   post=bool(m["post"]), local=(m["local"] or "").lower())


def version_satisfies(version: str, spec: str) -> bool:
    """True when ``version`` meets every clause of ``spec`` (``">=2.4,<2.16"``; empty: anything).

    Enough of PEP 440 for requirement ranges: ``== != >= <= > < ~=``, ``==X.*``; a local label
    (``+cu126``) is ignored unless the clause names one; ``<V`` excludes V's pre-releases.
    """
    v = parse_version(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = re.match(r"^(===|==|!=|~=|>=|<=|>|<)\s*(\S+)$", clause)
        if not m:
            raise ValueError(f"cannot read the version clause {clause!r}")
        op, target = m.groups()
        if not _clause_holds(v, op, target):
            return False
    return True


_ORDER = {">=": operator.ge, "<=": operator.le, ">": operator.gt}


def _clause_holds(v: Version, op: str, target: str) -> bool:
    if op in ("==", "!=", "===") and target.endswith(".*"):
        prefix = tuple(int(p) for p in target[:-2].split("."))
        equal = v.release[:len(prefix)] + (0,) * max(0, len(prefix) - len(v.release)) == prefix
        return equal if op != "!=" else not equal
    t = parse_version(target)
    w = max(len(v.release), len(t.release))
    if op in ("==", "===", "!="):
        equal = v.key(w) == t.key(w) and (not t.local or v.local == t.local)
        return equal if op != "!=" else not equal
    if op in _ORDER:
        return _ORDER[op](v.key(w), t.key(w))
    if op == "<":
        same_release = v.key(w)[:-1] == t.key(w)[:-1]
        return v.key(w) < t.key(w) and not (v.pre and same_release and not t.pre)
    # ~=X.Y.Z: >= X.Y.Z and == X.Y.*
    prefix = t.release[:-1] if len(t.release) > 1 else t.release
    return v.key(w) >= t.key(w) and v.release[:len(prefix)] == prefix


def driver_at_least(driver: str, minimum: str) -> bool:
    """Compare NVIDIA driver versions (``"535.183.01" >= "525.60.13"``)."""
    return version_satisfies(driver, f">={minimum}")


# --------------------------------------------------------------------------- requirements


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_requirements(path: str | Path) -> dict[str, str]:
    """``{normalized name: version spec}`` (``""`` for none) from a requirements or constraints file;
    comments, options (``-r``, ``--index-url``) and environment markers are skipped."""
    out: dict[str, str] = {}
    for raw in Path(path).read_text(encoding="utf-8").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        if not line or line.startswith("-"):
            continue
        line = line.split(";", 1)[0].strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[[^\]]*\])?\s*(.*)$", line)
        if m:
            out[normalize(m.group(1))] = m.group(2).replace(" ", "")
    return out


def pinned_version(constraints: dict[str, str], name: str) -> str | None:
    """The ``==`` pin of ``name`` in a constraints mapping, or None."""
    m = re.fullmatch(r"==([^,*]+)", constraints.get(normalize(name), ""))
    return m.group(1) if m else None


# --------------------------------------------------------------------------- the driver


@dataclass
class DriverGPU:
    index: int
    name: str
    memory_mib: int | None = None
    compute_cap: str | None = None     # "7.0" (nvidia-smi --query-gpu=compute_cap), None if not reported
    compute_mode: str | None = None    # "Default", "Exclusive_Process", "Prohibited"


@dataclass
class Driver:
    """The NVIDIA driver of this machine and the GPUs it reports."""

    version: str | None
    gpus: list[DriverGPU] = field(default_factory=list)
    source: str = "nvidia-smi"
    note: str = ""  # e.g. why nvidia-smi could not be used

    def gpu_list(self) -> str:
        names = sorted({g.name for g in self.gpus})
        return f"{len(self.gpus)} GPU{'s' if len(self.gpus) != 1 else ''}" + (
            f" ({', '.join(names)})" if names else "")

    def describe(self) -> str:
        """``NVIDIA driver 535.183.01 reports 4 GPUs (NVIDIA A100-SXM4-80GB)``."""
        return f"NVIDIA driver {self.version or 'of unknown version'} reports {self.gpu_list()}"


SMI_QUERY = ["--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"]
# A query of its own: drivers before compute_cap existed (R510) refuse a query that names it.
SMI_CAPS = ["--query-gpu=index,compute_cap,compute_mode", "--format=csv,noheader"]


def _add_caps(exe: str, driver: Driver, timeout_s: float) -> None:
    """Each GPU's compute capability and compute mode, where nvidia-smi reports them."""
    try:
        res = subprocess.run([exe, *SMI_CAPS], capture_output=True, text=True, timeout=timeout_s)
    except (subprocess.TimeoutExpired, OSError):
        return
    if res.returncode != 0:
        return
    by_index = {g.index: g for g in driver.gpus}
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 3 and parts[0].isdigit() and int(parts[0]) in by_index:
            g = by_index[int(parts[0])]
            g.compute_cap = parts[1] if re.fullmatch(r"\d+\.\d+", parts[1]) else None
            g.compute_mode = parts[2] or None


def _from_nvidia_smi(exe: str, timeout_s: float) -> tuple[Driver | None, str]:
    try:
        res = subprocess.run([exe, *SMI_QUERY], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"nvidia-smi did not answer within {timeout_s:.0f} s"
    except OSError as e:
        return None, f"nvidia-smi could not be run ({e.strerror or e})"
    if res.returncode != 0:
        first = (res.stdout + res.stderr).strip().splitlines()[:1] or [f"exit code {res.returncode}"]
        if "no devices were found" in first[0].lower():
            return Driver(None, [], "nvidia-smi", note="nvidia-smi: no devices were found"), ""
        return None, f"nvidia-smi failed: {first[0]}"
    rows = [p for p in ([x.strip() for x in line.split(",")] for line in res.stdout.strip().splitlines())
            if len(p) >= 4 and p[0].isdigit()]
    gpus = [DriverGPU(index=int(p[0]), name=p[1], memory_mib=int(p[2]) if p[2].isdigit() else None)
            for p in rows]
    version = next((p[3] for p in rows if p[3]), None)
    if not gpus:
        return Driver(version=None, gpus=[], source="nvidia-smi", note="nvidia-smi listed no GPUs"), ""
    driver = Driver(version=version, gpus=gpus, source="nvidia-smi")
    _add_caps(exe, driver, timeout_s)
    return driver, ""


def _from_proc(proc_root: Path) -> Driver | None:
    try:
        text = (proc_root / "version").read_text(errors="replace")
    except OSError:
        return None
    m = (re.search(r"Kernel Module[^\d]*?(\d+\.\d+(?:\.\d+)?)", text)
         or re.search(r"\b(\d{3}\.\d+(?:\.\d+)?)\b", text))
    gpus = []
    for i, info in enumerate(sorted((proc_root / "gpus").glob("*/information"))):
        try:
            model = re.search(r"^Model:\s*(.+)$", info.read_text(errors="replace"), re.M)
        except OSError:
            model = None
        gpus.append(DriverGPU(index=i, name=model.group(1).strip() if model else "unknown GPU"))
    return Driver(version=m.group(1) if m else None, gpus=gpus, source=str(proc_root / "version"))


def query_driver(timeout_s: float = NVIDIA_SMI_TIMEOUT_S,
                 proc_root: str | Path = "/proc/driver/nvidia") -> Driver | None:
    """This machine's NVIDIA driver and GPUs, or None when there is no driver at all.

    Asks ``nvidia-smi`` (bounded by ``timeout_s``); where it is missing or fails (a
    container without it), reads ``/proc/driver/nvidia/version`` and ``gpus/*/information``.
    """
    note = "nvidia-smi is not on PATH"
    exe = shutil.which("nvidia-smi")
    if exe:
        driver, note = _from_nvidia_smi(exe, timeout_s)
        if driver is not None and (driver.version or not Path(proc_root, "version").exists()):
            return driver
    proc = _from_proc(Path(proc_root))
    if proc is not None:
        proc.note = note
    return proc


# --------------------------------------------------------------------------- the choice


class NoVariant(ValueError):
    """No build of the tested torch release runs on this driver (message says what to do)."""


@dataclass(frozen=True)
class Choice:
    """Which torch build to install, from where, and why (one sentence)."""

    variant: str                # "cu126", "cu130", "cpu", "pypi" (no driver here), "custom"
    index_url: str | None       # None: PyPI, as `pip install -r requirements.txt` does
    label: str | None           # local label the installed torch must carry ("" = PyPI's); None: unknown
    reason: str
    forced: bool = False


def _oldest_auto() -> Variant:
    auto = (v for v in VARIANTS if v.auto and v.min_driver)
    return min(auto, key=lambda v: parse_version(v.min_driver).key())


def _by_name(name: str, reason: str, forced: bool) -> Choice:
    v = variant_named(name)
    if v is not None and v.on_pypi and not forced:
        return Choice(name, None, "", reason, forced)
    return Choice(name, f"{pytorch_index()}/{name}", name, reason, forced)


def _lacking(v: Variant, gpus: Sequence[DriverGPU]) -> list[DriverGPU]:
    """The GPUs (with a known compute capability) that build ``v`` has no kernels for."""
    return [g for g in gpus if g.compute_cap and not arch_runs(g.compute_cap, v.archs)]


def _gpu_phrase(g: DriverGPU) -> str:
    return f"{g.name} has compute capability {g.compute_cap} ({sm_name(g.compute_cap)})"


def select_variant(driver_version: str | None, forced: str | None = None, tested: str = "2.14.1",
                   gpus: Sequence[DriverGPU] = ()) -> Choice:
    """Driver version and GPUs (or a forced value) -> the build to install; :class:`NoVariant` if none fits.

    ``forced``: a variant name from :data:`VARIANTS` (or another ``cuXYZ``/``rocmX.Y``
    folder of PyTorch's index), ``pypi``, an index URL, or ``auto``/empty (choose by driver
    and GPUs). ``gpus``: the driver's GPUs; those with a ``compute_cap`` must each be run by the
    build's architecture list (:func:`arch_runs`), so a newer CUDA build is passed over for one
    that has the GPU's kernels.
    """
    forced = (forced or "").strip()
    if forced and forced != "auto":
        why = f"forced by TORCH_VARIANT={forced}"
        if "://" in forced:
            return Choice("custom", forced.rstrip("/"), None, why, True)
        if forced == "pypi":
            return Choice("pypi", None, "", why, True)
        if variant_named(forced) or re.fullmatch(r"cu\d{3}|rocm\d+(\.\d+)*|xpu", forced):
            return _by_name(forced, why, True)
        names = ", ".join(v.name for v in VARIANTS)
        raise NoVariant(f"TORCH_VARIANT={forced} is not a build this lab knows; use one of {names}, pypi, "
                        f"auto, or an index URL (https://...).")
    auto = [v for v in VARIANTS if v.auto and v.min_driver]
    if driver_version is None:
        pypi, oldest = next(v for v in VARIANTS if v.on_pypi), _oldest_auto()
        widest = min(auto, key=lambda v: min(n for a in v.archs if (p := _arch_number(a)) for n in [p[1]]))
        return Choice("pypi", None, "", f"no NVIDIA driver on this machine, so PyPI's build as always: "
                      f"CUDA {pypi.cuda}, which needs driver >= {pypi.min_driver} on the GPU nodes and has "
                      f"kernels for {arch_summary(pypi.archs)}; for drivers from {oldest.min_driver} there, "
                      f"or GPUs below {arch_summary(pypi.archs).split()[0]} (a V100 is sm_70), use "
                      f"TORCH_VARIANT={widest.name}")
    passed: list[str] = []   # newer builds this driver runs that lack a GPU's kernels
    for v in auto:
        if not driver_at_least(driver_version, v.min_driver):
            continue
        lacking = _lacking(v, gpus)
        if lacking:
            passed.append(f"{_gpu_phrase(lacking[0])}, and CUDA {v.cuda} builds ({v.name}) have "
                          f"{arch_summary(v.archs)} only")
            continue
        full = v.toolkit_driver and driver_at_least(driver_version, v.toolkit_driver)
        how = ("" if full else
               f" through CUDA minor-version compatibility (the CUDA {v.cuda} toolkit shipped with "
               f"driver {v.toolkit_driver})" if v.toolkit_driver else "")
        newer = [w for w in auto if w.cuda and parse_version(w.cuda).key() > parse_version(v.cuda).key()
                 and not driver_at_least(driver_version, w.min_driver)]
        skipped = "".join(f"; CUDA {w.cuda} ({w.name}) needs driver >= {w.min_driver}" for w in newer)
        has = ""
        if passed:
            caps = sorted({sm_name(g.compute_cap) for g in gpus if g.compute_cap})
            has = f": {'; '.join(passed)}, while {v.name} has {', '.join(caps)}"
        reason = (f"NVIDIA driver {driver_version} runs CUDA {v.cuda} builds (needs >= {v.min_driver})"
                  f"{how}{skipped}{has}")
        return _by_name(v.name, reason, False)
    if passed:
        raise NoVariant(f"{passed[0].split(', and ')[0]}, which no CUDA build of torch {tested} that driver "
                        f"{driver_version} runs has kernels for ("
                        + "; ".join(f"{v.name}: {arch_summary(v.archs)}" for v in auto)
                        + "); load your cluster's PyTorch module and run `make venv SYSTEM_TORCH=1`, "
                          "or force the CPU build with `make venv TORCH_VARIANT=cpu`.")
    oldest = _oldest_auto()
    raise NoVariant(f"NVIDIA driver {driver_version} is older than any CUDA build of torch {tested} supports "
                    f"(the oldest, {oldest.name}, needs >= {oldest.min_driver}); ask your admins for a newer "
                    f"driver, or load the cluster's PyTorch module and run `make venv SYSTEM_TORCH=1`, "
                    f"or force a build with `make venv TORCH_VARIANT=cpu`.")
