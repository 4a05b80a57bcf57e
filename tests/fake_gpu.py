"""A stand-in for the GPU, so that CPU tests run the lab's CUDA-only branches.

No machine of this project has a GPU. The lab's GPU-only lines would otherwise run for the
first time in a student's session, so the tests run them here against :class:`FakeGPU`,
which patches ``torch.cuda`` (and, on request, ``torch.distributed.init_process_group``)
with a model of the device that is small enough to reason about:

- **device queries**: ``is_available``, ``device_count``, ``get_device_name``,
  ``get_device_properties`` (``name``, ``major``, ``minor``, ``total_memory``,
  ``multi_processor_count``), ``get_device_capability``, ``current_device``,
  ``set_device``. Arguments are checked the way torch checks them
  (``torch.cuda._utils._get_device_index``: ``set_device(torch.device("cuda"))`` raises).
- **a CUDA context model**: the calls that make real torch initialize CUDA
  (``_lazy_init``: names, properties, ``current_device``, ``set_device``, memory calls,
  events, ``synchronize``) set :attr:`FakeGPU.initialized` and open a context on a device
  (:attr:`FakeGPU.contexts`); ``is_available`` and ``device_count`` do not (NVML). A
  test can then say "this code opened no CUDA context before it launched DDP".
- **asynchrony on a controllable clock** (:class:`FakeClock`): :meth:`FakeGPU.launch`
  queues ``seconds`` of device work and returns at once, as a kernel launch does; the
  device finishes it later on the clock. ``synchronize`` moves the host clock to the end
  of the queued work; a timing ``Event`` records when the stream reaches it;
  ``elapsed_time`` is in milliseconds and refuses events made without
  ``enable_timing=True`` or not yet recorded, as torch does. Patch a module's
  ``time.perf_counter`` with :attr:`FakeGPU.clock` and a timer that forgets to
  synchronize measures the launch, not the work, exactly like on a GPU.
- **memory**: :meth:`FakeGPU.allocate` / :meth:`FakeGPU.release` move a per-device
  counter (:meth:`FakeGPU.tensor` holds memory while referenced, as a tensor does);
  allocating past ``set_per_process_memory_fraction`` x total raises
  ``torch.OutOfMemoryError`` with the caching allocator's message. ``memory_allocated``,
  ``max_memory_allocated``, ``reset_peak_memory_stats``, ``memory_reserved``,
  ``mem_get_info``, ``empty_cache`` (gives the cached blocks back) follow those counters.
  ``set_per_process_memory_fraction`` checks its arguments like torch: a ``float`` in
  [0, 1] and a device *with* an index.
- **bf16**: ``is_bf16_supported(including_emulation=True)`` answers as torch 2.5+ does
  (True on sm70 through emulation, False there with ``including_emulation=False``);
  ``old_torch=True`` gives torch 2.4's signature, which takes no argument.
- **nvidia-smi** (:meth:`FakeGPU.install_nvidia_smi`): a script on ``PATH`` that prints
  the driver (``--query-gpu=...`` as :mod:`lab_utils.core.cuda_builds` asks, and the
  banner), the GPUs and MIG slices (``-L``) and the topology (``topo -m``).
- **collectives**: :meth:`FakeGPU.gloo_for_nccl` makes ``init_process_group("nccl", ...)``
  create a gloo group instead and records what was asked (:attr:`FakeGPU.nccl_requests`):
  the code under test keeps taking its CUDA branch (``choose_backend`` answers nccl),
  while the collectives really run, over gloo.

What it cannot do: put a tensor on a GPU (``x.to("cuda")`` still fails on this CPU build),
so code that moves tensors runs with CPU tensors and the CUDA *decision* (a device object of
type ``cuda``); real stream asynchrony, NCCL, Inductor/Triton and CUPTI are left to
``python -m lab_utils doctor`` on a GPU node (tests/GPU_BRANCHES.md says which check).

Use the ``fake_gpu`` fixture (in conftest.py), configured through its arguments::

    def test_x(fake_gpu):
        gpu = fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB")
"""

from __future__ import annotations

import os
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
V100 = "Tesla V100-SXM2-16GB"
GIB = 2 ** 30
NO_INDEX = "Expected a torch.device with a specified index or an integer, but got:"  # torch's words

NVLINK_TOPO_4 = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\x1b[0m\n"
    "GPU0\t X \tNV12\tNV12\tNV12\t0-31\t0\n"
    "GPU1\tNV12\t X \tNV12\tNV12\t0-31\t0\n"
    "GPU2\tNV12\tNV12\t X \tNV12\t32-63\t1\n"
    "GPU3\tNV12\tNV12\tNV12\t X \t32-63\t1\n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
)


def topo_matrix(count: int, link: str = "NV12") -> str:
    """An ``nvidia-smi topo -m`` matrix of ``count`` GPUs, every pair joined by ``link``."""
    head = "\t" + "\t".join(f"GPU{i}" for i in range(count)) + "\tCPU Affinity\tNUMA Affinity\n"
    rows = "".join(f"GPU{i}\t" + "\t".join(" X " if i == j else link for j in range(count)) + "\t0-31\t0\n"
                   for i in range(count))
    return head + rows


@dataclass
class FakeClock:
    """Seconds on a clock that moves only when told (host and device share it)."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeEvent:
    """``torch.cuda.Event`` on the fake device's clock."""

    def __init__(self, gpu: FakeGPU, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.gpu = gpu
        self.enable_timing = enable_timing
        self.at: float | None = None

    def record(self, stream: Any = None) -> None:
        self.gpu._lazy_init()
        self.gpu.events_recorded += 1
        self.at = max(self.gpu.clock.now, self.gpu.busy_until)  # when the stream reaches it

    def query(self) -> bool:
        return self.at is not None and self.gpu.clock.now >= self.at

    def synchronize(self) -> None:
        if self.at is not None:
            self.gpu.clock.now = max(self.gpu.clock.now, self.at)

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds from this event to ``end`` (torch's unit), with torch's refusals."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not end.query():
            raise RuntimeError("CUDA error: device not ready")
        return (end.at - self.at) * 1e3


class DeviceMemory:
    """Memory on the fake device, given back to its caching allocator when this object goes."""

    def __init__(self, gpu: FakeGPU, nbytes: int, index: int):
        self.gpu, self.index, self.nbytes = gpu, index, 0
        gpu.allocate(nbytes, index)   # torch.OutOfMemoryError past the cap: nothing is held then
        self.nbytes = nbytes

    def __del__(self) -> None:
        if self.nbytes:
            self.gpu.release(self.nbytes, self.index)


@dataclass
class FakeGPU:
    """The model of the device(s); :meth:`patch` applies it to ``torch.cuda``."""

    count: int = 1
    name: str = A100
    major: int = 8
    minor: int = 0
    total_memory: int = 80 * GIB
    multi_processor_count: int = 108
    mig: str | None = None             # e.g. "1g.10gb": the GPUs are MIG slices of this profile
    driver: str = "550.127.05"
    cuda_version: str = "12.4"
    topo: str | None = None            # nvidia-smi topo -m; default: all pairs NVLink (NV12)
    old_torch: bool = False            # is_bf16_supported() without the including_emulation argument
    clock: FakeClock = field(default_factory=FakeClock)
    # state
    current: int = 0
    initialized: bool = False
    contexts: set[int] = field(default_factory=set)
    busy_until: float = 0.0
    synchronize_calls: list[int] = field(default_factory=list)
    events_recorded: int = 0
    allocated: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    reserved: dict[int, int] = field(default_factory=dict)
    fraction: dict[int, float] = field(default_factory=dict)
    empty_cache_calls: int = 0
    fraction_calls: list[tuple[float, int]] = field(default_factory=list)
    nccl_requests: list[dict[str, Any]] = field(default_factory=list)

    # ------------------------------------------------------------------ names
    @property
    def device_names(self) -> list[str]:
        """The names torch gives the visible devices (a MIG slice: ``<GPU> MIG <profile>``)."""
        return [f"{self.name} MIG {self.mig}" if self.mig else self.name] * self.count

    def index(self, device: Any = None, optional: bool = True) -> int:
        """The device index torch would use for ``device``, with torch's refusals
        (``torch.cuda._utils._get_device_index``): no index is the current device only where
        torch allows it (``optional``); ``set_device`` and the memory fraction need one."""
        if isinstance(device, str):
            device = torch.device(device)
        if device is None or (isinstance(device, torch.device) and device.index is None):
            if isinstance(device, torch.device) and device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            if not optional:
                raise ValueError(f"{NO_INDEX}{device}")
            return self.current
        if isinstance(device, torch.device):
            if device.type != "cuda":
                raise ValueError(f"Expected a cuda device, but got: {device}")
            i = device.index
        elif isinstance(device, int) and not isinstance(device, bool):
            i = device
        else:
            raise ValueError(f"{NO_INDEX}{device}")
        if not 0 <= i < self.count:
            raise RuntimeError("CUDA error: invalid device ordinal")
        return i

    def _lazy_init(self) -> None:
        """What real torch's ``_lazy_init`` does here: CUDA is initialized, a context on the
        current device is open."""
        self.initialized = True
        self.contexts.add(self.current)

    # ------------------------------------------------------------------ async work and time
    def launch(self, seconds: float, device: int | None = None) -> None:
        """Queue ``seconds`` of device work; returns at once (a kernel launch)."""
        self._lazy_init()
        self.busy_until = max(self.busy_until, self.clock.now) + seconds

    def synchronize(self, device: Any = None) -> None:
        self._lazy_init()
        self.synchronize_calls.append(self.index(device))
        self.clock.now = max(self.clock.now, self.busy_until)

    # ------------------------------------------------------------------ memory
    def allocate(self, nbytes: int, device: Any = None) -> None:
        """Allocate ``nbytes`` on ``device``; past the memory fraction, torch's OutOfMemoryError."""
        self._lazy_init()
        i = self.index(device)
        cap = self.fraction.get(i, 1.0) * self.total_memory
        used = self.allocated.get(i, 0)
        if used + nbytes > cap:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {nbytes / GIB:.2f} GiB. GPU {i} has a total "
                f"capacity of {self.total_memory / GIB:.2f} GiB of which {(cap - used) / GIB:.2f} GiB is "
                f"free. Of the allocated memory {used / GIB:.2f} GiB is allocated by PyTorch")
        self.allocated[i] = used + nbytes
        self.peak[i] = max(self.peak.get(i, 0), self.allocated[i])
        self.reserved[i] = max(self.reserved.get(i, 0), self.allocated[i])

    def tensor(self, nbytes: int, device: Any = None) -> DeviceMemory:
        """``nbytes`` of device memory held while the returned object lives (as a tensor holds it)."""
        return DeviceMemory(self, nbytes, self.index(device))

    def release(self, nbytes: int, device: Any = None) -> None:
        """Free ``nbytes``: back to the caching allocator (reserved until ``empty_cache``)."""
        i = self.index(device)
        self.allocated[i] = max(0, self.allocated.get(i, 0) - nbytes)

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated.get(self.index(device), 0)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak.get(self.index(device), 0)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._lazy_init()
        i = self.index(device)
        self.peak[i] = self.allocated.get(i, 0)

    def memory_reserved(self, device: Any = None) -> int:
        return self.reserved.get(self.index(device), 0)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._lazy_init()
        i = self.index(device)
        return self.total_memory - self.reserved.get(i, 0), self.total_memory

    def empty_cache(self) -> None:
        self.empty_cache_calls += 1
        if self.initialized:
            for i in list(self.reserved):
                self.reserved[i] = self.allocated.get(i, 0)

    def set_per_process_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        """torch's checks: a device with an index (or an int, or None: the current one), and a
        ``float`` in [0, 1] (an ``int`` 1 is a TypeError in torch)."""
        self._lazy_init()
        i = self.current if device is None else self.index(device, optional=False)
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.fraction[i] = fraction
        self.fraction_calls.append((fraction, i))

    # ------------------------------------------------------------------ queries
    def get_device_properties(self, device: Any = None) -> SimpleNamespace:
        self._lazy_init()
        i = self.index(device)
        return SimpleNamespace(name=self.device_names[i], major=self.major, minor=self.minor,
                               total_memory=self.total_memory,
                               multi_processor_count=self.multi_processor_count)

    def get_device_name(self, device: Any = None) -> str:
        return self.get_device_properties(device).name

    def get_device_capability(self, device: Any = None) -> tuple[int, int]:
        p = self.get_device_properties(device)
        return p.major, p.minor

    def current_device(self) -> int:
        self._lazy_init()
        return self.current

    def set_device(self, device: Any) -> None:
        self.current = self.index(device, optional=False)  # torch.device("cuda"): ValueError, as in torch
        self._lazy_init()

    def is_bf16_supported(self, *args: Any, **kwargs: Any) -> bool:
        if self.old_torch and (args or kwargs):
            raise TypeError("is_bf16_supported() got an unexpected keyword argument 'including_emulation'")
        including_emulation = (args or [kwargs.get("including_emulation", True)])[0]
        if self.major >= 8:
            return True
        return bool(including_emulation)  # torch then tries a bf16 tensor, which works on sm70

    # ------------------------------------------------------------------ applying it
    def patch(self, monkeypatch) -> FakeGPU:
        """Replace ``torch.cuda``'s functions with this model's (undone by ``monkeypatch``)."""
        cuda = torch.cuda
        gpu = self
        monkeypatch.setattr(cuda, "is_available", lambda: gpu.count > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: gpu.count)
        monkeypatch.setattr(cuda, "is_initialized", lambda: gpu.initialized)
        monkeypatch.setattr(cuda, "init", gpu._lazy_init)
        for name in ("get_device_name", "get_device_properties", "get_device_capability", "current_device",
                     "set_device", "synchronize", "memory_allocated", "max_memory_allocated",
                     "reset_peak_memory_stats", "memory_reserved", "mem_get_info", "empty_cache",
                     "set_per_process_memory_fraction", "is_bf16_supported"):
            monkeypatch.setattr(cuda, name, getattr(gpu, name))

        class Event(FakeEvent):
            def __init__(self, enable_timing: bool = False, blocking: bool = False,
                         interprocess: bool = False):
                super().__init__(gpu, enable_timing, blocking, interprocess)

        monkeypatch.setattr(cuda, "Event", Event)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
        return self

    def gloo_for_nccl(self, monkeypatch) -> FakeGPU:
        """``init_process_group("nccl", device_id=...)`` makes a gloo group and records the request."""
        import torch.distributed as dist

        real = dist.init_process_group
        gpu = self

        def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any):
            gpu.nccl_requests.append({"backend": backend, **kwargs})
            kwargs.pop("device_id", None)
            return real("gloo" if backend == "nccl" else backend, *args, **kwargs)

        monkeypatch.setattr(dist, "init_process_group", init_process_group)
        return self

    # ------------------------------------------------------------------ nvidia-smi
    def nvidia_smi_outputs(self) -> dict[str, str]:
        """What the fake ``nvidia-smi`` prints for each query."""
        gib = self.total_memory // 2 ** 20
        query = "".join(f"{i}, {self.name}, {gib}, {self.driver}\n" for i in range(self.count))
        listing = ""
        for i in range(self.count):
            listing += f"GPU {i}: {self.name} (UUID: GPU-0000000{i}-1111-2222-3333-444444444444)\n"
            if self.mig:
                uuid = f"MIG-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"
                listing += f"  MIG {self.mig:<10} Device  0: (UUID: {uuid})\n"
        banner = (f"+------------------------------------------------------------------+\n"
                  f"| NVIDIA-SMI {self.driver}   Driver Version: {self.driver}   CUDA Version: "
                  f"{self.cuda_version} |\n")
        topo = self.topo or topo_matrix(self.count)
        return {"query": query, "list": listing, "topo": topo, "banner": banner}

    def install_nvidia_smi(self, bin_dir: Path, monkeypatch=None) -> Path:
        """Write the fake ``nvidia-smi`` into ``bin_dir`` (and put it first on PATH with ``monkeypatch``)."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        for key, text in self.nvidia_smi_outputs().items():
            (bin_dir / f"smi_{key}.txt").write_text(text)
        script = bin_dir / "nvidia-smi"
        script.write_text(textwrap.dedent(f"""\
            #!/bin/sh
            case "$*" in
              *--query-gpu=index,name,memory.total,driver_version*) cat "{bin_dir}/smi_query.txt" ;;
              "-L") cat "{bin_dir}/smi_list.txt" ;;
              "topo -m") cat "{bin_dir}/smi_topo.txt" ;;
              *) cat "{bin_dir}/smi_banner.txt" ;;
            esac
            """))
        script.chmod(0o755)
        if monkeypatch is not None:
            monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        return bin_dir
