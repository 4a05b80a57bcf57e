#!/usr/bin/env python3
"""Which torch build a node can run: the NVIDIA driver, and the CUDA variant that fits it.

Install time only, standard library only: ``make venv`` runs this file with the bare
interpreter before the lab's packages exist (``python3 tools/cuda_wheels.py install ...``).
It is not part of the importable package. The table of builds and the driver query it
chooses with live in :mod:`lab_utils.engine.cuda_builds` (standard library only too), which the
lab also reads at run time; this script imports that one module from the checkout.

``requirements.txt`` and ``constraints.txt`` stay the source of truth: they give the
ranges and the tested torch/torchvision pair; this module only decides *which build* of
that pair to install:

- no NVIDIA driver here (no ``nvidia-smi``, no ``/proc/driver/nvidia/version``): what
  ``pip install -r requirements.txt -c constraints.txt`` gets from PyPI, as always (a
  build already in ``.venv`` is kept);
- a driver: the newest CUDA build of the pair in :data:`VARIANTS` that this driver runs and
  that has kernels for every GPU's compute capability (a V100, sm_70, gets the CUDA 12.6 build;
  PyPI's build when it fits, else PyTorch's wheel index for that variant, or the mirror
  ``$LAB_PYTORCH_INDEX`` names);
- ``TORCH_VARIANT=cu126|cu130|cu132|cpu|pypi|<index URL>|auto`` forces one (``auto``
  forgets an earlier forced choice, which otherwise sticks to ``.venv``);
- ``SYSTEM_TORCH=1``: no torch is installed; the torch/torchvision pair the interpreter
  already sees (a cluster module or container) is checked against requirements.txt's
  ranges and only the other packages are installed.

Commands::

    python3 tools/cuda_wheels.py select [--driver 535.183.01] [--variant cu126]
    python3 tools/cuda_wheels.py install --python .venv/bin/python [--variant V] [--system-torch]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# The checkout's lab_utils/engine/cuda_builds.py, imported before the lab is installed: it and the
# package's __init__ files import nothing outside the standard library.
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from lab_utils.engine.cuda_builds import (  # noqa: E402
    VARIANTS,
    Choice,
    Driver,
    DriverGPU,
    NoVariant,
    Variant,
    normalize,
    parse_version,
    pinned_version,
    query_driver,
    read_requirements,
    select_variant,
    version_satisfies,
)

__all__ = ["VARIANTS", "Choice", "Driver", "DriverGPU", "InstallError", "NoVariant", "Variant", "install",
           "install_system_torch", "main", "probe", "check_system_pair", "system_site_packages"]

PIP_TIMEOUT_S = 3600.0
VARIANT_FILE = ".torch-variant"  # in .venv: a forced TORCH_VARIANT, reused until `auto`
TORCH_PAIR = ("torch", "torchvision")


class InstallError(RuntimeError):
    """The install cannot go on; the message says why and what to do."""


_PROBE = r"""
import json, sys
from importlib import metadata
out = {"prefix": sys.prefix, "base_prefix": sys.base_prefix, "dists": {}}
for name in sys.argv[1:]:
    try:
        d = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        continue
    out["dists"][name] = {"version": d.version, "location": str(d.locate_file("")),
                          "requires": list(d.requires or [])}
print(json.dumps(out))
"""


def probe(python: str, names=("torch", "torchvision", "torchao")) -> dict:
    """What ``python`` sees: its prefix and the named distributions (version, location, requires)."""
    res = subprocess.run([python, "-c", _PROBE, *names], capture_output=True, text=True, timeout=120)
    if res.returncode != 0:
        raise InstallError(f"{python} could not be asked what it has installed: {res.stderr.strip()[-500:]}")
    return json.loads(res.stdout)


def _inside(path: str, prefix: str) -> bool:
    try:
        return Path(path).resolve().is_relative_to(Path(prefix).resolve())
    except OSError:
        return False


def system_site_packages(prefix: str | Path) -> bool:
    """True when the venv at ``prefix`` was made with ``--system-site-packages``."""
    try:
        text = (Path(prefix) / "pyvenv.cfg").read_text()
    except OSError:
        return False
    return bool(re.search(r"^\s*include-system-site-packages\s*=\s*true\s*$", text, re.M | re.I))


def check_system_pair(seen: dict, requirements: dict[str, str]) -> list[str]:
    """Problems with the torch/torchvision pair an interpreter sees, against requirements' ranges."""
    problems, dists = [], seen["dists"]
    for name in TORCH_PAIR:
        spec = requirements.get(name, "")
        d = dists.get(name)
        if d is None:
            problems.append(f"{name} is not visible to {seen['prefix']} (required: {name}{spec})")
        elif spec and not version_satisfies(d["version"], spec):
            problems.append(f"{name} {d['version']} (in {d['location']}) is outside requirements.txt's "
                            f"range {name}{spec}")
        elif _inside(d["location"], seen["prefix"]) and seen["prefix"] != seen["base_prefix"]:
            problems.append(f"{name} {d['version']} is installed inside {seen['prefix']} itself, "
                            f"not provided by the system")
    if not problems:  # the pair must belong together: torchvision names the torch it was built for
        torch_v = dists["torch"]["version"]
        for req in dists["torchvision"]["requires"]:
            m = re.match(r"^torch\s*\(?\s*([^;)]*)\)?\s*(;.*)?$", req.strip())
            if m and m.group(1).strip() and not version_satisfies(torch_v, m.group(1).replace(" ", "")):
                problems.append(f"torchvision {dists['torchvision']['version']} was built for torch "
                                f"{m.group(1).strip()}, not torch {torch_v}")
    return problems


def _pip(python: str, *args: str, dry_run: bool = False, verb: str = "install") -> None:
    # pip byte-compiles what it installs one file at a time (a third of the install's time); the install
    # command compiles the venv afterwards on up to 8 cores instead (compile_venv). The .pyc files must exist:
    # where PYTHONDONTWRITEBYTECODE is set (this CI machine, some clusters' images) Python never writes
    # one itself, so every process compiled torch from source (make test 13 -> 21 min, 2026-11-26).
    cmd = [python, "-m", "pip", verb, *args, *(["--no-compile"] if verb == "install" else [])]
    print("+ " + " ".join(cmd), flush=True)
    if dry_run:
        return
    res = subprocess.run(cmd, timeout=PIP_TIMEOUT_S)
    if res.returncode != 0:
        raise InstallError(f"`{' '.join(cmd)}` failed with exit code {res.returncode} "
                           f"(see pip's output above)")


def compile_venv(python: str, dry_run: bool = False) -> None:
    """Byte-compile the venv's own site-packages on up to 8 cores: what pip does file by file, in a third
    of its time (torch's 3 GB: 93 s with pip's compile, 46 + 25 s without it and then this, 2 cores).
    Best effort, as pip's own compile is: a file that cannot compile (torch ships one in Python 3.12
    syntax) stays source, so the exit code is not an error; files already compiled are skipped."""
    where = subprocess.run([python, "-c", "import sysconfig; p = sysconfig.get_paths(); "
                            "print('\\n'.join(sorted({p['purelib'], p['platlib']})))"],
                           capture_output=True, text=True, timeout=120)
    sites = where.stdout.splitlines() if where.returncode == 0 else []
    if not sites:
        raise InstallError(f"{python} could not say where its site-packages are: "
                           f"{where.stderr.strip()[-500:]}")
    # At most 8 processes: a login node may show 128 cores to a user allowed a few GB of memory.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)

    def compileall(processes: int) -> list[str]:
        return [python, "-m", "compileall", "-qq", "-j", str(processes), *sites]

    print("+ " + " ".join(compileall(min(cores, 8))), flush=True)
    if not dry_run and subprocess.run(compileall(min(cores, 8)), timeout=PIP_TIMEOUT_S).returncode != 0:
        # Usually that one file; but where a process pool cannot start (no /dev/shm in some containers)
        # nothing was compiled. Once more on one process: ~2 s when only that file is left.
        subprocess.run(compileall(1), timeout=PIP_TIMEOUT_S)


def _filtered(src: Path, drop: set[str], directory: str) -> Path:
    """A copy of a requirements/constraints file without the lines naming ``drop``."""
    keep = []
    for raw in src.read_text(encoding="utf-8").splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).strip()
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)", line)
        if m and normalize(m.group(1)) in drop:
            continue
        keep.append(raw)
    out = Path(directory) / src.name
    out.write_text("\n".join(keep) + "\n", encoding="utf-8")
    return out


def install_system_torch(python: str, requirements: Path, constraints: Path, dry_run: bool = False) -> None:
    """SYSTEM_TORCH=1: check the pair the interpreter sees, install everything else, never a torch."""
    seen = probe(python)
    if not system_site_packages(seen["prefix"]):
        raise InstallError(f"{seen['prefix']} was made without --system-site-packages, so it cannot use "
                           f"the system's torch; remove it (rm -rf {seen['prefix']}) and run "
                           f"`make venv SYSTEM_TORCH=1`.")
    reqs = read_requirements(requirements)
    problems = check_system_pair(seen, reqs)
    if problems:
        raise InstallError("SYSTEM_TORCH=1 needs a torch/torchvision pair from the system within "
                           "requirements.txt's ranges (load your cluster's PyTorch module first): "
                           + "; ".join(problems) + ".")
    d = seen["dists"]
    print(f"torch build: the system's torch {d['torch']['version']} + torchvision "
          f"{d['torchvision']['version']} (from {d['torch']['location']}; SYSTEM_TORCH=1): no torch is "
          f"installed into {seen['prefix']}", flush=True)
    drop = {"torch", "torchvision", "torchao"}
    with tempfile.TemporaryDirectory(prefix="lab_reqs_") as tmp:
        _pip(python, "-q", "-r", str(_filtered(requirements, drop, tmp)),
             "-c", str(_filtered(constraints, drop, tmp)), dry_run=dry_run)
    if "torchao" in reqs and "torchao" not in d:  # optional; --no-deps so that it can never pull a torch
        pin = pinned_version(read_requirements(constraints), "torchao")
        spec = f"torchao=={pin}" if pin else f"torchao{reqs['torchao']}"
        try:
            _pip(python, "-q", "--no-deps", spec, dry_run=dry_run)
        except InstallError as e:
            print(f"warning: torchao (optional, notebook 07) was not installed: {e}", file=sys.stderr)
    if not dry_run:
        after = probe(python, TORCH_PAIR)["dists"]
        for name in TORCH_PAIR:
            if name not in after or _inside(after[name]["location"], seen["prefix"]):
                raise InstallError(f"{name} was installed into {seen['prefix']} although SYSTEM_TORCH=1 "
                                   f"should use the system's; remove {seen['prefix']} and try again.")


def _forced_value(prefix: str, given: str | None) -> str | None:
    """TORCH_VARIANT given now (``auto``: none), else the one recorded in the venv."""
    given = (given or "").strip()
    if given:
        return None if given == "auto" else given
    record = Path(prefix) / VARIANT_FILE
    return (record.read_text().strip() or None) if record.exists() else None


def _record_forced(prefix: str, given: str | None) -> None:
    """Remember a valid TORCH_VARIANT in the venv (jobs' own `make venv` keep it); ``auto`` forgets."""
    given, record = (given or "").strip(), Path(prefix) / VARIANT_FILE
    if given == "auto":
        record.unlink(missing_ok=True)
    elif given:
        record.write_text(given + "\n")


def install(python: str, requirements: Path, constraints: Path, variant: str | None = None,
            system_torch: bool = False, dry_run: bool = False,
            driver: Driver | None | str = "detect") -> Choice | None:
    """The venv's packages: the torch build this machine runs, then requirements.txt."""
    seen = probe(python)
    prefix = seen["prefix"]
    own = {n for n, d in seen["dists"].items() if _inside(d["location"], prefix)}
    if system_torch or (not (variant or "").strip() and system_site_packages(prefix) and "torch" not in own):
        install_system_torch(python, requirements, constraints, dry_run=dry_run)
        return None
    forced = _forced_value(prefix, variant)
    if driver == "detect":
        driver = None if forced else query_driver()
    if driver is not None and driver.version is None:  # nvidia-smi without GPUs: as without a driver
        driver = None
    try:
        choice = select_variant(driver.version if driver else None, forced,
                                pinned_version(read_requirements(constraints), "torch") or "?",
                                gpus=driver.gpus if driver else ())
    except NoVariant as e:
        raise InstallError(str(e)) from None
    found = f"; {driver.gpu_list()} found by {driver.source}" if driver and not forced else ""
    source = choice.index_url or "PyPI"
    print(f"torch build: {choice.variant} from {source} ({choice.reason}{found}); "
          f"force another with `make venv TORCH_VARIANT=...`", flush=True)

    cons = read_requirements(constraints)
    pins = {n: pinned_version(cons, n) for n in TORCH_PAIR}
    ours = seen["dists"].get("torch") if "torch" in seen["dists"] and _inside(
        seen["dists"]["torch"]["location"], prefix) else None
    have = parse_version(ours["version"]).local if ours else None
    deliberate = choice.forced or driver is not None
    if choice.index_url and not all(pins.values()):
        raise InstallError(f"{constraints} must pin torch and torchvision (==) to install the "
                           f"{choice.variant} build.")
    suffix = f"+{choice.label}" if choice.label else ""
    pair = [f"{n}=={pins[n]}{suffix}" for n in TORCH_PAIR]
    index = ["--index-url", choice.index_url] if choice.index_url else []
    # Inside the venv: its file system holds torch anyway (a login node's /tmp may be small).
    with tempfile.TemporaryDirectory(prefix=".lab_torch_", dir=prefix) as fetched:
        local = []  # the new pair's wheels, fetched before the old pair is removed
        if ours and deliberate and (choice.label is None or have != choice.label):
            print(f"replacing the installed torch {ours['version']} by the {choice.variant} build",
                  flush=True)
            if all(pins.values()):
                try:  # an unreachable index or a missing build fails here, with the old pair still installed
                    _pip(python, "-q", "--no-deps", "-d", fetched, *index, *pair, dry_run=dry_run,
                         verb="download")
                except InstallError as e:
                    raise InstallError(f"{e}; nothing was removed: the venv keeps torch {ours['version']}") \
                        from None
                local = ["--find-links", fetched]
            if not dry_run:
                subprocess.run([python, "-m", "pip", "uninstall", "-y", "-q", *TORCH_PAIR],
                               timeout=600, check=False)
        elif ours and have and not deliberate:
            print(f"no driver here: keeping the installed torch {ours['version']} "
                  f"(`make venv TORCH_VARIANT=pypi` replaces it)", flush=True)
        if choice.index_url:
            _pip(python, "-q", *index, *pair, *local, dry_run=dry_run)
        _pip(python, "-q", "-r", str(requirements), "-c", str(constraints), *local, dry_run=dry_run)
    if not dry_run:
        _record_forced(prefix, variant)  # only a build that installed sticks to the venv
    if not dry_run and choice.label is not None:
        now = probe(python, ("torch",))["dists"].get("torch")
        label = parse_version(now["version"]).local if now else None
        if now and deliberate and label != choice.label:
            raise InstallError(f"torch {now['version']} is installed, not the {choice.variant} build "
                               f"(+{choice.label or 'PyPI'}); remove .venv and run `make venv` again.")
    return choice


# --------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 tools/cuda_wheels.py",
                                description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("select", help="print the build this machine would get, and why")
    s.add_argument("--driver", default=None, help="a driver version instead of this machine's")
    s.add_argument("--variant", default=os.environ.get("TORCH_VARIANT"), help="TORCH_VARIANT")
    i = sub.add_parser("install", help="install the venv's packages with the right torch build")
    i.add_argument("--python", required=True, help="the venv's python")
    i.add_argument("--requirements", default="requirements.txt")
    i.add_argument("--constraints", default="constraints.txt")
    i.add_argument("--variant", default=os.environ.get("TORCH_VARIANT"), help="TORCH_VARIANT")
    i.add_argument("--system-torch", action="store_true", help="SYSTEM_TORCH=1: use the interpreter's torch")
    i.add_argument("--dry-run", action="store_true", help="print the pip commands, run none")
    args = p.parse_args(argv)
    try:
        if args.command == "select":
            driver = Driver(args.driver, source="--driver") if args.driver else query_driver()
            cons = REPO / "constraints.txt"
            tested = pinned_version(read_requirements(cons), "torch") if cons.exists() else None
            c = select_variant(driver.version if driver else None, args.variant, tested or "?",
                               gpus=driver.gpus if driver else ())
            found = f"; {driver.gpu_list()} found by {driver.source}" if driver and not args.driver else ""
            print(f"{c.variant} from {c.index_url or 'PyPI'} ({c.reason}{found})")
        else:
            install(args.python, Path(args.requirements), Path(args.constraints), args.variant,
                    args.system_torch, args.dry_run)
            compile_venv(args.python, args.dry_run)
    except (NoVariant, InstallError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
