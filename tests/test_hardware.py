from lab_utils.core import hardware


def test_peak_table_by_name():
    assert hardware.peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert hardware.peak_flops_per_s("NVIDIA H100 PCIe", "bf16") == 756e12
    assert hardware.peak_flops_per_s("NVIDIA H200", "bf16") == 989e12
    assert hardware.peak_flops_per_s("NVIDIA A100-SXM4-40GB", "bf16") == 312e12
    assert hardware.peak_flops_per_s("NVIDIA H100 80GB HBM3", "tf32") == 495e12
    assert hardware.peak_flops_per_s("NVIDIA H100 80GB HBM3", "fp32") == 67e12


def test_h200_nvl_is_not_the_sxm_part():
    assert hardware.peak_flops_per_s("NVIDIA H200 NVL", "bf16") == 835e12
    assert hardware.peak_flops_per_s("NVIDIA H200 NVL", "tf32") == 418e12
    assert hardware.peak_flops_per_s("NVIDIA H200 NVL", "fp32") == 60e12
    assert hardware.peak_flops_per_s("NVIDIA H200", "bf16") == 989e12
    assert hardware.peak_flops_per_s("NVIDIA H100 NVL", "bf16") == 835e12


def test_the_most_specific_pattern_wins_and_comes_first():
    """A name containing two patterns gets the longer one's peak, and the table lists the
    more specific pattern before any pattern it contains."""
    patterns = [p for p, _ in hardware.PEAK_TFLOPS]
    for i, general in enumerate(patterns):
        for specific in patterns[i + 1:]:
            assert general.lower() not in specific.lower(), f"{specific!r} must come before {general!r}"
    for pattern, peaks in hardware.PEAK_TFLOPS:
        assert hardware.peak_flops_per_s(f"NVIDIA {pattern}", "fp32") == peaks["fp32"] * 1e12


def test_unknown_device_has_no_peak():
    assert hardware.peak_flops_per_s("cpu (AMD EPYC)", "fp32") is None
    assert hardware.peak_flops_per_s("Mystery GPU 9000", "bf16") is None
    assert hardware.peak_flops_per_s(None) is None
    assert hardware.peak_flops_per_s("Tesla V100-SXM2-16GB", "bf16") is None  # Volta has no bf16
    assert hardware.fraction_of_peak(1e12, "cpu (x)", "fp32") is None


def test_fraction_of_peak():
    assert hardware.fraction_of_peak(494.5e12, "NVIDIA H100 80GB HBM3", "bf16") == 0.5


def test_summary_on_cpu():
    s = hardware.hardware_summary("cpu", 2)
    assert s["device_type"] == "cpu" and s["device_count"] == 2 and s["device_name"].startswith("cpu")


def test_torchvision_version_is_the_packages_own_without_importing_it(tmp_path, monkeypatch):
    """Records name torchvision's version with its build tag, read from the file (importing torchvision
    costs a second of CPU in every process that writes a record); the metadata's when the file is gone."""
    import importlib.metadata
    import subprocess
    import sys

    code = ("import sys; from lab_utils.core.hardware import software_versions; "
            "v = software_versions()['torchvision']; print(v, 'torchvision' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    out = res.stdout.split()
    import torchvision

    assert out == [torchvision.__version__, "False"]   # e.g. 0.29.2+cu132, and never imported
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('a broken build')\n")
    (fake / "version.py").write_text("__version__ = '9.9.9+cu999'\ngit_version = 'x'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision")
    assert hardware.torchvision_version() == "9.9.9+cu999"   # a broken torchvision still says which
    (fake / "version.py").unlink()
    assert hardware.torchvision_version() == importlib.metadata.version("torchvision")


def test_nccl_version_is_read_once_for_the_stack_and_the_handin(monkeypatch):
    """One reader of torch's NCCL version, for notebook 00's software stack and the hand-in's provenance."""
    import torch

    from lab_utils.core import environment

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert hardware.nccl_version() == "2.21.5"
    assert environment.software_stack(driver=None)["NCCL"] == "2.21.5"

    def no_nccl():
        raise RuntimeError("this torch was built without NCCL")

    monkeypatch.setattr(torch.cuda.nccl, "version", no_nccl)
    assert hardware.nccl_version() is None
    assert environment.software_stack(driver=None)["NCCL"] == "not available: this torch has no NCCL"
