"""lab_utils.engine.hardware: the peak table pinned against the vendors' data sheets, the machine's names."""

import pytest

from lab_utils.engine import hardware
from lab_utils.learn.flops import mfu

# Every number of hardware.PEAK_TFLOPS, dense (no structured sparsity), TFLOP/s, from the part's NVIDIA
# data sheet, keyed by a name torch gives that part. Ampere and later quote tensor figures "with
# sparsity": the dense figure is half of it (A100: TF32 312* -> 156, BF16 624* -> 312).
DATA_SHEETS: dict[str, tuple[str, dict[str, float]]] = {
    "H100 SXM": ("NVIDIA H100 80GB HBM3", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),
    "H100 PCIe": ("NVIDIA H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    "H100 NVL": ("NVIDIA H100 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    "H200 SXM": ("NVIDIA H200", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),
    "H200 NVL": ("NVIDIA H200 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    "A100": ("NVIDIA A100-SXM4-80GB", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    "L40S": ("NVIDIA L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    "A10": ("NVIDIA A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    "V100 SXM2": ("Tesla V100-SXM2-16GB", {"fp32": 15.7, "fp16": 125.0}),
    "V100 PCIe": ("Tesla V100-PCIE-32GB", {"fp32": 14.0, "fp16": 112.0}),
    "V100S": ("Tesla V100S-PCIE-32GB", {"fp32": 16.4, "fp16": 130.0}),
    "Quadro RTX 8000": ("Quadro RTX 8000", {"fp32": 16.3, "fp16": 130.5}),
    "T4": ("Tesla T4", {"fp32": 8.1, "fp16": 65.0}),
}
NUMBERS = [(part, name, precision, tflops) for part, (name, peaks) in DATA_SHEETS.items()
           for precision, tflops in peaks.items()]


@pytest.mark.parametrize("part, name, precision, tflops", NUMBERS,
                         ids=[f"{part}-{precision}" for part, _, precision, _ in NUMBERS])
def test_every_peak_is_its_data_sheets_dense_figure(part, name, precision, tflops):
    assert hardware.peak_flops_per_s(name, precision) == tflops * 1e12, (part, precision)


def test_the_table_has_exactly_the_data_sheets_rows_and_precisions():
    """No row or precision in the table that the data sheets above do not pin (a new row needs its
    numbers here); Volta and Turing have no bf16 or tf32."""
    assert len(hardware.PEAK_TFLOPS) == len(DATA_SHEETS)
    for part, (name, peaks) in DATA_SHEETS.items():
        for precision in ("fp32", "tf32", "bf16", "fp16"):
            if precision not in peaks:
                assert hardware.peak_flops_per_s(name, precision) is None, (part, precision)
    covered = {pattern for pattern, _ in hardware.PEAK_TFLOPS
               for name, _ in DATA_SHEETS.values() if hardware._matches(pattern, name)}
    assert covered == {pattern for pattern, _ in hardware.PEAK_TFLOPS}


def test_each_v100_is_its_own_part():
    """V100 PCIe, V100S and V100 SXM2 are distinct rows (MFU 11 % low on the PCIe card with the SXM2
    peak); a V100 variant without a row, and names that only contain a row's pattern, get no peak."""
    for name in ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"):
        assert hardware.peak_flops_per_s(name, "fp32") == 14.0e12
    assert hardware.peak_flops_per_s("Tesla V100-SXM2-32GB", "fp16") == 125.0e12
    assert hardware.peak_flops_per_s("Tesla V100S-PCIE-32GB", "fp16") == 130.0e12
    for name in ("Tesla V100-FHHL-16GB", "NVIDIA A10G", "NVIDIA GH200 480GB", "NVIDIA L40"):
        assert hardware.peak_flops_per_s(name, "fp32") is None, name


def test_h200_nvl_is_not_the_sxm_part():
    assert hardware.peak_flops_per_s("NVIDIA H200 NVL", "bf16") == 835e12
    assert hardware.peak_flops_per_s("NVIDIA H200", "bf16") == 989e12


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
    assert mfu(1e9, 1e3, hardware.peak_flops_per_s("cpu (x)", "fp32"), 1) is None


def test_fp32_matmuls_take_tf32_only_where_torch_allows_it():
    """torch.mm in fp32 runs true fp32 unless torch.backends.cuda.matmul.allow_tf32 (False by default);
    cuDNN's convolutions take TF32 unless torch.backends.cudnn.allow_tf32 is False (True by default)."""
    import torch

    a100 = "NVIDIA A100-SXM4-80GB"
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        assert hardware.fp32_matmul_precision(a100) == "fp32"
        assert hardware.fp32_training_precision(a100) == "tf32"
        torch.backends.cuda.matmul.allow_tf32 = True
        assert hardware.fp32_matmul_precision(a100) == "tf32"
        assert hardware.fp32_matmul_precision("Tesla V100-PCIE-16GB") == "fp32"   # no TF32 on Volta
        torch.backends.cudnn.allow_tf32 = False
        assert hardware.fp32_training_precision(a100) == "fp32"
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_fraction_of_peak_is_mfu_of_one_device():
    """By hand: 494.5 TFLOP/s on an H100 SXM (989 TFLOP/s dense bf16) is half its peak; 4 devices at
    1,978 TFLOP/s together, half theirs."""
    peak = hardware.peak_flops_per_s("NVIDIA H100 80GB HBM3", "bf16")
    assert peak == 989e12
    assert mfu(494.5e9, 1e3, peak, 1) == pytest.approx(0.5)
    assert mfu(1978e9, 1e3, peak, 4) == pytest.approx(0.5)


def test_summary_on_cpu():
    s = hardware.hardware_summary("cpu", 2)
    assert s["device_type"] == "cpu" and s["device_count"] == 2 and s["device_name"].startswith("cpu")


def test_torchvision_version_is_the_packages_own_without_importing_it(tmp_path, monkeypatch):
    """Records name torchvision's version with its build tag, read from the file (importing torchvision
    costs a second of CPU in every process that writes a record); the metadata's when the file is gone."""
    import importlib.metadata
    import subprocess
    import sys

    code = ("import sys; from lab_utils.engine.hardware import software_versions; "
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

    from lab_utils.engine import environment

    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert hardware.nccl_version() == "2.21.5"
    assert environment.software_stack(driver=None)["NCCL"] == "2.21.5"

    def no_nccl():
        raise RuntimeError("this torch was built without NCCL")

    monkeypatch.setattr(torch.cuda.nccl, "version", no_nccl)
    assert hardware.nccl_version() is None
    assert environment.software_stack(driver=None)["NCCL"] == "not available: this torch has no NCCL"
