"""The machine a plan of runs is made for: GPUs, their name, CPU cores, native bf16.

An experiment's ``plan(settings, machine, profile)`` decides from a :class:`Machine` alone where
each run goes (GPUs with NCCL, gloo CPU processes, or a row "needs 4 GPUs"), so the same plan is
made for this machine (:meth:`Machine.here`), for the time budget's node (:data:`BUDGET_NODE`,
4 x H100 SXM, on any laptop) and, in tests, for a GPU node that is not there.
"""

from __future__ import annotations

from dataclasses import dataclass

from lab_utils.engine.cuda_builds import query_driver
from lab_utils.engine.hardware import bf16_supported, cpu_cores, device_name, gpu_count


@dataclass(frozen=True)
class Machine:
    """``gpus`` visible CUDA devices named ``gpu_name`` (None without GPUs), ``cores`` CPU cores this
    process may use, ``bf16``: the GPUs run bf16 natively (compute capability 8.0+)."""

    gpus: int = 0
    gpu_name: str | None = None
    cores: int = 1
    bf16: bool = False

    @property
    def device(self) -> str:
        """Where the runs of a one-device experiment go: ``cuda`` with a GPU, else ``cpu``."""
        return "cuda" if self.gpus else "cpu"

    def describe(self) -> str:
        if self.gpus:
            return f"{self.gpus} x {self.gpu_name or 'GPU'}"
        return f"CPU, {self.cores} core{'s' if self.cores != 1 else ''}"

    @classmethod
    def here(cls) -> Machine:
        """This machine (GPU name through nvidia-smi where possible: no CUDA context is opened)."""
        gpus = gpu_count()
        return cls(gpus=gpus, gpu_name=device_name("cuda") if gpus else None, cores=cpu_cores(),
                   bf16=bool(gpus) and _native_bf16())


def _native_bf16() -> bool:
    """GPU 0 runs bf16 natively: from nvidia-smi's compute capability (8.0+) while this process has no
    CUDA context (asking torch would open one), else from torch."""
    import torch

    if not torch.cuda.is_initialized():
        driver = query_driver()
        caps = [g.compute_cap for g in (driver.gpus if driver else []) if g.compute_cap]
        if caps:
            return int(caps[0].split(".")[0]) >= 8
    return bf16_supported("cuda")


#: The node the time budget is for (docs/instructor.md, "Time budget"): 4 x H100 SXM, bf16 native.
BUDGET_NODE = Machine(gpus=4, gpu_name="NVIDIA H100 80GB HBM3", cores=64, bf16=True)
