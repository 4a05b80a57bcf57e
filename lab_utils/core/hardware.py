"""What machine this is, and how fast its hardware could go.

Peak FLOP/s are *dense* (no structured sparsity) figures from the vendors' data sheets,
keyed by the name torch reports for the GPU. An unknown device has no peak: the lab
then shows no percentage of peak rather than a guessed one.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass

# Dense peak throughput in TFLOP/s per precision. "tf32" is what cuDNN uses for fp32
# convolutions on Ampere and later unless torch.backends.cudnn.allow_tf32 is False.
# Data sheets quote tensor-core figures "with sparsity": the dense figure is half.
# The most specific pattern found in the device name wins (the longest: "H200 NVL"
# over "H200"), and the table lists specific names first as well (NVL/PCIe before the
# generic name, which is the SXM part).
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("H100 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),  # SXM5
    # NVIDIA H200 data sheet (nvidia.com/en-us/data-center/h200, "H200 NVL" column):
    # FP32 60 TFLOPS; TF32 835 and BF16/FP16 1,671 TFLOPS with sparsity -> 418 / 835 dense.
    # The same figures as the H100 NVL row (a PCIe card, below the 700 W SXM part).
    ("H200 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    ("H200", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),  # SXM
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    ("V100", {"fp32": 15.7, "fp16": 125.0}),  # SXM2; no bf16/tf32 on Volta
    ("RTX 8000", {"fp32": 16.3, "fp16": 130.5}),
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
]


def peak_flops_per_s(device_name: str | None, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a GPU by its torch name, or ``None`` when unknown.

    ``precision`` is one of ``fp32``, ``tf32``, ``bf16``, ``fp16``. Returns ``None`` for
    CPUs, for GPUs not in the table, and for precisions the GPU lacks. When several
    patterns of :data:`PEAK_TFLOPS` occur in the name, the longest (most specific) wins.
    """
    if not device_name:
        return None
    name = device_name.lower()
    found = [(pattern, peaks) for pattern, peaks in PEAK_TFLOPS if pattern.lower() in name]
    if not found:
        return None
    _, peaks = max(found, key=lambda item: len(item[0]))  # "H200 NVL" beats "H200"
    tflops = peaks.get(precision)
    return tflops * 1e12 if tflops is not None else None


def fp32_training_precision(device_name: str | None) -> str:
    """The peak to compare an fp32 run against: ``tf32`` where cuDNN may use it."""
    import torch

    if device_name and peak_flops_per_s(device_name, "tf32") and torch.backends.cudnn.allow_tf32:
        return "tf32"
    return "fp32"


def fraction_of_peak(flops_per_s: float | None, device_name: str | None,
                     precision: str) -> float | None:
    """Achieved / peak, or ``None`` when either is unknown (never a guess)."""
    peak = peak_flops_per_s(device_name, precision)
    if peak is None or flops_per_s is None:
        return None
    return flops_per_s / peak


@dataclass
class GPUInfo:
    index: int
    name: str
    memory_bytes: int


def device_name(device: str | None = None) -> str:
    """Human name of the compute device: the GPU's name, or ``cpu (<model>)``."""
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({cpu_model()})"


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or the platform's processor string."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpus() -> list[GPUInfo]:
    """Visible CUDA devices with their names and total memory."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(GPUInfo(index=i, name=p.name, memory_bytes=int(p.total_memory)))
    return out


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def cpu_cores() -> int:
    """Cores this process may use (the scheduler's affinity mask, e.g. SLURM's)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def interconnect() -> str | None:
    """``nvidia-smi topo -m`` output (NVLink / PCIe matrix), or None without nvidia-smi."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def hardware_summary(device: str | None = None, device_count: int | None = None) -> dict:
    """What a record says about the hardware it was measured on.

    ``device_type`` is ``cuda`` or ``cpu``; ``device_count`` is how many devices the
    measurement used (defaults to the visible GPUs, or 1 CPU).
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.device(device).type
    if device_count is None:
        device_count = gpu_count() if dtype == "cuda" else 1
    return {"device_type": dtype, "device_name": device_name(device),
            "device_count": int(device_count), "cpu_cores": cpu_cores()}


def software_versions() -> dict[str, str | None]:
    """Python, torch, torchvision, CUDA and cuDNN versions of this process."""
    import torch

    try:
        import torchvision

        tv = torchvision.__version__
    except Exception:  # a broken torchvision must not stop a record being written
        tv = None
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": tv,
        "cuda": torch.version.cuda,
        "cudnn": str(cudnn) if cudnn else None,
    }


def describe_machine() -> dict:
    """Everything notebook 00 shows: GPUs, interconnect, CPU, versions."""
    import torch

    return {
        "gpus": [asdict(g) for g in gpus()],
        "cpu": cpu_model(),
        "cpu_cores": cpu_cores(),
        "interconnect": interconnect(),
        "software": software_versions(),
        "distributed_backends": {
            "nccl": torch.distributed.is_available() and torch.distributed.is_nccl_available(),
            "gloo": torch.distributed.is_available() and torch.distributed.is_gloo_available(),
        },
    }


# --------------------------------------------------------------------------- interconnect


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def classify_interconnect(topo_text: str | None, n_gpus: int) -> str | None:
    """From ``nvidia-smi topo -m``: ``"nvlink"`` when every pair of the first ``n_gpus`` GPUs
    has an ``NV#`` link, ``"pcie"`` when none has, ``"mixed"`` otherwise; None when unknown."""
    if not topo_text or n_gpus < 2:
        return None
    links: dict[int, list[str]] = {}
    for raw in topo_text.splitlines():
        line = _ANSI.sub("", raw).strip()
        m = re.match(r"GPU(\d+)\s+(.*)$", line)
        if not m:
            continue
        tokens = m.group(2).split()
        links[int(m.group(1))] = tokens[:n_gpus]
    if any(i not in links or len(links[i]) < n_gpus for i in range(n_gpus)):
        return None
    pairs = [links[i][j] for i in range(n_gpus) for j in range(n_gpus) if i != j]
    nv = [tok.upper().startswith("NV") for tok in pairs]
    if all(nv):
        return "nvlink"
    if not any(nv):
        return "pcie"
    return "mixed"
