"""A stand-in for the GPU, so that CPU tests run the lab's CUDA-only branches.

No machine of this project has a GPU. The lab's GPU-only lines would otherwise run for the
first time in a student's session, so the tests run them here against :class:`FakeGPU`,
which patches ``torch.cuda`` (and, on request, ``torch.distributed``) with a model of the
device that is small enough to reason about and strict where bugs hide:

- **device queries**: ``is_available``, ``device_count``, ``get_device_name``,
  ``get_device_properties`` (``name``, ``major``, ``minor``, ``total_memory``,
  ``multi_processor_count``), ``get_device_capability``, ``current_device``,
  ``set_device``, ``get_arch_list`` (the build's architectures: :attr:`FakeGPU.arch_list`,
  by default one that has this GPU's). Arguments are checked the way torch checks them
  (``torch.cuda._utils._get_device_index``: ``set_device(torch.device("cuda"))`` raises).
- **a CUDA context model**: the calls that make real torch initialize CUDA
  (``_lazy_init``: names, properties, ``current_device``, ``set_device``, memory calls,
  events, streams, ``synchronize``) set :attr:`FakeGPU.initialized` and open a context on a
  device (:attr:`FakeGPU.contexts`); ``is_available``, ``device_count`` and
  ``get_arch_list`` do not (NVML, the build). A test can then say "this code opened no CUDA
  context before it launched DDP".
- **per-device streams on a controllable clock** (:class:`FakeClock`): every device has its
  default stream, ``torch.cuda.Stream(device)`` makes more, ``torch.cuda.stream(s)`` makes
  one current (and its device, as torch does). :meth:`FakeGPU.launch` queues ``seconds`` of
  work on a stream (the current stream of the current device by default) and returns at
  once, as a kernel launch does; streams run independently. ``synchronize(i)`` waits for
  device ``i``'s streams only, so syncing the wrong device leaves the right one's work
  unfinished and a timer short. A timing ``Event`` records when *its stream* reaches it
  and belongs to that stream's device: ``elapsed_time`` is in milliseconds and refuses events
  made without ``enable_timing=True``, not yet recorded, not yet reached, or recorded on
  different devices, as torch does. Patch a module's ``time.perf_counter`` with
  :attr:`FakeGPU.clock` and a timer that forgets to synchronize measures the launch, not the
  work, exactly like on a GPU.
- **memory, allocated vs reserved**: :meth:`FakeGPU.allocate` / :meth:`FakeGPU.release` move
  per-device counters like the caching allocator: a block is rounded up to 512 bytes and
  carved from the cached free bytes when they suffice, else from a new segment (2 MiB for a
  block under 1 MiB, 20 MiB under 10 MiB, else the block rounded up to 2 MiB); freed blocks
  stay *reserved* until ``empty_cache``. The cap of ``set_per_process_memory_fraction`` x
  total applies to reserved bytes (as in torch), and a failing allocation first gives the
  cached segments back and retries, as torch does. :meth:`FakeGPU.tensor` holds memory while
  referenced, as a tensor does. ``memory_allocated``, ``max_memory_allocated``,
  ``memory_reserved``, ``max_memory_reserved``, ``reset_peak_memory_stats``, ``mem_get_info``
  and ``empty_cache`` follow those counters. ``set_per_process_memory_fraction`` checks its
  arguments like torch: a ``float`` in [0, 1] and a device *with* an index.
- **each out-of-memory error on request** (:data:`OOM_STYLES`, :meth:`FakeGPU.oom_error`):
  past the cap, :meth:`FakeGPU.allocate` raises the caching allocator's
  ``torch.OutOfMemoryError``, or with ``oom_style`` set what cuDNN ("FIND was unable to find
  an engine ...", "Unable to find a valid cuDNN algorithm ...") or NCCL ("... Cuda failure 2
  'out of memory'") raise when they cannot get memory.
- **bf16**: ``is_bf16_supported(including_emulation=True)`` answers as torch 2.5+ does
  (True on sm70 through emulation, False there with ``including_emulation=False``);
  ``old_torch=True`` gives torch 2.4's signature, which takes no argument.
- **nvidia-smi** (:meth:`FakeGPU.install_nvidia_smi`): a script on ``PATH`` that answers exactly
  the queries the lab sends (:data:`SMI_QUERIES`): the driver and GPUs (``--query-gpu=...`` as
  :mod:`lab_utils.engine.cuda_builds` asks), each GPU's compute capability and compute mode, its PCIe
  link (``pcie.link.gen.max``, ``pcie.link.width.max``), the GPUs and MIG slices (``-L``) and the
  topology (``topo -m``), for every GPU of the node whatever ``CUDA_VISIBLE_DEVICES`` says (as
  nvidia-smi does). Any other query exits 2 and is logged: the ``fake_gpu`` fixture then fails the
  test (:meth:`FakeGPU.check_smi_queries`), so the lab cannot send a query nobody has answered.
- **visible devices**: :attr:`FakeGPU.count` is the node's GPUs (nvidia-smi's); ``device_count()``
  and every device index follow ``CUDA_VISIBLE_DEVICES`` (indices and ``GPU-``/``MIG-`` UUIDs; CUDA
  stops at the first entry it cannot resolve), and CUDA enumerates **one MIG device per process**
  (:meth:`FakeGPU.visible`).
- **exclusive-process mode**: with ``compute_mode="Exclusive_Process"`` a context on a GPU already
  held by another process fails as CUDA does ("CUDA-capable device(s) is/are busy or unavailable";
  ``Prohibited``: every context fails). :meth:`FakeGPU.process` runs a block as another process (a
  launched rank), with its own CUDA state.
- **NCCL's streams** (:meth:`FakeGPU.nccl_streams`): each device has an NCCL stream; a collective
  (``all_reduce``, ``broadcast``, ``barrier``, ...) waits there for the current stream, then queues
  :attr:`FakeGPU.collective_seconds` (a number, or a function of the collective's name and bytes) and
  returns at once, as ProcessGroupNCCL does. ``work.wait()``, a Future's ``wait()``/``value()`` and
  ``then()`` order streams (the current stream, or the callback's, waits for the collective), they do
  not block the host; a synchronous collective returns with the current stream waiting for it. So a
  collective timed on the host without a device synchronize reads short. ``barrier`` blocks the host
  until the current stream is done (ProcessGroupNCCL's barrier does).
- **first-call costs** (:attr:`FakeGPU.first_call_seconds` > 0): the first ``conv2d`` or ``linear``
  of each (shape, dtype, layout) costs that many host seconds on the fake clock (cuDNN's benchmark
  search and the caching allocator's first ``cudaMalloc`` of a shape; :attr:`FakeGPU.first_calls`),
  later calls of the same key nothing: a warm-up that misses a shape shows in the timed epoch.
- **collectives**: :meth:`FakeGPU.gloo_for_nccl` makes ``init_process_group("nccl", ...)``
  create a gloo group instead and records what was asked (:attr:`FakeGPU.nccl_requests`):
  the code under test keeps taking its CUDA branch (``choose_backend`` answers nccl),
  while the collectives really run, over gloo. Like NCCL, those collectives
  (``all_reduce``, ``broadcast``, ``all_gather``, ``reduce``, ...) refuse a tensor that is not
  on a GPU; a tensor is on the fake GPU when it was made there: with ``device=`` a CUDA
  device, by ``.to(cuda)`` or ``.cuda()`` (:meth:`FakeGPU.gloo_for_nccl` patches those
  factories to register the CPU tensor they return), or by :meth:`FakeGPU.on_device`.

What it cannot do: put a tensor on a GPU (``x.to("cuda")`` still fails on this CPU build
outside :meth:`FakeGPU.gloo_for_nccl`), so code that moves tensors runs with CPU tensors and
the CUDA *decision* (a device object of type ``cuda``); the result of an operation on a
registered tensor is a plain CPU tensor again. Real stream asynchrony, NCCL itself,
Inductor/Triton and CUPTI are left to ``python -m lab_utils doctor`` on a GPU node
(tests/GPU_BRANCHES.md says which check).

Use the ``fake_gpu`` fixture (in conftest.py), configured through its arguments::

    def test_x(fake_gpu):
        gpu = fake_gpu(count=2, name="NVIDIA A100-SXM4-80GB")
"""

from __future__ import annotations

import contextlib
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

A100 = "NVIDIA A100-SXM4-80GB"
H100 = "NVIDIA H100 80GB HBM3"
V100 = "Tesla V100-SXM2-16GB"
GIB = 2 ** 30
MIB = 2 ** 20
NO_INDEX = "Expected a torch.device with a specified index or an integer, but got:"  # torch's words
# The architecture lists of PyTorch's CUDA 12.6 and 13.x wheels (lab_utils/engine/cuda_builds.py cites them).
ARCHS_CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
ARCHS_CU130 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")

#: What each allocation failure says, as torch, cuDNN and NCCL word it (``{i}``: the device,
#: ``{gib}``: the request in GiB, and the allocator's counters).
OOM_STYLES: dict[str, str] = {
    "allocator": ("CUDA out of memory. Tried to allocate {gib:.2f} GiB. GPU {i} has a total capacity of "
                  "{total:.2f} GiB of which {free:.2f} GiB is free. Of the allocated memory {alloc:.2f} GiB "
                  "is allocated by PyTorch, and {cached:.2f} GiB is reserved by PyTorch but unallocated."),
    # cuDNN's v8/v9 API (torch's cudnn.benchmark) when no engine's workspace fits
    "cudnn_find": "FIND was unable to find an engine to execute this computation",
    # the legacy cuDNN API's algorithm search when every algorithm needs more memory than is left
    "cudnn_algo": "Unable to find a valid cuDNN algorithm to run convolution",
    # cublasCreate / cudnnCreate at a library's first call on a full GPU (torch's words around theirs)
    "cublas_init": "CUDA error: CUBLAS_STATUS_NOT_INITIALIZED when calling `cublasCreate(handle)`",
    "cudnn_init": "cuDNN error: CUDNN_STATUS_NOT_INITIALIZED",
    # NCCL cannot allocate its buffers (torch.distributed.DistBackendError)
    "nccl": ("NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, unhandled cuda "
             "error (run with NCCL_DEBUG=INFO for details), NCCL version 2.30.7\n"
             "ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
             "Cuda failure 2 'out of memory'"),
}

# : Every nvidia-smi query the lab sends (lab_utils.engine.cuda_builds, .hardware,
# lab_utils.experiments.n04_allreduce.experiment),
#: as its arguments joined by spaces -> the key of :meth:`FakeGPU.nvidia_smi_outputs` that answers it.
SMI_QUERIES: dict[str, str] = {
    "--query-gpu=index,name,memory.total,driver_version --format=csv,noheader,nounits": "query",
    "--query-gpu=index,compute_cap,compute_mode --format=csv,noheader": "caps",
    "--query-gpu=index,pcie.link.gen.max,pcie.link.width.max --format=csv,noheader,nounits": "pcie",
    "-L": "list",
    "topo -m": "topo",
}
#: What CUDA says when a context cannot be made on a device (cudaErrorDevicesUnavailable).
BUSY = "CUDA error: CUDA-capable device(s) is/are busy or unavailable"

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


class FakeStream:
    """``torch.cuda.Stream`` of one device: work queued on it finishes at :attr:`busy_until`."""

    def __init__(self, gpu: FakeGPU, index: int):
        self.gpu, self.index = gpu, index
        self.busy_until = 0.0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    def query(self) -> bool:
        return self.gpu.clock.now >= self.busy_until

    def synchronize(self) -> None:
        self.gpu.clock.now = max(self.gpu.clock.now, self.busy_until)

    def wait_stream(self, other: FakeStream) -> None:
        """Later work on this stream starts after the work queued on ``other`` so far."""
        self.busy_until = max(self.busy_until, other.busy_until)

    def wait_event(self, event: FakeEvent) -> None:
        if event.at is not None:
            self.busy_until = max(self.busy_until, event.at)

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or self.gpu.event()
        event.record(self)
        return event

    def __repr__(self) -> str:
        return f"<FakeStream cuda:{self.index} #{self.gpu.streams[self.index].index(self)}>"


class FakeEvent:
    """``torch.cuda.Event`` on the fake device's clock, recorded on one stream of one device."""

    def __init__(self, gpu: FakeGPU, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False):
        self.gpu = gpu
        self.enable_timing = enable_timing
        self.at: float | None = None
        self.device: int | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        self.gpu._lazy_init()
        stream = stream or self.gpu.current_stream()
        self.gpu.events_recorded += 1
        self.device = stream.index
        self.at = max(self.gpu.clock.now, stream.busy_until)  # when the stream reaches it

    def query(self) -> bool:
        return self.at is not None and self.gpu.clock.now >= self.at

    def synchronize(self) -> None:
        if self.at is not None:
            self.gpu.clock.now = max(self.gpu.clock.now, self.at)

    def wait(self, stream: FakeStream | None = None) -> None:
        (stream or self.gpu.current_stream()).wait_event(self)

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds from this event to ``end`` (torch's unit), with torch's refusals."""
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if self.device != end.device:   # cudaEventElapsedTime across devices
            raise RuntimeError("CUDA error: invalid resource handle")
        if not end.query():
            raise RuntimeError("CUDA error: device not ready")
        return (end.at - self.at) * 1e3


class FakeFuture:
    """The Future of a collective on the fake NCCL stream (a CUDA Future: completed once queued).

    ``wait()`` and ``value()`` make the current stream wait for the collective, not the host;
    ``then(fn)`` runs ``fn`` at once on the host, with a callback stream current that waits for the
    collective (so an event ``fn`` records is reached when the collective ends), and returns a
    completed ``torch.futures.Future`` of its result (what a DDP comm hook must return)."""

    def __init__(self, work: FakeWork, value: Any):
        self.work, self._value = work, value

    def done(self) -> bool:
        return True

    def wait(self) -> Any:
        self.work.wait()
        return self._value

    def value(self) -> Any:
        return self.wait()

    def then(self, fn):
        gpu = self.work.gpu
        s = gpu.new_stream(self.work.device)
        s.busy_until = max(s.busy_until, self.work.end)
        with gpu.stream(s):
            result = fn(self)
        out = torch.futures.Future()
        out.set_result(result)
        return out


class FakeWork:
    """A collective's Work on the fake NCCL stream: it ends at :attr:`end` (fake seconds)."""

    def __init__(self, gpu: FakeGPU, device: int, end: float, value: Any = None):
        self.gpu, self.device, self.end, self.value = gpu, device, end, value

    def wait(self, timeout: Any = None) -> bool:
        """ProcessGroupNCCL's ``WorkNCCL::wait``: the current stream waits for the collective; the host
        does not."""
        cur = self.gpu.current_stream(self.device)
        cur.busy_until = max(cur.busy_until, self.end)
        return True

    def is_completed(self) -> bool:
        return self.gpu.clock.now >= self.end

    def get_future(self) -> FakeFuture:
        return FakeFuture(self, self.value)


class DeviceMemory:
    """Memory on the fake device, given back to its caching allocator when this object goes."""

    def __init__(self, gpu: FakeGPU, nbytes: int, index: int):
        self.gpu, self.index, self.nbytes = gpu, index, 0
        self.segment = gpu.allocate(nbytes, index)   # an out-of-memory error past the cap: nothing held
        self.nbytes = nbytes

    def __del__(self) -> None:
        if self.nbytes:
            self.gpu.release(self.nbytes, self.index, self.segment)


@dataclass(eq=False)
class Segment:
    """One ``cudaMalloc`` of the caching allocator: ``size`` bytes reserved, ``used`` of them in blocks."""

    size: int
    used: int = 0


def block_bytes(nbytes: int) -> int:
    """The caching allocator's block for a request: rounded up to 512 bytes."""
    return max(512, -(-int(nbytes) // 512) * 512)


def segment_bytes(block: int) -> int:
    """The segment a new block is cut from: 2 MiB for small blocks, 20 MiB for medium, else 2 MiB steps."""
    if block < MIB:
        return 2 * MIB
    if block < 10 * MIB:
        return 20 * MIB
    return -(-block // (2 * MIB)) * (2 * MIB)


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
    compute_mode: str = "Default"      # nvidia-smi's compute mode: Default | Exclusive_Process | Prohibited
    pcie: tuple[int, int] = (4, 16)    # each GPU's PCIe link (generation, lanes), nvidia-smi's .max
    pcie_links: tuple[tuple[int, int], ...] | None = None   # per GPU (index order), overriding ``pcie``
    # seconds each collective takes on the NCCL stream: a number, or f(name, bytes) (nccl_streams)
    collective_seconds: Any = 0.0
    first_call_seconds: float = 0.0    # > 0: host seconds of the first conv2d/linear of each shape
    arch_list: tuple[str, ...] | None = None   # torch.cuda.get_arch_list(); None: a build that has this GPU's
    topo: str | None = None            # nvidia-smi topo -m; default: all pairs NVLink (NV12)
    old_torch: bool = False            # is_bf16_supported() without the including_emulation argument
    oom_style: str = "allocator"       # which error an allocation past the cap raises (OOM_STYLES)
    clock: FakeClock = field(default_factory=FakeClock)
    # state
    current: int = 0
    initialized: bool = False
    contexts: set[int] = field(default_factory=set)
    streams: dict[int, list[FakeStream]] = field(default_factory=dict)
    current_streams: dict[int, FakeStream] = field(default_factory=dict)
    synchronize_calls: list[int] = field(default_factory=list)
    events_recorded: int = 0
    allocated: dict[int, int] = field(default_factory=dict)
    peak: dict[int, int] = field(default_factory=dict)
    segments: dict[int, list[Segment]] = field(default_factory=dict)
    peak_reserved: dict[int, int] = field(default_factory=dict)
    fraction: dict[int, float] = field(default_factory=dict)
    empty_cache_calls: int = 0
    fraction_calls: list[tuple[float, int]] = field(default_factory=list)
    nccl_requests: list[dict[str, Any]] = field(default_factory=list)
    collectives: list[str] = field(default_factory=list)
    copies: list[tuple[int, bool]] = field(default_factory=list)   # to a GPU: (device, non_blocking)
    process_name: str = "this process"  # who opens contexts now (process(): a launched rank)
    first_calls: list[tuple] = field(default_factory=list)   # the (op, shape, dtype, layout) keys paid

    def __post_init__(self) -> None:
        if self.oom_style not in OOM_STYLES:
            raise ValueError(f"oom_style must be one of {sorted(OOM_STYLES)}, got {self.oom_style!r}")
        self._on_device: dict[int, tuple[weakref.ref, int]] = {}   # id(tensor) -> (the tensor, its GPU)
        self._other_processes: dict[str, tuple[bool, set[int]]] = {}   # name -> (initialized, contexts)
        self._nccl: dict[int, FakeStream] = {}
        self._smi_dirs: list[Path] = []

    # ------------------------------------------------------------------ names
    @property
    def device_names(self) -> list[str]:
        """The names torch gives the visible devices (a MIG slice: ``<GPU> MIG <profile>``)."""
        return [f"{self.name} MIG {self.mig}" if self.mig else self.name] * len(self.visible())

    @staticmethod
    def gpu_uuid(i: int) -> str:
        return f"GPU-0000000{i}-1111-2222-3333-444444444444"

    @staticmethod
    def mig_uuid(i: int) -> str:
        return f"MIG-0000000{i}-aaaa-bbbb-cccc-dddddddddddd"

    def visible(self) -> list[int]:
        """The node's GPUs (nvidia-smi indices) this process's CUDA devices 0, 1, ... are, in order.

        ``CUDA_VISIBLE_DEVICES`` as CUDA reads it: indices or (prefixes of) ``GPU-``/``MIG-`` UUIDs,
        enumeration stopping at the first entry that names no device; a MIG device (a GPU of
        :attr:`mig`, or a ``MIG-`` UUID) is enumerated alone, first come (one per process)."""
        env = os.environ.get("CUDA_VISIBLE_DEVICES")
        tokens = list(range(self.count)) if env is None else [t.strip() for t in env.split(",")]
        out: list[int] = []
        for t in tokens:
            if isinstance(t, int):
                i = t
            elif t.isdigit():
                i = int(t)
            elif not t:
                break
            else:
                i = next((j for j in range(self.count) if self.gpu_uuid(j).startswith(t)
                          or (self.mig and self.mig_uuid(j).startswith(t))), -1)
            if not 0 <= i < self.count or i in out:
                break
            out.append(i)
        return out[:1] if self.mig else out

    @property
    def compute_cap(self) -> str:
        return f"{self.major}.{self.minor}"

    def built_archs(self) -> tuple[str, ...]:
        """``torch.cuda.get_arch_list()`` of the fake's torch build."""
        if self.arch_list is not None:
            return tuple(self.arch_list)
        return ARCHS_CU126 if (self.major, self.minor) < (7, 5) else ARCHS_CU130

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
        if not 0 <= i < len(self.visible()):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return i

    def _lazy_init(self) -> None:
        """What real torch's ``_lazy_init`` does here: CUDA is initialized, a context on the
        current device is open; under EXCLUSIVE_PROCESS not where another process holds one
        (PROHIBITED: nowhere), as CUDA refuses it."""
        if self.current not in self.contexts:
            visible = self.visible()
            physical = visible[self.current] if self.current < len(visible) else self.current
            if self.compute_mode == "Prohibited" or (self.compute_mode == "Exclusive_Process"
                                                     and physical in self.held_elsewhere()):
                raise RuntimeError(BUSY)
        self.initialized = True
        self.contexts.add(self.current)

    def held_elsewhere(self) -> set[int]:
        """The node's GPUs (physical indices) on which another process holds a context."""
        visible = self.visible()
        return {visible[c] if c < len(visible) else c
                for _, (_, contexts) in self._other_processes.items() for c in contexts}

    @contextlib.contextmanager
    def process(self, name: str, stays: bool = False):
        """Run the block as process ``name`` (a launched rank): its own CUDA state (not initialized,
        no context, device 0 current), while this process's contexts stay open on their GPUs. The
        process ends with the block (its contexts close), unless it ``stays`` (then :meth:`process`
        with the same name resumes it)."""
        mine = (self.process_name, self.initialized, self.contexts, self.current)
        self._other_processes[self.process_name] = (self.initialized, self.contexts)
        self.process_name, self.current = name, 0
        self.initialized, self.contexts = self._other_processes.pop(name, (False, set()))
        try:
            yield self
        finally:
            if stays:
                self._other_processes[name] = (self.initialized, self.contexts)
            self.process_name, self.initialized, self.contexts, self.current = mine
            self._other_processes.pop(self.process_name, None)

    # ------------------------------------------------------------------ streams, async work and time
    def _streams_of(self, i: int) -> list[FakeStream]:
        if i not in self.streams:
            self.streams[i] = [FakeStream(self, i)]
        return self.streams[i]

    def default_stream(self, device: Any = None) -> FakeStream:
        self._lazy_init()
        return self._streams_of(self.index(device))[0]

    def current_stream(self, device: Any = None) -> FakeStream:
        self._lazy_init()
        i = self.index(device)
        return self.current_streams.get(i) or self._streams_of(i)[0]

    def new_stream(self, device: Any = None, priority: int = 0) -> FakeStream:
        """``torch.cuda.Stream(device)``: one more stream on that device."""
        self._lazy_init()
        i = self.index(device)
        s = FakeStream(self, i)
        self._streams_of(i).append(s)
        return s

    @contextlib.contextmanager
    def stream(self, s: FakeStream | None):
        """``torch.cuda.stream(s)``: ``s`` is its device's current stream, and its device the current
        device, inside the block (torch's StreamContext)."""
        if s is None:
            yield
            return
        before_dev, before = self.current, self.current_streams.get(s.index)
        self.current = s.index
        self.current_streams[s.index] = s
        try:
            yield
        finally:
            self.current = before_dev
            if before is None:
                self.current_streams.pop(s.index, None)
            else:
                self.current_streams[s.index] = before

    @property
    def busy_until(self) -> float:
        """When every queued piece of work, on every device, is done."""
        return max((s.busy_until for ss in self.streams.values() for s in ss), default=0.0)

    def launch(self, seconds: float, device: Any = None, stream: FakeStream | None = None) -> None:
        """Queue ``seconds`` of work on ``stream`` (default: the current stream of ``device``, or of
        the current device); returns at once (a kernel launch)."""
        self._lazy_init()
        s = stream or self.current_stream(device)
        s.busy_until = max(s.busy_until, self.clock.now) + seconds

    def synchronize(self, device: Any = None) -> None:
        """Wait for every stream of one device (the current one by default), not the others."""
        self._lazy_init()
        i = self.index(device)
        self.synchronize_calls.append(i)
        for s in self._streams_of(i):
            s.synchronize()

    def event(self, enable_timing: bool = False) -> FakeEvent:
        return FakeEvent(self, enable_timing)

    def nccl_stream(self, device: Any = None) -> FakeStream:
        """The NCCL stream of ``device`` (one per device, among its streams: ``synchronize`` waits for it)."""
        i = self.index(device)
        if i not in self._nccl:
            self._nccl[i] = FakeStream(self, i)
            self._streams_of(i).append(self._nccl[i])
        return self._nccl[i]

    def collective_cost(self, name: str, nbytes: int) -> float:
        """Seconds a collective ``name`` of ``nbytes`` takes (:attr:`collective_seconds`)."""
        c = self.collective_seconds
        return float(c(name, nbytes) if callable(c) else c)

    def enqueue_collective(self, name: str, device: Any = None, nbytes: int = 0) -> FakeWork:
        """What ProcessGroupNCCL does for one collective: its stream waits for the current stream, the
        collective is queued there (:meth:`collective_cost`), and the host goes on at once."""
        self._lazy_init()
        i = self.index(device)
        s = self.nccl_stream(i)
        s.wait_stream(self.current_stream(i))
        self.launch(self.collective_cost(name, nbytes), stream=s)
        self.collectives.append(name)
        return FakeWork(self, i, s.busy_until)

    # ------------------------------------------------------------------ memory
    def oom_error(self, style: str, nbytes: int = 0, device: int = 0) -> Exception:
        """The exception an allocation failure of ``style`` raises (:data:`OOM_STYLES`)."""
        text = OOM_STYLES[style]
        if style == "allocator":
            cap = self.fraction.get(device, 1.0) * self.total_memory
            alloc, res = self.allocated.get(device, 0), self.memory_reserved(device)
            text = text.format(gib=nbytes / GIB, i=device, total=self.total_memory / GIB,
                               free=max(0.0, cap - res) / GIB, alloc=alloc / GIB, cached=(res - alloc) / GIB)
            return torch.OutOfMemoryError(text)
        if style == "nccl":
            return torch.distributed.DistBackendError(text)
        return RuntimeError(text)

    def allocate(self, nbytes: int, device: Any = None) -> Segment:
        """Allocate ``nbytes`` on ``device`` through the caching allocator's model (see the module doc);
        past the memory fraction (reserved bytes), the error of :attr:`oom_style`. Returns the
        segment the block was cut from (:meth:`release` gives it back there)."""
        self._lazy_init()
        i = self.index(device)
        block = block_bytes(nbytes)
        segments = self.segments.setdefault(i, [])
        fits = [s for s in segments if s.size - s.used >= block]
        if not fits:                     # no cached free bytes that fit: a new segment
            cap = self.fraction.get(i, 1.0) * self.total_memory
            seg = segment_bytes(block)
            if self.memory_reserved(i) + seg > cap:   # torch frees the unused cached segments, tries again
                segments[:] = [s for s in segments if s.used]
            if self.memory_reserved(i) + seg > cap:
                raise self.oom_error(self.oom_style, nbytes, i)
            fits = [Segment(seg)]
            segments.append(fits[0])
            self.peak_reserved[i] = max(self.peak_reserved.get(i, 0), self.memory_reserved(i))
        chosen = min(fits, key=lambda s: s.size - s.used)   # best fit
        chosen.used += block
        self.allocated[i] = self.allocated.get(i, 0) + block
        self.peak[i] = max(self.peak.get(i, 0), self.allocated[i])
        return chosen

    def tensor(self, nbytes: int, device: Any = None) -> DeviceMemory:
        """``nbytes`` of device memory held while the returned object lives (as a tensor holds it)."""
        return DeviceMemory(self, nbytes, self.index(device))

    def release(self, nbytes: int, device: Any = None, segment: Segment | None = None) -> None:
        """Free ``nbytes`` (from ``segment``, default the newest that holds as much): back to the
        caching allocator, reserved until ``empty_cache``."""
        i = self.index(device)
        block = block_bytes(nbytes)
        if segment is None:
            segment = next((s for s in reversed(self.segments.get(i, [])) if s.used >= block), None)
        if segment is not None:
            segment.used = max(0, segment.used - block)
        self.allocated[i] = max(0, self.allocated.get(i, 0) - block)

    def memory_allocated(self, device: Any = None) -> int:
        return self.allocated.get(self.index(device), 0)

    def max_memory_allocated(self, device: Any = None) -> int:
        return self.peak.get(self.index(device), 0)

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._lazy_init()
        i = self.index(device)
        self.peak[i] = self.allocated.get(i, 0)
        self.peak_reserved[i] = self.memory_reserved(i)

    def memory_reserved(self, device: Any = None) -> int:
        return sum(s.size for s in self.segments.get(self.index(device), []))

    def max_memory_reserved(self, device: Any = None) -> int:
        return self.peak_reserved.get(self.index(device), 0)

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._lazy_init()
        i = self.index(device)
        return self.total_memory - self.memory_reserved(i), self.total_memory

    def empty_cache(self) -> None:
        """Give the cached (reserved, unallocated) segments back, on every device."""
        self.empty_cache_calls += 1
        if self.initialized:
            for segments in self.segments.values():
                segments[:] = [s for s in segments if s.used]

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
        monkeypatch.setattr(cuda, "is_available", lambda: len(gpu.visible()) > 0)
        monkeypatch.setattr(cuda, "device_count", lambda: len(gpu.visible()))
        monkeypatch.setattr(cuda, "is_initialized", lambda: gpu.initialized)
        monkeypatch.setattr(cuda, "init", gpu._lazy_init)
        monkeypatch.setattr(cuda, "get_arch_list", lambda: list(gpu.built_archs()))
        for name in ("get_device_name", "get_device_properties", "get_device_capability", "current_device",
                     "set_device", "synchronize", "memory_allocated", "max_memory_allocated",
                     "reset_peak_memory_stats", "memory_reserved", "max_memory_reserved", "mem_get_info",
                     "empty_cache", "set_per_process_memory_fraction", "is_bf16_supported",
                     "current_stream", "default_stream", "stream"):
            monkeypatch.setattr(cuda, name, getattr(gpu, name))

        class Event(FakeEvent):
            def __init__(self, enable_timing: bool = False, blocking: bool = False,
                         interprocess: bool = False):
                super().__init__(gpu, enable_timing, blocking, interprocess)

        def Stream(device: Any = None, priority: int = 0) -> FakeStream:  # noqa: N802 (torch's name)
            return gpu.new_stream(device, priority)

        monkeypatch.setattr(cuda, "Event", Event)
        monkeypatch.setattr(cuda, "Stream", Stream)
        monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
        if self.first_call_seconds > 0:
            self.first_call_costs(monkeypatch)
        return self

    def first_call_costs(self, monkeypatch) -> FakeGPU:
        """``F.conv2d`` and ``F.linear`` pay :attr:`first_call_seconds` (host time, on the fake clock) the
        first time they see an (input shape, dtype under autocast, memory layout): cuDNN's benchmark
        search and the allocator's first blocks of a shape, which block the host. :meth:`patch` applies
        it when :attr:`first_call_seconds` > 0; alone, it leaves ``torch.cuda`` as it is (CPU loaders)."""
        import torch.nn.functional as F

        gpu = self

        def costed(op: str, real):
            def call(x, *args, **kwargs):
                kind = x.device.type
                if kind not in ("cpu", "cuda"):   # meta tensors (FLOP counting): no kernel runs
                    return real(x, *args, **kwargs)
                dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype
                layout = ("channels_last" if x.dim() == 4 and not x.is_contiguous()
                          and x.is_contiguous(memory_format=torch.channels_last) else "contiguous")
                key = (op, tuple(x.shape), str(dtype), layout)
                if key not in gpu.first_calls:
                    gpu.first_calls.append(key)
                    gpu.clock.advance(gpu.first_call_seconds)
                return real(x, *args, **kwargs)
            return call

        for op in ("conv2d", "linear"):
            monkeypatch.setattr(F, op, costed(op, getattr(F, op)))
        return self

    # ------------------------------------------------------------------ tensors "on the GPU" (NCCL's view)
    def on_device(self, tensor: torch.Tensor, device: Any = None) -> torch.Tensor:
        """Register ``tensor`` (a CPU tensor) as living on a fake GPU; returns it."""
        key = id(tensor)
        self._on_device[key] = (weakref.ref(tensor, lambda _r, k=key: self._on_device.pop(k, None)),
                                self.index(device))
        return tensor

    def device_of(self, tensor: torch.Tensor) -> int | None:
        """The fake GPU ``tensor`` was made on, or None (a CPU tensor)."""
        ref, index = self._on_device.get(id(tensor), (None, None))
        return index if ref is not None and ref() is tensor else None

    def tensors_on_device(self, monkeypatch) -> FakeGPU:
        """``torch.tensor(..., device=cuda)``, ``torch.zeros(...)`` etc., ``.to(cuda)`` and ``.cuda()``
        return a CPU tensor registered as on that GPU (:meth:`on_device`); each copy to a GPU is
        recorded in :attr:`copies` with its ``non_blocking`` flag. Code that moves its batches to
        ``cuda`` then runs here, on CPU tensors (the model's parameters stay where they are)."""
        self._tensor_factories(monkeypatch)
        return self

    def _tensor_factories(self, monkeypatch) -> None:
        gpu = self

        def cuda_index(device: Any) -> int | None:
            if device is None or isinstance(device, torch.dtype):
                return None
            if isinstance(device, int) and not isinstance(device, bool):
                return gpu.index(device)
            dev = torch.device(device)
            return gpu.index(dev) if dev.type == "cuda" else None

        def factory(real):
            def make(*args, device=None, **kwargs):
                i = cuda_index(device)
                if i is None:
                    return real(*args, device=device, **kwargs)
                return gpu.on_device(real(*args, **kwargs), i)
            return make

        for name in ("tensor", "zeros", "ones", "empty", "full", "randn", "randint", "arange"):
            monkeypatch.setattr(torch, name, factory(getattr(torch, name)))
        real_to = torch.Tensor.to

        def to(self_t, *args, **kwargs):
            target = kwargs.get("device", args[0] if args else None)
            i = cuda_index(target) if not isinstance(target, torch.Tensor) else None
            if i is None:
                return real_to(self_t, *args, **kwargs)
            rest = {k: v for k, v in kwargs.items() if k in ("dtype", "copy")}
            out = real_to(self_t, **rest) if rest else self_t.clone()
            gpu.copies.append((i, bool(kwargs.get("non_blocking", False))))
            return gpu.on_device(out, i)

        monkeypatch.setattr(torch.Tensor, "to", to)
        def cuda(self_t, device=None, non_blocking=False):
            gpu.copies.append((gpu.index(device), bool(non_blocking)))
            return gpu.on_device(self_t.clone(), gpu.index(device))

        monkeypatch.setattr(torch.Tensor, "cuda", cuda)

    #: The collectives :meth:`nccl_streams` puts on the NCCL stream (``barrier`` is one too).
    COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                   "reduce_scatter_tensor")

    def nccl_streams(self, monkeypatch, refuse_cpu: bool = False) -> FakeGPU:
        """``torch.distributed``'s collectives run (their values: by the real backend, at once) and are
        timed on the device's NCCL stream as ProcessGroupNCCL times them (:meth:`enqueue_collective`):
        ``async_op=True`` returns a :class:`FakeWork`; without it the current stream waits for the
        collective and the host does not. ``barrier`` then blocks the host until the current stream is
        done. ``refuse_cpu``: a tensor not on a (fake) GPU is refused, as NCCL refuses it."""
        import torch.distributed as dist

        gpu = self

        def timed(name: str):
            collective = getattr(dist, name)

            def run(*args: Any, async_op: bool = False, **kwargs: Any):
                given = [a for x in (*args, *kwargs.values())
                         for a in (x if isinstance(x, list | tuple) else [x])]
                tensors = [t for t in given if isinstance(t, torch.Tensor)]
                if refuse_cpu and [t for t in tensors if gpu.device_of(t) is None]:
                    raise ValueError("Tensors must be CUDA and dense")   # ProcessGroupNCCL's own words
                real = collective(*args, async_op=async_op, **kwargs)
                if async_op and real is not None:
                    real.wait()            # the values are there at once; the time is on the stream
                where = next((d for t in tensors if (d := gpu.device_of(t)) is not None), None)
                nbytes = max((t.numel() * t.element_size() for t in tensors), default=0)
                work = gpu.enqueue_collective(name, where, nbytes)
                work.value = tensors
                if async_op:
                    return work
                work.wait()
                return None
            return run

        def barrier(*args: Any, async_op: bool = False, **kwargs: Any):
            ids = kwargs.pop("device_ids", None)   # a GPU index: gloo, running it here, has none
            dist_barrier(*args, async_op=False, **kwargs)
            work = gpu.enqueue_collective("barrier", ids[0] if ids else None, 4)
            work.wait()
            gpu.current_stream(work.device).synchronize()   # NCCL's barrier blocks the host
            return work if async_op else None

        dist_barrier = dist.barrier
        for name in self.COLLECTIVES:
            monkeypatch.setattr(dist, name, timed(name))
        monkeypatch.setattr(dist, "barrier", barrier)
        return self

    def gloo_for_nccl(self, monkeypatch) -> FakeGPU:
        """``init_process_group("nccl", device_id=...)`` makes a gloo group and records the request;
        the collectives then refuse tensors that are not on a (fake) GPU, as NCCL does, and are timed
        on the NCCL streams (:meth:`nccl_streams`)."""
        import torch.distributed as dist

        real = dist.init_process_group
        gpu = self

        def init_process_group(backend: str | None = None, *args: Any, **kwargs: Any):
            gpu.nccl_requests.append({"backend": backend, **kwargs})
            kwargs.pop("device_id", None)
            return real("gloo" if backend == "nccl" else backend, *args, **kwargs)

        monkeypatch.setattr(dist, "init_process_group", init_process_group)
        self.nccl_streams(monkeypatch, refuse_cpu=True)
        self._tensor_factories(monkeypatch)
        return self

    # ------------------------------------------------------------------ nvidia-smi
    def nvidia_smi_outputs(self) -> dict[str, str]:
        """What the fake ``nvidia-smi`` prints for each query (:data:`SMI_QUERIES`), for every GPU of
        the node (nvidia-smi ignores ``CUDA_VISIBLE_DEVICES``)."""
        mib = self.total_memory // 2 ** 20
        query = "".join(f"{i}, {self.name}, {mib}, {self.driver}\n" for i in range(self.count))
        caps = "".join(f"{i}, {self.compute_cap}, {self.compute_mode}\n" for i in range(self.count))
        links = self.pcie_links or (self.pcie,) * self.count
        pcie = "".join(f"{i}, {gen}, {width}\n" for i, (gen, width) in enumerate(links[:self.count]))
        listing = ""
        for i in range(self.count):
            listing += f"GPU {i}: {self.name} (UUID: {self.gpu_uuid(i)})\n"
            if self.mig:
                listing += f"  MIG {self.mig:<10} Device  0: (UUID: {self.mig_uuid(i)})\n"
        topo = self.topo or topo_matrix(self.count)
        return {"query": query, "caps": caps, "pcie": pcie, "list": listing, "topo": topo}

    def install_nvidia_smi(self, bin_dir: Path, monkeypatch=None) -> Path:
        """Write the fake ``nvidia-smi`` into ``bin_dir`` (and put it first on PATH with ``monkeypatch``).

        It answers the queries of :data:`SMI_QUERIES` exactly; any other exits 2 with nvidia-smi's
        words and appends its arguments to ``bin_dir/unknown_queries.txt``
        (:meth:`check_smi_queries`)."""
        bin_dir.mkdir(parents=True, exist_ok=True)
        for key, text in self.nvidia_smi_outputs().items():
            (bin_dir / f"smi_{key}.txt").write_text(text)
        cases = "".join(f'  "{args}") cat "{bin_dir}/smi_{key}.txt" ;;\n'
                        for args, key in SMI_QUERIES.items())
        script = bin_dir / "nvidia-smi"
        script.write_text(f"""#!/bin/sh
case "$*" in
{cases}  *) echo "$*" >> "{bin_dir}/unknown_queries.txt"
     echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help." >&2
     exit 2 ;;
esac
""")
        script.chmod(0o755)
        self._smi_dirs.append(bin_dir)
        if monkeypatch is not None:
            monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
        return bin_dir

    def unknown_smi_queries(self) -> list[str]:
        """The queries the fake nvidia-smi was sent and does not answer (:data:`SMI_QUERIES`)."""
        out = []
        for d in self._smi_dirs:
            log = d / "unknown_queries.txt"
            out += log.read_text().splitlines() if log.exists() else []
        return out

    def check_smi_queries(self) -> None:
        """Fail (AssertionError) if the lab sent nvidia-smi a query the fake does not answer: a new query
        must be added to :data:`SMI_QUERIES` with the output a real nvidia-smi gives."""
        unknown = self.unknown_smi_queries()
        assert not unknown, ("the lab sent nvidia-smi queries tests/fake_gpu.py does not answer (add them "
                             f"to SMI_QUERIES with a real nvidia-smi's output): {unknown}")
