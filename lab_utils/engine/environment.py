"""What notebook 00 reports, and the check that a GPU node never runs the lab on its CPU.

- :func:`software_stack` and :func:`topology_summary`: the software stack every GPU number depends on
  (NVIDIA driver, torch's CUDA, cuDNN and NCCL) and how the GPUs are connected (NVLink or only PCIe:
  notebook 04's projections depend on it), which notebook 00's table shows
  (:func:`lab_utils.experiments.n00_environment.tables.environment_rows`). A piece that cannot be known
  says why (no driver, not in this container).
- :func:`check_gpu_node`: when the NVIDIA driver reports GPUs but torch cannot use
  them (a torch built for a newer CUDA than the driver runs, or a CPU-only build), the
  lab would silently fall back to the CPU; when torch sees them but has no kernels for
  their architecture (a CUDA 13 build on a V100), every GPU operation would fail with "no
  kernel image is available". ``session.start`` (notebook 00's first call), ``python -m
  lab_utils info``, ``run`` and ``doctor`` call it first: it raises a
  :class:`~lab_utils.learn.errors.LabError` naming the driver or the architecture, torch's build
  and the fix, unless (in the first case only) the quick profile was asked for explicitly, which
  then runs on the CPU with a warning.
"""

from __future__ import annotations

import os
import re
import sys

from lab_utils.engine import cuda_builds
from lab_utils.engine.hardware import (
    classify_interconnect,
    cudnn_build_version,
    interconnect,
    nccl_version,
)
from lab_utils.learn.errors import LabError

NO_DRIVER = "no NVIDIA driver on this machine (no nvidia-smi, no /proc/driver/nvidia/version)"
SYSTEM_TORCH = "load your cluster's PyTorch module and run `rm -rf .venv && make venv SYSTEM_TORCH=1`"


def _install(what: str, variant: str) -> str:
    return (f"install {what} with `make venv TORCH_VARIANT={variant}` (on a machine with internet, such as "
            f"the login node), or {SYSTEM_TORCH}")


# --------------------------------------------------------------------------- GPU node check


def _torch_build() -> tuple[str, str | None]:
    import torch

    return torch.__version__, torch.version.cuda


def _cuda_phrase(torch_version: str, torch_cuda: str | None, driver: cuda_builds.Driver) -> str:
    """How torch's build relates to the driver, as a phrase after 'torch X'."""
    if not torch_cuda:
        return f"torch {torch_version} is a CPU-only build (no CUDA)"
    need = cuda_builds.min_driver_for_cuda(torch_cuda)
    if need and driver.version and not cuda_builds.driver_at_least(driver.version, need):
        return f"torch {torch_version} is built for CUDA {torch_cuda}, which needs driver >= {need}"
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1", "none", "NoDevFiles"):
        return f"torch {torch_version} (CUDA {torch_cuda}) is shown no GPU (CUDA_VISIBLE_DEVICES={hidden!r})"
    return f"torch {torch_version} (CUDA {torch_cuda}) cannot initialise CUDA"


def _fix(torch_cuda: str | None, driver: cuda_builds.Driver) -> str:
    """The way out, for a torch that cannot use this driver's GPUs."""
    try:
        choice = cuda_builds.select_variant(driver.version)
    except cuda_builds.NoVariant:
        return f"this driver is too old for the lab's torch, so ask for a newer driver or {SYSTEM_TORCH}"
    need = cuda_builds.min_driver_for_cuda(torch_cuda)
    fits = need is None or not driver.version or cuda_builds.driver_at_least(driver.version, need)
    if torch_cuda and fits:
        return ("check that the job was given GPUs and CUDA_VISIBLE_DEVICES names them (a driver/library "
                "mismatch shows in `nvidia-smi` and `python -c 'import torch; torch.cuda.init()'`), "
                f"or {SYSTEM_TORCH}")
    return _install("the build for this driver", choice.variant)


def arch_problem(driver: cuda_builds.Driver | None) -> tuple[str, str] | None:
    """``(what is wrong, the fix)`` when torch sees the GPUs but its build has no kernels for one of them
    (compute capabilities from ``nvidia-smi``, no CUDA context opened; :func:`cuda_builds.arch_runs`
    decides). torch itself only compares the major, so a CUDA 13 build (sm_75+) passes on a V100."""
    import torch

    archs = torch.cuda.get_arch_list()
    if driver is None or not archs or torch.version.hip:
        return None
    lacking = [g for g in driver.gpus if g.compute_cap and not cuda_builds.arch_runs(g.compute_cap, archs)]
    if not lacking:
        return None
    g = lacking[0]
    sm = cuda_builds.sm_name(g.compute_cap)
    problem = (f"This node's {g.name} has compute capability {g.compute_cap} ({sm}), but torch "
               f"{_torch_build()[0]} has kernels for {', '.join(archs)} only, so every GPU operation would "
               "fail with 'no kernel image is available'")
    try:
        choice = cuda_builds.select_variant(driver.version, gpus=driver.gpus)
    except cuda_builds.NoVariant:
        return problem, f"no build of the lab's torch has {sm} kernels, so {SYSTEM_TORCH}"
    return problem, _install(f"a build that has {sm}", choice.variant)


def gpu_node_problem(driver: cuda_builds.Driver | None | str = "detect") -> tuple[str, str] | None:
    """``(what is wrong, the fix)`` when the driver reports GPUs that torch cannot use, or that torch
    sees but has no kernels for (:func:`arch_problem`), else None.

    Cheap where it does not apply: without ``nvidia-smi`` and ``/proc/driver/nvidia/version``
    there is no driver to ask; with one, ``nvidia-smi`` answers within its time limit.
    """
    import torch

    if torch.cuda.is_available():
        return arch_problem(cuda_builds.query_driver() if driver == "detect" else driver)
    if driver == "detect":
        driver = cuda_builds.query_driver()
    if driver is None or not driver.gpus:
        return None
    version, cuda = _torch_build()
    return f"This node's {driver.describe()}, but {_cuda_phrase(version, cuda, driver)}", _fix(cuda, driver)


def check_gpu_node(profile: str, why: str, driver: cuda_builds.Driver | None | str = "detect") -> str | None:
    """Refuse a CPU run on a GPU node whose GPUs torch cannot use (see the module's doc).

    ``profile``/``why`` as :func:`lab_utils.engine.config.resolve_profile_name` returns them. Raises
    :class:`~lab_utils.learn.errors.LabError`; an explicitly requested quick profile gets the warning (printed
    to stderr and returned) instead.
    """
    import torch

    found = gpu_node_problem(driver)
    if found is None:
        return None
    problem, fix = found
    if torch.cuda.is_available():  # torch would pick a GPU it has no kernels for, whatever the profile
        raise LabError(f"{problem}; {fix}.")
    if profile == "quick" and not why.startswith("automatic"):
        warning = (f"warning: {problem}; running the quick profile on the CPU as asked ({why}); "
                   f"to use the GPUs: {fix}.")
        print(warning, file=sys.stderr, flush=True)
        return warning
    raise LabError(f"{problem}, so the lab would run on the CPU; {fix}; or set LAB_PROFILE=quick to run the "
                   f"quick profile on the CPU on purpose.")


# --------------------------------------------------------------------------- what notebook 00 shows


def cudnn_version(raw: int | None) -> str | None:
    """cuDNN's integer version as text: 92400 -> ``9.24.0``, 8907 -> ``8.9.7``."""
    if not raw:
        return None
    if raw >= 90000:  # cuDNN 9: major*10000 + minor*100 + patch
        return f"{raw // 10000}.{raw % 10000 // 100}.{raw % 100}"
    return f"{raw // 1000}.{raw % 1000 // 100}.{raw % 100}"  # cuDNN 8: major*1000 + minor*100 + patch


def software_stack(driver: cuda_builds.Driver | None | str = "detect") -> dict[str, str]:
    """Driver, torch's CUDA, cuDNN and NCCL versions: each a version or the reason it is missing."""
    import torch

    if driver == "detect":
        driver = cuda_builds.query_driver()
    cpu_build = "this torch is a CPU-only build"
    out = {}
    if driver is None:
        out["NVIDIA driver"] = f"none: {NO_DRIVER}"
    elif not driver.version:
        out["NVIDIA driver"] = f"unknown: {driver.note or 'the driver did not say'}"
    else:
        where = ("nvidia-smi" if driver.source == "nvidia-smi" else
                 f"{driver.source}; nvidia-smi is not available in this container ({driver.note})")
        out["NVIDIA driver"] = f"{driver.version} (from {where})"
    out["torch CUDA"] = torch.version.cuda or f"none: {cpu_build}"
    raw, refused = cudnn_build_version()   # no CUDA context opened for it
    cudnn = cudnn_version(raw) or (f"none: {cpu_build}" if not torch.version.cuda
                                   else "none: this torch has no cuDNN")
    out["cuDNN"] = f"not usable here: {refused}" if refused else cudnn
    out["NCCL"] = nccl_version() or "not available: this torch has no NCCL"
    return out


def topology_summary(topo: str | None, driver: cuda_builds.Driver | None) -> str:
    """NVLink, only PCIe, or mixed, between the GPUs of ``nvidia-smi topo -m``; or why unknown."""
    if driver is None:
        return f"no GPUs: {NO_DRIVER}; DDP runs as gloo processes on the CPU"
    n_listed = len(driver.gpus)
    if n_listed == 0:
        return "no GPUs: the driver lists none here (e.g. a job given no GPU)"
    if topo is None:
        if n_listed == 1:
            return "one GPU: no GPU-to-GPU link"
        why = driver.note or "no output"
        return f"unknown: `nvidia-smi topo -m` is not available in this container ({why})"
    links: dict[str, list[str]] = {}  # GPU name -> its row; the header (also "GPU0 ...") is overwritten
    for line in topo.splitlines():
        r = re.sub(r"\x1b\[[0-9;]*m", "", line).split()
        if r and re.fullmatch(r"GPU\d+", r[0]):
            links[r[0]] = r[1:]
    gpu_rows = list(links.values())
    n = len(gpu_rows)
    if n < 2:
        return "one GPU: no GPU-to-GPU link" if n == 1 else "unknown: `nvidia-smi topo -m` listed no GPUs"
    kind = classify_interconnect(topo, n)
    if kind is None:
        return "unknown: the `nvidia-smi topo -m` matrix could not be read"
    codes = sorted({r[j] for i, r in enumerate(gpu_rows) for j in range(n) if i != j and len(r) >= n})
    shown = f" ({', '.join(codes)})"
    return {"nvlink": f"NVLink between every pair of the {n} GPUs{shown}",
            "pcie": f"PCIe only: no NVLink between the {n} GPUs{shown}",
            "mixed": f"mixed: NVLink between some pairs of the {n} GPUs only{shown}"}[kind]


def topology_text() -> str:
    """``nvidia-smi topo -m``, or one line saying why it cannot be shown (for notebook 00)."""
    topo = interconnect()
    if topo:
        return topo
    driver = cuda_builds.query_driver()
    if driver is None:
        return f"No GPU topology to show: {NO_DRIVER}."
    return ("No GPU topology to show: `nvidia-smi topo -m` is not available in this container "
            f"({driver.note}).")
