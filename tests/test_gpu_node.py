"""A GPU node gets a GPU build or a clear refusal, never a silent CPU run.

- The choice of build (``lab_utils/engine/cuda_builds.py``, used by ``tools/cuda_wheels.py`` at install
  time): driver version -> torch build, from the one table :data:`lab_utils.engine.cuda_builds.VARIANTS`
  (sources cited there).
- The run-time refusal (``lab_utils.engine.environment.check_gpu_node``), tested on this CPU
  machine with a fake ``nvidia-smi`` on PATH that reports driver 535 and two A100s, and
  the installed torch, which sees no GPU here: ``python -m lab_utils info`` and ``run``
  stop with one ``error:`` line, ``session.start`` raises, an explicit quick profile
  warns; without the fake everything behaves as before.
- What notebook 00 shows about the driver, the libraries and the GPU topology.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab_utils.engine import cuda_builds as cuda_wheels  # the table and the driver query
from lab_utils.engine import environment
from lab_utils.engine.cuda_builds import Driver, DriverGPU, NoVariant, select_variant, version_satisfies
from lab_utils.experiments.n00_environment.tables import environment_rows
from lab_utils.learn.errors import LabError

REPO = Path(__file__).resolve().parent.parent

NVLINK_TOPO = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV12\tNV12\tNV12\tSYS\t0-31\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tNV12\tNV12\tSYS\t0-31\t0\t\tN/A\n"
    "GPU2\tNV12\tNV12\t X \tNV12\tSYS\t32-63\t1\t\tN/A\n"
    "GPU3\tNV12\tNV12\tNV12\t X \tSYS\t32-63\t1\t\tN/A\n"
    "NIC0\tSYS\tSYS\tSYS\tSYS\t X \n\nLegend:\n\n  X    = Self\n"
    "  NV#  = Connection traversing a bonded set of # NVLinks\n"
)
PCIE_TOPO = (
    "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tPIX\t0-15\t0\n"
    "GPU1\tPIX\t X \t0-15\t0\n"
)
NVLINK2_TOPO = PCIE_TOPO.replace("PIX", "NV12")


def fake_nvidia_smi(bin_dir: Path, driver: str = "535.183.01", gpus: int = 2, topo: str = NVLINK2_TOPO,
                    hang: bool = False) -> Path:
    """An ``nvidia-smi`` that answers the queries the lab makes (``--query-gpu``, ``topo -m``)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"{i}, NVIDIA A100-SXM4-80GB, 81920, {driver}\\n" for i in range(gpus))
    (bin_dir / "topo.txt").write_text(topo)
    script = bin_dir / "nvidia-smi"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        {"sleep 30" if hang else ""}
        case "$*" in
          *--query-gpu=index,name,memory.total,driver_version*) printf '{rows}' ;;
          "topo -m") cat "{bin_dir / 'topo.txt'}" ;;
          *) echo "NVIDIA-SMI {driver}   Driver Version: {driver}" ;;
        esac
        """))
    script.chmod(0o755)
    return bin_dir


@pytest.fixture
def fake_smi(tmp_path, monkeypatch) -> Path:
    """PATH starts with a fake nvidia-smi reporting driver 535.183.01 and two A100s."""
    d = fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    return d


@pytest.fixture
def no_driver(tmp_path, monkeypatch):
    """No nvidia-smi on PATH (and this machine has no /proc/driver/nvidia)."""
    if Path("/proc/driver/nvidia/version").exists():
        pytest.skip("this machine has an NVIDIA driver")
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}/usr/bin{os.pathsep}/bin")


@pytest.fixture
def cpu_torch():
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here; these tests need a torch that cannot use the (fake) GPUs")
    return torch


# ----------------------------------------------------------------- the table: driver -> build


@pytest.mark.parametrize("driver, variant, index", [
    ("470.256.02", None, None),              # CUDA 11 era: no build of torch 2.14 runs
    ("525.60.12", None, None),               # just below CUDA 12's minor-version floor
    ("525.60.13", "cu126", "cu126"),         # CUDA 12.x floor (minor-version compatibility)
    ("535.183.01", "cu126", "cu126"),        # R535: the common old branch on A100/H100 clusters
    ("550.127.05", "cu126", "cu126"),
    ("570.195.03", "cu126", "cu126"),        # >= 560.28.03: CUDA 12.6 with full compatibility
    ("575.57.08", "cu126", "cu126"),
    ("580.65.06", "cu130", None),            # CUDA 13.0: PyPI's own build, as today
    ("590.48.01", "cu130", None),
])
def test_driver_version_picks_the_build(driver, variant, index):
    if variant is None:
        with pytest.raises(NoVariant, match=rf"driver {driver} is older than any CUDA build.*525\.60\.13.*"
                                             r"SYSTEM_TORCH=1"):
            select_variant(driver)
        return
    c = select_variant(driver)
    assert c.variant == variant and not c.forced
    assert c.index_url == (f"https://download.pytorch.org/whl/{index}" if index else None)
    assert c.label == (index or "")  # cu126 wheels are torch==X+cu126; PyPI's carry no label
    assert driver in c.reason


def test_the_reason_says_why_and_what_was_skipped():
    r = select_variant("535.183.01").reason
    assert "minor-version compatibility" in r and "CUDA 13.0 (cu130) needs driver >= 580" in r
    assert "minor-version" not in select_variant("570.195.03").reason  # 570 >= 560.28.03: full support


def test_no_driver_keeps_todays_behaviour():
    c = select_variant(None)
    assert (c.variant, c.index_url, c.label) == ("pypi", None, "")
    assert "no NVIDIA driver" in c.reason and "TORCH_VARIANT=cu126" in c.reason


@pytest.mark.parametrize("forced, variant, url", [
    ("cu126", "cu126", "https://download.pytorch.org/whl/cu126"),
    ("cu130", "cu130", "https://download.pytorch.org/whl/cu130"),  # forced: from PyTorch's index
    ("cpu", "cpu", "https://download.pytorch.org/whl/cpu"),
    ("pypi", "pypi", None),
    ("https://mirror.example.org/torch/cu126/", "custom", "https://mirror.example.org/torch/cu126"),
])
def test_a_forced_build_wins_over_the_driver(forced, variant, url):
    c = select_variant("590.48.01", forced)
    assert (c.variant, c.index_url, c.forced) == (variant, url, True)
    assert c.label == {"pypi": "", "custom": None}.get(variant, variant)
    assert select_variant("535.183.01", "auto").variant == "cu126"  # auto: by driver again


def test_an_unknown_forced_build_is_refused():
    with pytest.raises(NoVariant, match="TORCH_VARIANT=cu999x is not a build.*cu126"):
        select_variant(None, "cu999x")


def test_the_table_is_ordered_and_complete():
    """Newest CUDA first; every automatic variant has a driver floor; one build is PyPI's."""
    cudas = [cuda_wheels.parse_version(v.cuda).key() for v in cuda_wheels.VARIANTS if v.cuda]
    assert cudas == sorted(cudas, reverse=True)
    assert all(v.min_driver for v in cuda_wheels.VARIANTS if v.auto)
    assert [v.name for v in cuda_wheels.VARIANTS if v.on_pypi] == ["cu130"]
    assert cuda_wheels.min_driver_for_cuda("13.0") == "580"
    assert cuda_wheels.min_driver_for_cuda("12.8") == "525.60.13"  # not in the table: its major's floor
    assert cuda_wheels.min_driver_for_cuda(None) is None


@pytest.mark.parametrize("version, spec, ok", [
    ("2.14.1", ">=2.4,<2.16", True),
    ("2.14.1+cu126", ">=2.4,<2.16", True),
    ("2.14.1+cu126", "==2.14.1", True),            # a local label is ignored by ==X
    ("2.14.1", "==2.14.1+cu126", False),
    ("2.16.0", ">=2.4,<2.16", False),
    ("2.16.0a0+git123", ">=2.4,<2.16", False),     # <V excludes V's pre-releases
    ("2.5.0a0+e000cf0ad9.nv24.10", ">=2.4,<2.16", True),  # an NGC container's torch
    ("2.3.1", ">=2.4,<2.16", False),
    ("0.29.2", "~=0.29.0", True),
    ("0.30.0", "~=0.29.0", False),
    ("2.14.7", "==2.14.*", True),
    ("535.183.01", ">=525.60.13", True),
    ("525.60.12", ">=525.60.13", False),
    ("1.0", "", True),
])
def test_version_ranges(version, spec, ok):
    assert version_satisfies(version, spec) is ok


def test_requirements_are_the_source_of_truth():
    reqs = cuda_wheels.read_requirements(REPO / "requirements.txt")
    cons = cuda_wheels.read_requirements(REPO / "constraints.txt")
    assert reqs["torch"].startswith(">=") and "torchvision" in reqs and reqs["ipywidgets"] == ">=8.0"
    torch_pin = cuda_wheels.pinned_version(cons, "torch")
    tv_pin = cuda_wheels.pinned_version(cons, "torchvision")
    assert torch_pin and tv_pin
    assert version_satisfies(torch_pin, reqs["torch"]) and version_satisfies(tv_pin, reqs["torchvision"])


# ----------------------------------------------------------------- reading the driver


def test_driver_from_fake_nvidia_smi(fake_smi):
    d = cuda_wheels.query_driver()
    assert d.version == "535.183.01" and d.source == "nvidia-smi"
    assert [(g.index, g.name, g.memory_mib) for g in d.gpus] == [(0, "NVIDIA A100-SXM4-80GB", 81920),
                                                                 (1, "NVIDIA A100-SXM4-80GB", 81920)]
    assert d.describe() == "NVIDIA driver 535.183.01 reports 2 GPUs (NVIDIA A100-SXM4-80GB)"


def test_driver_from_proc_when_nvidia_smi_is_missing(no_driver, tmp_path):
    proc = tmp_path / "proc_nvidia"
    (proc / "gpus" / "0000:07:00.0").mkdir(parents=True)
    (proc / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.127.05  Tue Oct 8 "
                                  "2024\nGCC version:  gcc version 12.2.0\n")
    (proc / "gpus" / "0000:07:00.0" / "information").write_text("Model: \t\t NVIDIA H100 80GB HBM3\nIRQ: 0\n")
    d = cuda_wheels.query_driver(proc_root=proc)
    assert (d.version, [g.name for g in d.gpus]) == ("550.127.05", ["NVIDIA H100 80GB HBM3"])
    assert "nvidia-smi is not on PATH" in d.note and d.source.endswith("version")


def test_no_driver_at_all(no_driver, tmp_path):
    assert cuda_wheels.query_driver(proc_root=tmp_path / "absent") is None


@pytest.mark.timeout(30)
def test_a_hanging_nvidia_smi_is_bounded(tmp_path, monkeypatch):
    d = fake_nvidia_smi(tmp_path / "bin", hang=True)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")
    import time

    t0 = time.monotonic()
    assert cuda_wheels.query_driver(timeout_s=1, proc_root=tmp_path / "absent") is None
    assert time.monotonic() - t0 < 10


# ----------------------------------------------------------------- the refusal


def test_auto_profile_on_a_gpu_node_is_refused(fake_smi, cpu_torch, monkeypatch):
    monkeypatch.delenv("LAB_PROFILE", raising=False)
    from lab_utils.engine import config

    name, why = config.resolve_profile_name(None)
    with pytest.raises(LabError) as e:
        environment.check_gpu_node(name, why)
    msg = str(e.value)
    assert "\n" not in msg and msg.count(". ") == 0 and msg.endswith(".")  # one sentence
    assert "driver 535.183.01 reports 2 GPUs" in msg
    cuda = cpu_torch.version.cuda
    assert (f"CUDA {cuda}, which needs driver >= 580" if cuda and cuda.startswith("13")
            else "CPU-only build" if not cuda else f"CUDA {cuda}") in msg
    assert "make venv TORCH_VARIANT=cu126" in msg and "SYSTEM_TORCH=1" in msg and "LAB_PROFILE=quick" in msg


def test_full_profile_on_a_gpu_node_is_refused(fake_smi, cpu_torch, monkeypatch):
    monkeypatch.setenv("LAB_PROFILE", "full")
    from lab_utils.engine.session import start

    with pytest.raises(LabError, match="driver 535.183.01"):
        start()


def test_explicit_quick_runs_with_a_warning(fake_smi, cpu_torch, monkeypatch, results_dir, capsys):
    monkeypatch.setenv("LAB_PROFILE", "quick")
    from lab_utils.engine.session import start

    lab = start()
    assert lab.profile.name == "quick" and lab.device.type == "cpu"
    err = capsys.readouterr().err
    assert err.startswith("warning: This node's NVIDIA driver 535.183.01") and "TORCH_VARIANT=cu126" in err


def test_without_a_driver_nothing_changes(no_driver, cpu_torch, monkeypatch, results_dir, capsys):
    monkeypatch.delenv("LAB_PROFILE", raising=False)
    from lab_utils.engine.session import start

    assert environment.gpu_node_problem() is None
    lab = start()
    assert lab.profile.name == "quick" and "automatic" in lab.why
    assert "warning" not in capsys.readouterr().err


def test_a_fitting_torch_that_cannot_see_gpus_gets_a_different_fix(cpu_torch, monkeypatch):
    """Driver 580 runs CUDA 13: reinstalling is not the fix; the job's GPUs are."""
    monkeypatch.setattr(environment, "_torch_build", lambda: ("2.14.1+cu130", "13.0"))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    drv = Driver("580.95.05", [DriverGPU(0, "NVIDIA H100 80GB HBM3", 81559)])
    problem, fix = environment.gpu_node_problem(drv)
    assert "is shown no GPU (CUDA_VISIBLE_DEVICES='')" in problem
    assert "CUDA_VISIBLE_DEVICES" in fix and "TORCH_VARIANT" not in fix
    monkeypatch.setattr(environment, "_torch_build", lambda: ("2.14.1+cpu", None))
    problem, fix = environment.gpu_node_problem(Driver("470.256.02", drv.gpus))
    assert "CPU-only build" in problem and "too old" in fix and "SYSTEM_TORCH=1" in fix


def _lab(*args: str, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lab_utils", *args], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_command_line_refuses_on_a_gpu_node_and_not_elsewhere(tmp_path, cpu_torch):
    """The issue's "done when": info and run 00 exit non-zero with one sentence; without the fake,
    as today."""
    smi = fake_nvidia_smi(tmp_path / "bin")
    base = {k: v for k, v in os.environ.items() if k != "LAB_PROFILE"}
    base["LAB_RESULTS_DIR"] = str(tmp_path / "results")
    gpu = dict(base, PATH=f"{smi}{os.pathsep}{base['PATH']}")
    for args in (["info"], ["run", "00"]):
        res = _lab(*args, env=gpu)
        assert res.returncode == 2, res.stdout + res.stderr
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith("error: This node's NVIDIA driver 535.183.01"), res.stderr
        assert "TORCH_VARIANT=cu126" in lines[0] and res.stdout == ""
    assert not (tmp_path / "results").exists()  # refused before any work

    quick = _lab("info", env=dict(gpu, LAB_PROFILE="quick"))
    assert quick.returncode == 0 and quick.stderr.startswith("warning: This node's NVIDIA driver")
    empty = tmp_path / "empty_bin"
    empty.mkdir()
    plain = dict(base, PATH=f"{empty}{os.pathsep}/usr/bin{os.pathsep}/bin")
    if Path("/proc/driver/nvidia/version").exists():
        return
    info = _lab("info", env=plain)
    assert info.returncode == 0 and '"profile": "quick"' in info.stdout and "error" not in info.stderr
    run = _lab("run", "00", env=plain)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "ok     00_environment.ipynb" in run.stdout


# ----------------------------------------------------------------- what notebook 00 shows


def test_topology_summaries():
    two = Driver("535.183.01", [DriverGPU(0, "A100"), DriverGPU(1, "A100")])
    four = Driver("535.183.01", [DriverGPU(i, "A100") for i in range(4)])
    assert environment.topology_summary(NVLINK_TOPO, four) == "NVLink between every pair of the 4 GPUs (NV12)"
    assert environment.topology_summary(PCIE_TOPO, two) == "PCIe only: no NVLink between the 2 GPUs (PIX)"
    mixed = PCIE_TOPO.replace("\tPIX\t X", "\tNV4\t X").replace("\t X \tPIX", "\t X \tSYS")
    assert environment.topology_summary(mixed, two).startswith("mixed: NVLink between some pairs")
    one = "\tGPU0\tCPU Affinity\nGPU0\t X \t0-15\n"
    assert environment.topology_summary(one, Driver("535.1", [DriverGPU(0, "A100")])).startswith("one GPU")
    assert "not available in this container" in environment.topology_summary(None, two)
    assert environment.topology_summary(None, None).startswith("no GPUs: no NVIDIA driver on this machine")


def test_cudnn_versions_read_as_text():
    assert environment.cudnn_version(92400) == "9.24.0"
    assert environment.cudnn_version(91002) == "9.10.2"
    assert environment.cudnn_version(8907) == "8.9.7"
    assert environment.cudnn_version(None) is None


def test_software_stack_names_every_piece_or_why_not(no_driver, cpu_torch):
    s = environment.software_stack()
    assert set(s) == {"NVIDIA driver", "torch CUDA", "cuDNN", "NCCL"}
    assert s["NVIDIA driver"].startswith("none: no NVIDIA driver on this machine")
    for key in ("torch CUDA", "cuDNN", "NCCL"):
        assert s[key][0].isdigit() or s[key].startswith(("none:", "not available:")), (key, s[key])


def test_environment_rows_on_a_gpu_node_torch_cannot_use(fake_smi, cpu_torch):
    rows = {r["item"]: r["value"] for r in environment_rows("given explicitly", "quick")}
    assert rows["NVIDIA driver"] == "535.183.01 (from nvidia-smi)"
    assert rows["GPU 0"] == "NVIDIA A100-SXM4-80GB, 80.0 GiB (listed by the driver; torch cannot use it)"
    assert rows["GPU topology"] == "NVLink between every pair of the 2 GPUs (NV12)"
    assert environment.topology_text() == NVLINK2_TOPO.strip()
