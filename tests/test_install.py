"""``make venv``: the torch build it picks, and ``SYSTEM_TORCH=1`` (the cluster's own torch).

The selection itself (driver version -> build) is tested in ``tests/test_gpu_node.py``;
here: what the install step does with it (pip commands, run dry), the Makefile's wiring,
and one real ``make venv SYSTEM_TORCH=1`` offline.

How the "interpreter that already has torch" is built, cheaply and soundly: a venv made
from inside another venv is based on the *base* interpreter (``sys._base_executable``), so
a fake torch in a parent venv would not be seen. Instead the fake torch and torchvision
(tiny wheels: dist-info with version metadata and a package folder) are unpacked into the
base interpreter's *user* site-packages, moved to a temporary folder with
``PYTHONUSERBASE``. Python adds the user site to a venv's path only when the venv was made
with ``--system-site-packages``, exactly like the interpreter's own site-packages, so the
test also shows that the flag is what makes the torch visible (a plain venv does not see
it). Nothing outside the temporary folder is touched.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from lab_utils.engine.cuda_builds import Driver, DriverGPU

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))  # the install script (no package)
import cuda_wheels  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fake_wheels import make_wheel  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
A100 = [DriverGPU(0, "NVIDIA A100-SXM4-80GB", 81920)]


# ----------------------------------------------------------------- what the install step runs


def _dry(capsys, **kw) -> str:
    cuda_wheels.install(sys.executable, REPO / "requirements.txt", REPO / "constraints.txt",
                        dry_run=True, **kw)
    return capsys.readouterr().out


def test_driver_535_installs_the_cu126_pair_from_pytorchs_index(capsys):
    out = _dry(capsys, driver=Driver("535.183.01", A100))
    cons = cuda_wheels.read_requirements(REPO / "constraints.txt")
    torch, tv = cuda_wheels.pinned_version(cons, "torch"), cuda_wheels.pinned_version(cons, "torchvision")
    assert "torch build: cu126 from https://download.pytorch.org/whl/cu126 (NVIDIA driver 535.183.01" in out
    assert "1 GPU (NVIDIA A100-SXM4-80GB) found by nvidia-smi" in out
    assert (f"-m pip install -q --index-url https://download.pytorch.org/whl/cu126 torch=={torch}+cu126 "
            f"torchvision=={tv}+cu126") in out
    assert out.index("--index-url") < out.index("-r ")  # the pair first, then requirements.txt (pins kept)
    assert f"-r {REPO / 'requirements.txt'} -c {REPO / 'constraints.txt'}" in out


def test_driver_580_and_no_driver_install_as_before(capsys):
    out = _dry(capsys, driver=Driver("580.95.05", A100))
    assert "torch build: cu130 from PyPI (NVIDIA driver 580.95.05 runs CUDA 13.0" in out
    assert "--index-url" not in out
    out = _dry(capsys, driver=None)
    assert "torch build: pypi from PyPI (no NVIDIA driver on this machine" in out and "--index-url" not in out


def test_a_v100_on_a_cuda_13_driver_gets_the_cu126_pair(capsys):
    """Driver 580 runs CUDA 13 builds, but they have no kernels for sm_70: the build follows the GPU."""
    v100 = [DriverGPU(0, "Tesla V100-SXM2-16GB", 16384, compute_cap="7.0")]
    out = _dry(capsys, driver=Driver("580.95.05", v100))
    assert "torch build: cu126 from https://download.pytorch.org/whl/cu126 (" in out
    assert "Tesla V100-SXM2-16GB has compute capability 7.0 (sm_70)" in out
    assert "--index-url https://download.pytorch.org/whl/cu126 torch==" in out


def test_a_forced_variant_or_index_url(capsys):
    out = _dry(capsys, variant="cpu", driver=Driver("535.183.01", A100))
    assert "torch build: cpu from https://download.pytorch.org/whl/cpu (forced by TORCH_VARIANT=cpu)" in out
    assert "--index-url https://download.pytorch.org/whl/cpu torch==" in out and "+cpu" in out
    out = _dry(capsys, variant="https://mirror.example.org/simple", driver=None)
    assert "--index-url https://mirror.example.org/simple torch==" in out and "+cu" not in out


def test_too_old_a_driver_stops_the_install(capsys):
    with pytest.raises(cuda_wheels.InstallError, match="driver 470.256.02 is older.*SYSTEM_TORCH=1"):
        _dry(capsys, driver=Driver("470.256.02", A100))


def test_makefile_wiring():
    """`make venv` runs the selection; TORCH_VARIANT and SYSTEM_TORCH reach it (and force a re-run)."""
    def dry(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if k not in ("TORCH_VARIANT", "SYSTEM_TORCH")}
        res = subprocess.run(["make", "-n", *args, "venv"], cwd=REPO, capture_output=True, text=True,
                             timeout=60, env=env)
        assert res.returncode == 0, res.stderr
        return res.stdout
    plain = dry("-B")
    assert "tools/cuda_wheels.py install --python .venv/bin/python" in plain
    assert "--system-site-packages" not in plain and "--system-torch" not in plain
    forced = dry("TORCH_VARIANT=cu126")  # no -B: a build asked for is installed even on an up-to-date .venv
    assert '--variant "cu126"' in forced
    system = dry("-B", "SYSTEM_TORCH=1")
    assert "-m venv --system-site-packages .venv" in system and "--system-torch" in system


@pytest.mark.timeout(120)
def test_make_test_in_one_process_logs_each_tests_cpu_and_ends_with_the_suites(tmp_path):
    """docs/developing.md, as written from the repository root, on one small test file:
    `LAB_TEST_CPU_LOG=cpu.jsonl make test TEST_WORKERS=0` writes a line per test, and the run's last
    line gives the suite's CPU and the machine's."""
    log = tmp_path / "cpu.jsonl"
    env = dict(os.environ, LAB_TEST_CPU_LOG=str(log))
    res = subprocess.run(["make", "--no-print-directory", "test", "TEST_WORKERS=0",
                          "PYTEST_ARGS=tests/test_schedules.py -p no:cacheprovider"],
                         cwd=REPO, capture_output=True, text=True, timeout=110, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(lines) == int(re.search(r"(\d+) passed", res.stdout).group(1)) > 0
    assert all(r["test"].startswith("tests/test_schedules.py::") and r["busy_s"] >= 0 for r in lines)
    assert re.search(r"suite CPU: [\d,]+ s .* the machine's cores were busy [\d,]+ s of [\d,]+ s; "
                     r"this machine adds 10 million numbers in Python in [\d.]+ s", res.stdout), res.stdout


@pytest.mark.timeout(120)
def test_the_venv_is_compiled_even_where_a_process_pool_cannot_start(tmp_path):
    """compile_venv compiles on several processes; where none can start (a container without /dev/shm:
    ProcessPoolExecutor raises), compileall fails as a whole, and the one-process pass compiles it all."""
    site = tmp_path / "site-packages"
    (site / "pkg").mkdir(parents=True)
    (site / "pkg" / "__init__.py").write_text("VALUE = 1\n")
    (site / "pkg" / "py312.py").write_text("def f[T](a): ...\n")  # as torch ships: never compiles on 3.11
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import concurrent.futures\n\n\n"
        "def no_pool(*args, **kwargs):\n"
        "    raise OSError(38, 'Function not implemented: no /dev/shm')\n\n\n"
        "concurrent.futures.ProcessPoolExecutor = no_pool\n")
    python = tmp_path / "python"  # answers the purelib question with `site`, runs compileall with the hook
    python.write_text(f"#!/bin/sh\nif [ \"$1\" = -c ]; then echo {site}; exit 0; fi\n"
                      f"PYTHONPATH={hook} exec {sys.executable} \"$@\"\n")
    python.chmod(0o755)
    cuda_wheels.compile_venv(str(python))
    assert list((site / "pkg" / "__pycache__").glob("__init__.*.pyc"))
    assert not list((site / "pkg" / "__pycache__").glob("py312.*.pyc"))


def test_a_system_pair_outside_the_ranges_is_refused():
    reqs = {"torch": ">=2.4,<2.16", "torchvision": ">=0.19,<0.31"}

    def seen(torch="2.11.0", tv="0.26.0", tv_needs="torch==2.11.0", where="/opt/site"):
        dists = {"torch": {"version": torch, "location": where, "requires": []}}
        if tv:
            dists["torchvision"] = {"version": tv, "location": where, "requires": ["numpy", tv_needs]}
        return {"prefix": "/lab/.venv", "base_prefix": "/opt", "dists": dists}

    assert cuda_wheels.check_system_pair(seen(), reqs) == []
    assert "torch 2.3.0 (in /opt/site) is outside requirements.txt's range torch>=2.4,<2.16" in \
        cuda_wheels.check_system_pair(seen(torch="2.3.0", tv_needs="torch==2.3.0"), reqs)[0]
    assert "torchvision is not visible" in cuda_wheels.check_system_pair(seen(tv=None), reqs)[0]
    assert "was built for torch ==2.12.0, not torch 2.11.0" in \
        cuda_wheels.check_system_pair(seen(tv_needs="torch (==2.12.0)"), reqs)[0]
    assert "installed inside /lab/.venv itself" in \
        cuda_wheels.check_system_pair(seen(where="/lab/.venv/lib/python3.11/site-packages"), reqs)[0]


def test_system_torch_needs_a_venv_made_for_it():
    """This suite's own .venv has no --system-site-packages: SYSTEM_TORCH=1 says to remake it."""
    if cuda_wheels.system_site_packages(sys.prefix):
        pytest.skip("this .venv was made with --system-site-packages")
    with pytest.raises(cuda_wheels.InstallError, match="without --system-site-packages.*SYSTEM_TORCH=1"):
        cuda_wheels.install_system_torch(sys.executable, REPO / "requirements.txt", REPO / "constraints.txt",
                                         dry_run=True)


# ----------------------------------------------------------------- make venv SYSTEM_TORCH=1, for real


def _base_python() -> str:
    return getattr(sys, "_base_executable", None) or shutil.which("python3") or sys.executable


@pytest.fixture
def lab_copy(tmp_path) -> tuple[Path, dict[str, str], Path]:
    """A copy of the lab's install machinery, an offline wheel folder, and a user site with torch."""
    proj = tmp_path / "lab"
    (proj / "lab_utils" / "engine").mkdir(parents=True)
    (proj / "tools").mkdir()
    shutil.copy(REPO / "Makefile", proj / "Makefile")
    shutil.copy(REPO / "tools" / "cuda_wheels.py", proj / "tools")
    shutil.copy(REPO / "lab_utils" / "engine" / "cuda_builds.py", proj / "lab_utils" / "engine")
    (proj / "lab_utils" / "__init__.py").write_text("")
    (proj / "lab_utils" / "engine" / "__init__.py").write_text("")
    shutil.copy(Path(__file__).with_name("fake_wheels.py"), proj / "fake_wheels.py")
    (proj / "pyproject.toml").write_text('[build-system]\nrequires = []\nbuild-backend = "fake_wheels"\n'
                                         'backend-path = ["."]\n')
    (proj / "requirements.txt").write_text("torch>=2.4,<2.16\ntorchvision>=0.19,<0.31\nlabtiny>=1.0\n"
                                           "torchao>=0.10   # optional\n")
    (proj / "constraints.txt").write_text("torch==2.14.1\ntorchvision==0.29.2\ntorchao==0.18.0\n"
                                          "labtiny==1.0\n")

    wheels = tmp_path / "wheels"  # what pip may install; a torch is there, so one pulled in would show
    make_wheel(wheels, "labtiny", "1.0")
    make_wheel(wheels, "torch", "2.14.1")
    make_wheel(wheels, "torchvision", "0.29.2", requires=("torch==2.14.1",))
    make_wheel(wheels, "torchao", "0.18.0", requires=("torch>=2.14",))  # --no-deps must keep torch out

    userbase = tmp_path / "userbase"  # the "cluster module": torch 2.11 + torchvision 0.26
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "MAKEFLAGS", "MAKELEVEL", "MFLAGS",
                        "TORCH_VARIANT", "SYSTEM_TORCH", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL")}
    # PYTHONDONTWRITEBYTECODE as on CI: nothing is byte-compiled unless make venv compiles it.
    env.update(PYTHONUSERBASE=str(userbase), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels),
               PYTHONDONTWRITEBYTECODE="1", PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop("PYTHONNOUSERSITE", None)
    site = subprocess.run([_base_python(), "-c", "import site; print(site.getusersitepackages())"], env=env,
                          capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert site.startswith(str(userbase)), site
    for name, version, requires in (("torch", "2.11.0", ()), ("torchvision", "0.26.0", ("torch==2.11.0",))):
        with zipfile.ZipFile(make_wheel(tmp_path / "system", name, version, requires=requires)) as z:
            z.extractall(site)
    return proj, env, Path(site)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_venv_system_torch_installs_no_torch(lab_copy):
    proj, env, site = lab_copy
    make = ["make", "-C", str(proj), f"PYTHON_BOOT={_base_python()}", "venv"]
    res = subprocess.run([*make, "SYSTEM_TORCH=1"], env=env, capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    venv = proj / ".venv"
    assert (venv / ".installed").exists() and cuda_wheels.system_site_packages(venv)
    assert "torch build: the system's torch 2.11.0 + torchvision 0.26.0" in out
    assert "no torch is installed" in out

    own = next(venv.glob("lib/python3*/site-packages"))
    names = {p.name.split("-")[0].lower() for p in own.iterdir()}
    assert "labtiny" in names and "torchao" in names  # the rest was installed, torchao without its deps
    assert not names & {"torch", "torchvision"}, sorted(names)
    assert_compiled(own, "labtiny")
    assert_compiled(proj, "lab_utils")  # the editable install's own source, imported from the checkout
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import torch, torchvision; print(torch.__version__, torch.__file__)"],
                           env=env, capture_output=True, text=True, timeout=60)
    assert where.stdout.split() == ["2.11.0", str(site / "torch" / "__init__.py")], where.stderr

    plain = proj / "plain"  # control: without --system-site-packages the same torch is not there
    subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(plain)], env=env, timeout=120,
                   check=True)
    res = subprocess.run([str(plain / "bin" / "python"), "-c", "import torch"], env=env, capture_output=True,
                         timeout=60)
    assert res.returncode != 0

    # The module's torch moves out of the requirements' range: a clear error, still no install.
    for dist in site.glob("torch-2.11.0.dist-info"):
        meta = dist / "METADATA"
        meta.write_text(meta.read_text().replace("Version: 2.11.0", "Version: 2.3.0"))
    res = subprocess.run([*make, "SYSTEM_TORCH=1"], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "error: SYSTEM_TORCH=1 needs a torch/torchvision pair" in res.stderr
    assert "torch 2.3.0" in res.stderr and "outside requirements.txt's range torch>=2.4,<2.16" in res.stderr
    assert not any(p.name.lower().startswith("torch-") for p in own.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_make_venv_on_a_v100_node_installs_a_build_with_sm70_and_says_why(lab_copy, tmp_path):
    """`make venv` as the README types it, with a fake nvidia-smi reporting a V100 (compute capability
    7.0) on driver 580, offline: PyTorch's index is a local folder (LAB_PYTORCH_INDEX, a mirror's
    address), PyPI's build a plain torch 2.14.1 in PIP_FIND_LINKS. Before: driver 580 -> PyPI's CUDA
    13.0 build, which has no sm_70 kernels."""
    from fake_gpu import FakeGPU

    proj, env, _ = lab_copy
    shutil.copy(REPO / "tests" / "fake_gpu.py", proj / "fake_gpu.py")
    idx = tmp_path / "pytorch_index"
    for variant in ("cu126", "cu130"):
        for name, version, req in (("torch", f"2.14.1+{variant}", ()),
                                   ("torchvision", f"0.29.2+{variant}", ("torch==2.14.1",))):
            whl = make_wheel(idx / variant / name, name, version, requires=req)
            (idx / variant / name / "index.html").write_text(f'<a href="{whl.name}">{whl.name}</a>\n')
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "index.html").write_text("")
    smi = FakeGPU(count=4, name="Tesla V100-SXM2-16GB", major=7, driver="580.95.05").install_nvidia_smi(
        tmp_path / "smi")
    env = {k: v for k, v in env.items() if k != "PIP_NO_INDEX"}
    env.update(PATH=f"{smi}{os.pathsep}{env['PATH']}", LAB_PYTORCH_INDEX=idx.as_uri(),
               PIP_INDEX_URL=empty.as_uri())
    res = subprocess.run(["make", "-C", str(proj), f"PYTHON_BOOT={_base_python()}", "venv"], env=env,
                         capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    line = next(ln for ln in out.splitlines() if ln.startswith("torch build:"))
    assert line.startswith(f"torch build: cu126 from {idx.as_uri()}/cu126 ("), line
    assert "Tesla V100-SXM2-16GB has compute capability 7.0 (sm_70)" in line
    assert "CUDA 13.0 builds (cu130) have sm_75 and later only" in line and "cu126 has sm_70" in line
    seen = cuda_wheels.probe(str(proj / ".venv" / "bin" / "python"))["dists"]
    assert (seen["torch"]["version"], seen["torchvision"]["version"]) == ("2.14.1+cu126", "0.29.2+cu126")
    assert_compiled(next((proj / ".venv").glob("lib/python3*/site-packages")), "torch", "torchvision")


def assert_compiled(site: Path, *packages: str) -> None:
    """pip installs with --no-compile and make venv compiles afterwards (cuda_wheels.compile_venv): each
    package's __init__ must have its .pyc, or every process compiles it again (PYTHONDONTWRITEBYTECODE)."""
    for name in packages:
        pyc = list((site / name / "__pycache__").glob("__init__.*.pyc"))
        assert pyc, f"{name} was not byte-compiled: {sorted(p.name for p in (site / name).iterdir())}"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_forced_index_installs_that_build_and_sticks(tmp_path, monkeypatch):
    """TORCH_VARIANT=<index URL> on a fresh venv: the pair comes from that index (a local one here),
    the rest from requirements.txt; the choice is recorded, and `auto` without a driver keeps the build."""
    idx, wheels = tmp_path / "index", tmp_path / "wheels"
    pair = (("torch", "2.14.1+cu126", ()), ("torchvision", "0.29.2+cu126", ("torch==2.14.1",)))
    for name, version, req in pair:
        whl = make_wheel(idx / name, name, version, requires=req)
        (idx / name / "index.html").write_text(f'<a href="{whl.name}">{whl.name}</a>\n')
    make_wheel(wheels, "labtiny", "1.0")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "index.html").write_text("")
    reqs, cons = tmp_path / "requirements.txt", tmp_path / "constraints.txt"
    reqs.write_text("torch>=2.4,<2.16\ntorchvision>=0.19,<0.31\nlabtiny>=1.0\n")
    cons.write_text("torch==2.14.1\ntorchvision==0.29.2\nlabtiny==1.0\n")
    venv = tmp_path / "venv"
    subprocess.run([_base_python(), "-m", "venv", str(venv)], timeout=180, check=True)
    py = str(venv / "bin" / "python")
    for k, v in dict(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=(tmp_path / "empty").as_uri(),
                     PIP_FIND_LINKS=str(wheels), PIP_DISABLE_PIP_VERSION_CHECK="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    choice = cuda_wheels.install(py, reqs, cons, variant=idx.as_uri(), driver=None)
    assert (choice.variant, choice.index_url) == ("custom", idx.as_uri())
    seen = cuda_wheels.probe(py)["dists"]
    assert (seen["torch"]["version"], seen["torchvision"]["version"]) == ("2.14.1+cu126", "0.29.2+cu126")
    assert (venv / cuda_wheels.VARIANT_FILE).read_text().strip() == idx.as_uri()
    assert cuda_wheels._forced_value(str(venv), None) == idx.as_uri()  # a job's plain `make venv`
    choice = cuda_wheels.install(py, reqs, cons, variant="auto", driver=None)
    assert choice.variant == "pypi" and not (venv / cuda_wheels.VARIANT_FILE).exists()
    assert cuda_wheels.probe(py)["dists"]["torch"]["version"] == "2.14.1+cu126"  # kept: no driver here
    own = next(venv.glob("lib/python3*/site-packages"))
    assert "labtiny" in {p.name.split("-")[0] for p in own.iterdir()}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_build_that_cannot_be_fetched_leaves_the_installed_pair(tmp_path, monkeypatch):
    """`make venv TORCH_VARIANT=cu126` on a node that cannot reach PyTorch's index: the error says so,
    and the venv keeps the torch it had (it used to be uninstalled first, leaving no torch at all);
    the failed choice is not recorded, so a plain `make venv` afterwards does not try it again."""
    wheels, empty = tmp_path / "wheels", tmp_path / "empty"
    make_wheel(wheels, "torch", "2.14.1")
    make_wheel(wheels, "torchvision", "0.29.2", requires=("torch==2.14.1",))
    empty.mkdir()
    (empty / "index.html").write_text("")
    reqs, cons = tmp_path / "requirements.txt", tmp_path / "constraints.txt"
    reqs.write_text("torch>=2.4,<2.16\ntorchvision>=0.19,<0.31\n")
    cons.write_text("torch==2.14.1\ntorchvision==0.29.2\n")
    venv = tmp_path / "venv"
    subprocess.run([_base_python(), "-m", "venv", str(venv)], timeout=180, check=True)
    py = str(venv / "bin" / "python")
    for k, v in dict(PIP_CONFIG_FILE=os.devnull, PIP_INDEX_URL=empty.as_uri(), PIP_FIND_LINKS=str(wheels),
                     PIP_DISABLE_PIP_VERSION_CHECK="1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    cuda_wheels.install(py, reqs, cons, variant="pypi", driver=None)
    assert cuda_wheels.probe(py)["dists"]["torch"]["version"] == "2.14.1"
    (venv / cuda_wheels.VARIANT_FILE).unlink(missing_ok=True)

    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))  # from now on no torch can be fetched from anywhere
    unreachable = (tmp_path / "no-such-index").as_uri()
    with pytest.raises(cuda_wheels.InstallError, match="nothing was removed"):
        cuda_wheels.install(py, reqs, cons, variant=unreachable, driver=None)
    seen = cuda_wheels.probe(py)["dists"]
    assert (seen["torch"]["version"], seen["torchvision"]["version"]) == ("2.14.1", "0.29.2")
    assert not (venv / cuda_wheels.VARIANT_FILE).exists()
