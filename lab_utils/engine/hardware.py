"""What machine this is, and how fast its hardware could go.

Peak FLOP/s are *dense* (no structured sparsity) figures from the vendors' data sheets,
keyed by the name torch reports for the GPU. An unknown device has no peak: the lab
then shows no percentage of peak rather than a guessed one. Neither has a MIG slice
(``NVIDIA A100-SXM4-40GB MIG 1g.5gb``): it holds only part of the GPU's SMs, so the full
GPU's peak would make MFU and % of peak come out up to 7x too low (:func:`peak_note` says so).

GPU names for the result store are read without opening a CUDA context where possible
(:func:`device_name` asks ``nvidia-smi -L`` while CUDA is not initialized in this
process): a notebook kernel that only *names* its GPU must not take memory on GPU 0 before
it launches DDP ranks, one of which would then have less memory than its peers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from lab_utils.learn.errors import first_line

# Dense peak throughput in TFLOP/s per precision, from each part's NVIDIA data sheet (tests/test_hardware.py
# pins every number against it). "tf32" is what cuDNN uses for fp32 convolutions on Ampere and later
# unless torch.backends.cudnn.allow_tf32 is False, and what fp32 matmuls use only when
# torch.backends.cuda.matmul.allow_tf32 is True (off by default). Data sheets quote Ampere's and later
# tensor-core figures "with sparsity": the dense figure is half. Volta and Turing have no bf16 or tf32.
# A pattern matches the device name as a whole token (not inside a longer one: "A10" is not "A10G",
# "H200" not "GH200"); the longest pattern found wins ("H200 NVL" over "H200", the SXM part). A name no
# row matches (a V100 variant not listed, an A10G) has no peak: never a guessed one.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    # H100 data sheet: SXM 67 / 989* / 1,979*; PCIe 51 / 756* / 1,513*; NVL 60 / 835* / 1,671*
    # (FP32 / TF32 / BF16 = FP16, * with sparsity); the whitepaper's dense SXM5 figures 66.9 / 494.7 / 989.4
    ("H100 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    ("H100 PCIe", {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0}),
    ("H100", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),  # SXM5
    # H200 data sheet: SXM 67 / 989* / 1,979*; NVL (a PCIe card, below the 700 W SXM part) 60 / 835* / 1,671*
    ("H200 NVL", {"fp32": 60.0, "tf32": 418.0, "bf16": 835.0, "fp16": 835.0}),
    ("H200", {"fp32": 67.0, "tf32": 495.0, "bf16": 989.0, "fp16": 989.0}),  # SXM
    # A100 data sheet (40 and 80 GB, SXM and PCIe alike): 19.5 / 156 (312*) / 312 (624*)
    ("A100", {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0}),
    # L40S data sheet: 91.6 / 183 (366*) / 362.05 (733*)
    ("L40S", {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0}),
    # A10 data sheet: 31.2 / 62.5 (125*) / 125 (250*)
    ("A10", {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0}),
    # V100 data sheet (dense: no sparsity on Volta), FP32 / tensor (fp16): SXM2 15.7 / 125,
    # PCIe 14 / 112; V100S data sheet (PCIe): 16.4 / 130
    ("V100-SXM2", {"fp32": 15.7, "fp16": 125.0}),
    ("V100-PCIE", {"fp32": 14.0, "fp16": 112.0}),
    ("V100S", {"fp32": 16.4, "fp16": 130.0}),
    # Quadro RTX 8000 data sheet: FP32 16.3, tensor 130.5
    ("RTX 8000", {"fp32": 16.3, "fp16": 130.5}),
    # T4 data sheet: FP32 8.1, mixed precision (FP16/FP32) 65
    ("T4", {"fp32": 8.1, "fp16": 65.0}),
]


def _matches(pattern: str, device_name: str) -> bool:
    """``pattern`` in ``device_name`` as a whole token (case-insensitive): not inside a longer name."""
    token = rf"(?<![A-Za-z0-9]){re.escape(pattern)}(?![A-Za-z0-9])"
    return re.search(token, device_name, re.IGNORECASE) is not None


def peak_flops_per_s(device_name: str | None, precision: str = "bf16") -> float | None:
    """Dense peak FLOP/s of a GPU by its torch name at ``precision`` (``fp32``, ``tf32``, ``bf16``,
    ``fp16``); ``None`` for CPUs, GPUs not in the table, MIG slices (:func:`peak_note`) and
    precisions the GPU lacks."""
    if not device_name or mig_profile(device_name):
        return None
    found = [(pattern, peaks) for pattern, peaks in PEAK_TFLOPS if _matches(pattern, device_name)]
    if not found:
        return None
    tflops = max(found, key=lambda item: len(item[0]))[1].get(precision)
    return tflops * 1e12 if tflops is not None else None


_MIG = re.compile(r"\bMIG\s+(\d+g\.\d+gb)\b", re.IGNORECASE)


def mig_profile(device_name: str | None) -> str | None:
    """The MIG profile (``"1g.5gb"``) when ``device_name`` is a MIG slice, else ``None``."""
    m = _MIG.search(device_name or "")
    return m.group(1).lower() if m else None


def peak_note(device_name: str | None) -> str | None:
    """Why a GPU has no peak in this lab, in one phrase (``None`` when it has one, or is a CPU).

    A MIG slice gets *no* peak, not a guessed share: it has some of the GPU's SMs (1g is 14 of an
    A100's 108), and no data sheet the lab cites gives its share.
    """
    profile = mig_profile(device_name)
    if profile:
        return (f"MIG slice {profile}: no peak (a slice has only part of the GPU's SMs; the full "
                "GPU's peak would understate MFU up to 7x), so no MFU or % of peak")
    if device_name and not device_name.startswith("cpu") and peak_flops_per_s(device_name, "fp32") is None:
        return f"{device_name} is not in the lab's peak table: no MFU or % of peak"
    return None


def bf16_supported(device) -> bool:
    """bf16 runs *natively* on ``device``: any CPU; a CUDA GPU with bf16 units (compute capability 8.0+).

    ``torch.cuda.is_bf16_supported()`` defaults to ``including_emulation=True`` and answers
    True on a V100 (sm70), where bf16 is emulated and slower than fp32; the lab asks
    ``including_emulation=False``. torch before 2.5 has no such argument (requirements admit
    2.4): there the device's compute capability decides.
    """
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return True
    if dev.type != "cuda" or not torch.cuda.is_available():
        return False
    try:
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except TypeError:  # torch < 2.5: is_bf16_supported() counts emulation and takes no argument
        if torch.version.hip:
            return True
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_capability(index)[0] >= 8


def fp32_training_precision(device_name: str | None) -> str:
    """The peak to compare an fp32 ResNet run against: ``tf32`` where cuDNN may use it for its
    convolutions (``torch.backends.cudnn.allow_tf32``, True by default)."""
    import torch

    if device_name and peak_flops_per_s(device_name, "tf32") and torch.backends.cudnn.allow_tf32:
        return "tf32"
    return "fp32"


def fp32_matmul_precision(device_name: str | None) -> str:
    """The peak to compare fp32 matmuls (``torch.mm``, ``nn.Linear``) against: ``tf32`` only where
    ``torch.backends.cuda.matmul.allow_tf32`` is True (False by default, unlike cuDNN's flag) and the
    GPU has TF32; else ``fp32``."""
    import torch

    if device_name and peak_flops_per_s(device_name, "tf32") and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "fp32"


@dataclass
class GPUInfo:
    index: int
    name: str
    memory_bytes: int


def device_name(device: str | None = None) -> str:
    """Human name of the compute device: the GPU's name, or ``cpu (<model>)``.

    A GPU's name comes from torch when CUDA is initialized in this process; otherwise from
    ``nvidia-smi -L`` (:func:`visible_gpu_names`, the names torch would give), so that
    naming a GPU does not open a CUDA context on it. Without nvidia-smi, torch answers.
    """
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_initialized():
            names = visible_gpu_names()
            index = dev.index or 0  # no CUDA context yet: the current device is 0
            if names and index < len(names) and names[index]:
                return names[index]
        return torch.cuda.get_device_name(dev)
    return f"cpu ({cpu_model()})"


def nvidia_smi(*args: str, timeout_s: float = 20) -> str | None:
    """``nvidia-smi ARGS``'s output, or None (no nvidia-smi, an error, or no answer in ``timeout_s``)."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


_GPU_LINE = re.compile(r"^GPU\s+(\d+):\s+(.+?)\s+\(UUID:\s*(\S+?)\)\s*$")
_MIG_LINE = re.compile(r"^\s+MIG\s+(\S+)\s+Device\s+(\d+):\s+\(UUID:\s*(\S+?)\)\s*$")


@dataclass(frozen=True)
class SmiDevice:
    """One entry of ``nvidia-smi -L``: a GPU, or a MIG slice of one (``gpu_index`` its parent)."""

    gpu_index: int
    name: str            # as torch names it: "NVIDIA A100-SXM4-40GB" or "... MIG 1g.5gb"
    uuid: str
    mig: str | None = None


def smi_devices(text: str | None = None) -> list[SmiDevice] | None:
    """GPUs and MIG slices (after their GPU) listed by ``nvidia-smi -L`` (``text``: its output; None
    asks it); ``None`` when nvidia-smi is missing or fails."""
    text = nvidia_smi("-L") if text is None else text
    if text is None:
        return None
    out: list[SmiDevice] = []
    gpu: SmiDevice | None = None
    for line in text.splitlines():
        if m := _GPU_LINE.match(line.rstrip()):
            gpu = SmiDevice(int(m.group(1)), m.group(2).strip(), m.group(3))
            out.append(gpu)
        elif (m := _MIG_LINE.match(line.rstrip())) and gpu is not None:
            out.append(SmiDevice(gpu.gpu_index, f"{gpu.name} MIG {m.group(1)}", m.group(3), m.group(1)))
    return out


def visible_smi_devices(text: str | None = None) -> list[SmiDevice | None] | None:
    """The ``nvidia-smi -L`` entry of each CUDA device this process sees, in CUDA's order, without a
    CUDA context.

    nvidia-smi lists every GPU of the node, whatever ``CUDA_VISIBLE_DEVICES`` says: a GPU in MIG mode shows as
    its slices (CUDA enumerates the slices, not the GPU); an index or UUID in ``CUDA_VISIBLE_DEVICES`` picks
    the entry it names (``None`` for one it cannot resolve). ``None`` without nvidia-smi.
    """
    devices = smi_devices(text)
    if devices is None:
        return None
    gpus = [d for d in devices if d.mig is None]
    migs = {g.gpu_index: [d for d in devices if d.mig and d.gpu_index == g.gpu_index] for g in gpus}
    default = [x for g in gpus for x in (migs[g.gpu_index] or [g])]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(default)

    def named(token: str) -> SmiDevice | None:
        if not token.isdigit():
            return next((d for d in devices if d.uuid == token or d.uuid.startswith(token)), None)
        g = next((d for d in gpus if d.gpu_index == int(token)), None)
        return None if g is None else (migs[g.gpu_index] or [g])[0]

    return [named(t.strip()) for t in visible.split(",") if t.strip()]


def visible_gpu_names(text: str | None = None) -> list[str | None] | None:
    """The names of the CUDA devices this process sees, in CUDA's order (:func:`visible_smi_devices`;
    ``None`` for an entry of ``CUDA_VISIBLE_DEVICES`` it cannot resolve); ``None`` without nvidia-smi."""
    devices = visible_smi_devices(text)
    return None if devices is None else [d.name if d else None for d in devices]


def visible_gpu_indices(text: str | None = None) -> list[int | None] | None:
    """nvidia-smi's index of the GPU behind each CUDA device this process sees (a MIG slice: its GPU's),
    in CUDA's order: the rows and columns of ``nvidia-smi topo -m`` and of ``--query-gpu`` that are this
    process's devices. ``None`` without nvidia-smi."""
    devices = visible_smi_devices(text)
    return None if devices is None else [d.gpu_index if d else None for d in devices]


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
    out = nvidia_smi("topo", "-m")
    return (out or "").strip() or None


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


def cudnn_build_version() -> tuple[int | None, str | None]:
    """cuDNN's version (``92400``) and, when torch refuses it for these GPUs, why (else None).

    Without initialising CUDA in this process: ``torch.backends.cudnn.version()``'s first call checks
    cuDNN against every GPU's compute capability, which initialises CUDA (the notebook's kernel, the
    result store and the doctor must not, before they launch ranks) and raises on a V100 with cuDNN
    9.11 or later. So while CUDA is not initialised here the library's own version is read
    (``torch._C._cudnn.getVersionInt``, the value ``version()`` returns).
    """
    import torch

    if not torch.backends.cudnn.is_available():
        return None, None
    if torch.cuda.is_initialized():
        try:
            return torch.backends.cudnn.version(), None
        except RuntimeError as e:  # cuDNN 9.11+ on sm < 7.5
            return None, first_line(e, 160)
    try:
        from torch._C import _cudnn

        return int(_cudnn.getVersionInt()), None
    except (ImportError, AttributeError, RuntimeError):
        return None, None


def torchvision_version() -> str | None:
    """The installed torchvision's version with its build tag (``0.29.2+cu132``), None without one.

    Read from its ``version.py`` (the package's metadata lacks the tag), not by importing it: the import
    loads ``torchvision.models``, about a second of CPU in every kernel, runner and worker that writes a
    record and never uses torchvision otherwise.
    """
    try:
        spec = importlib.util.find_spec("torchvision")
    except (ImportError, ValueError):
        spec = None
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder) / "version.py"
        text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        found = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
        if found:
            return found.group(1)
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        return None


def nccl_version() -> str | None:
    """This torch's NCCL version ("2.21.5"), None without NCCL (a CPU-only build); opens no CUDA context."""
    import torch

    try:
        raw = torch.cuda.nccl.version()
    except Exception:  # CPU-only builds have no NCCL; any failure here means "not known"
        return None
    return ".".join(map(str, raw)) if isinstance(raw, tuple) else str(raw)


def software_versions() -> dict[str, str | None]:
    """Python, torch, torchvision, CUDA and cuDNN versions of this process."""
    import torch

    cudnn = cudnn_build_version()[0]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision_version(),
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


def classify_interconnect(topo_text: str | None, n_gpus: int, indices: list[int] | None = None) -> str | None:
    """From ``nvidia-smi topo -m``: ``"nvlink"`` when every pair of ``n_gpus`` GPUs has an ``NV#``
    link, ``"pcie"`` when none has, ``"mixed"`` otherwise; None when unknown. The GPUs are nvidia-smi's
    indices ``indices`` (this process's devices: :func:`visible_gpu_indices`; the matrix lists every GPU
    of the node), by default its first ``n_gpus``."""
    chosen = list(range(n_gpus) if indices is None else indices)[:n_gpus]
    if not topo_text or n_gpus < 2 or len(chosen) < n_gpus:
        return None
    lines = (re.match(r"GPU(\d+)\s+(.*)$", _ANSI.sub("", raw).strip()) for raw in topo_text.splitlines())
    links = {int(m.group(1)): m.group(2).split() for m in lines if m}
    if any(i not in links or len(links[i]) <= max(chosen) for i in chosen):
        return None
    nv = [links[i][j].upper().startswith("NV") for i in chosen for j in chosen if i != j]
    return "nvlink" if all(nv) else "mixed" if any(nv) else "pcie"
