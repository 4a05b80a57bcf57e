"""One distributed context for every torchrun worker: who this process is, and how to join.

``torchrun`` (or :func:`lab_utils.engine.launcher.launch`) starts one process per rank and sets
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT``. :func:`init_distributed` reads them, picks the backend (NCCL with one
GPU per local rank, else gloo between CPU processes) and the device, and joins the
process group. :func:`gather` brings every rank's Python object to every rank (the
workers gather their per-rank records this way, then aggregate with the slowest rank).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import sys
import traceback
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from lab_utils.engine import watchdog
from lab_utils.engine.hardware import hardware_summary
from lab_utils.engine.memory import is_out_of_memory, oom_reason
from lab_utils.engine.records import write_rank_failure
from lab_utils.learn.errors import LabError, first_line


@dataclass
class DistContext:
    """Who this process is. ``ddp`` is True when there is more than one rank."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    backend: str | None = None        # "nccl" | "gloo"; None without a process group
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def ddp(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def hardware(self) -> dict[str, Any]:
        """What a DDP record says about its devices: this rank's device name, the world size as
        ``device_count`` and ``processes``, and the backend (``hardware_summary`` plus the two)."""
        hw = hardware_summary(str(self.device), self.world_size)
        hw.update(processes=self.world_size, backend=self.backend)
        return hw


def free_port(avoid: Collection[int] = ()) -> int:
    """A TCP port free now on every IPv4 address of this machine, for a server that binds it later (a
    rendezvous, a daemon), other than those in ``avoid``.

    Chosen at random below the kernel's ephemeral range: a port the kernel hands out (bind to port
    0) may go to any new connection on this machine before that server binds it, and a server
    started seconds later (torchrun, a SLURM daemon) then fails with EADDRINUSE.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: below the range every system uses
        low = 32768
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10_000, max(low, 10_001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        if port not in avoid:
            return port
    raise LabError(f"No free TCP port found between 10000 and {low}; free some and re-run.")


def choose_backend(requested: str = "auto", local_world_size: int = 1) -> str:
    """NCCL when every local rank can have its own GPU (and NCCL exists), else gloo."""
    if requested != "auto":
        return requested
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= local_world_size and gpus > 0 and dist.is_nccl_available():
        return "nccl"
    return "gloo"


#: Seconds a rank may take to join an NCCL group (rendezvous and communicator initialization: seconds on
#: a healthy node); past them it ends, saying so in its failure file (``LAB_NCCL_INIT_TIMEOUT_S``
#: overrides). Without the bound, a start-up that hangs in NCCL (peer access, a network interface)
#: waits for the run's time limit with nothing in the rank logs.
NCCL_INIT_TIMEOUT_S = 300.0
NCCL_INIT_FIX = ("see the NCCL WARN lines in the rank logs; check peer access between the GPUs (nvidia-smi "
                 "topo -m; NCCL_P2P_DISABLE=1 to test) and the network interface (NCCL_SOCKET_IFNAME), or "
                 "raise LAB_NCCL_INIT_TIMEOUT_S")


def nccl_init_timeout_s() -> float:
    """:data:`NCCL_INIT_TIMEOUT_S`, or ``$LAB_NCCL_INIT_TIMEOUT_S`` when it is a positive number."""
    try:
        value = float(os.environ.get("LAB_NCCL_INIT_TIMEOUT_S", ""))
    except ValueError:
        return NCCL_INIT_TIMEOUT_S
    return value if value > 0 else NCCL_INIT_TIMEOUT_S


def init_distributed(backend: str = "auto", device: str = "auto", group_of_one: bool = True,
                     folder: str | None = None) -> DistContext:
    """Join the torchrun process group and return this rank's :class:`DistContext`.

    ``backend``: "auto" (:func:`choose_backend`), "nccl" or "gloo". ``device``: "auto",
    "cuda" (NCCL required) or "cpu" (gloo). Without torchrun (no ``RANK``), one process:
    with ``group_of_one`` it makes a process group of one on a free local port (so the
    DDP code paths run unchanged); without, it returns a context with no group. Joining NCCL is
    bounded by :func:`nccl_init_timeout_s`: past it the rank writes its failure file into
    ``folder`` (where it hung, which GPU) and ends (:mod:`lab_utils.engine.watchdog`).
    """
    if device == "cuda" and not torch.cuda.is_available():
        raise LabError("--device cuda was asked for but no CUDA device is visible; use --device auto or cpu.")
    if device == "cpu":
        backend = "gloo"
    elif device == "cuda":
        backend = "nccl"
    if "RANK" not in os.environ:
        if not group_of_one:
            use_cuda = device != "cpu" and torch.cuda.is_available()
            return DistContext(device=torch.device("cuda" if use_cuda else "cpu"))
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())})
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    backend = choose_backend(backend, local_world)
    here = not dist.is_initialized()
    if backend == "nccl":
        if torch.cuda.device_count() <= local_rank:
            raise LabError(f"Rank {rank} has LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} "
                           "GPUs are visible; start at most one process per GPU or use --backend gloo.")
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        if here:  # with device_id the communicator is made now (eager), inside the bound
            what = (f"joining NCCL (rendezvous and communicator initialization) on rank {rank} of {world}, "
                    f"GPU {dev}")
            limit = nccl_init_timeout_s()

            def hung(message: str) -> None:
                write_rank_failure(folder, rank, "error", f"{what} did not finish within {limit:g} s "
                                   "(NCCL_DEBUG=WARN lines in its log say why)", None)

            with watchdog.deadline(limit, what, NCCL_INIT_FIX, on_expiry=hung):
                dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        if here:
            dist.init_process_group("gloo")
    return DistContext(rank=rank, world_size=world, local_rank=local_rank, local_world_size=local_world,
                       backend=backend, device=dev)


def gather(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj`` on every rank, in rank order (a list of one without a group)."""
    if not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


#: Exit code of a rank that ended itself after running out of memory (:func:`failure_ends_rank`).
OOM_EXIT_CODE = 3


def end_rank(message: str, code: int = 1) -> NoReturn:
    """End this process now: ``message`` to stderr, then ``os._exit(code)``; no ``finally``, no
    ``destroy_process_group`` (with a peer waiting in a collective, NCCL's teardown can block).
    torchrun sees the rank exit and stops the other ranks at once."""
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    os._exit(code)


@contextlib.contextmanager
def failure_ends_rank(ctx: DistContext, folder: str | None = None, config_index: int | None = None
                      ) -> Iterator[None]:
    """Under DDP, an error raised in the block that would leave a peer waiting ends this rank at once.

    Under DDP (more than one rank) any error first writes the rank's failure file into ``folder``
    (:func:`lab_utils.engine.records.write_rank_failure`: ``oom`` or ``error``, one line, which
    configuration), so the launcher says why without reading the log's words. Then:

    - Out of memory (any backend): a rank that swallowed its own out-of-memory error and went on to
      its next collective would no longer match its peers, one of which may still be inside DDP's
      bucket all-reduce: the run would wait for the collective timeout (by default 10 minutes under
      NCCL, 30 under gloo: ``torch.distributed.constants.default_pg_nccl_timeout`` and
      ``default_pg_timeout``). So the rank prints the traceback and one line, and exits with
      :data:`OOM_EXIT_CODE`.
    - Any other exception under NCCL: the worker's teardown would call ``destroy_process_group()``,
      which under NCCL can block while a peer waits in a collective, so the rank would never exit.
      It prints the traceback and ``<Error> on rank R of N: <message>`` and leaves with ``os._exit(1)``.

    With one process (or another error under gloo, whose teardown does not wait) the error
    propagates unchanged.
    """
    try:
        yield
    except Exception as e:
        if not ctx.ddp:
            raise
        oom, first = is_out_of_memory(e), first_line(e, 300)
        write_rank_failure(folder, ctx.rank, "oom" if oom else "error",
                           oom_reason(e) if oom else f"{type(e).__name__}: {first}"[:300], config_index)
        if oom:
            traceback.print_exc()
            end_rank(f"torch.OutOfMemoryError on rank {ctx.rank} of {ctx.world_size}: {oom_reason(e)}; "
                     "this rank ends so that torchrun stops the others (no collective left unmatched)",
                     OOM_EXIT_CODE)
        if ctx.backend == "nccl":
            traceback.print_exc()
            end_rank(f"{type(e).__name__} on rank {ctx.rank} of {ctx.world_size}: {first}; this rank ends at "
                     "once (under NCCL, tearing the process group down while a peer waits in a collective "
                     "can block) so that torchrun stops the others")
        raise
