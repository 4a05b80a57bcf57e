"""Data parallelism by hand (notebook 09): four ways to keep N replicas of a model equal.

After ``backward()`` every rank holds the gradient of ITS share of the global batch. If every rank
replaces it with the mean over ranks before the optimizer step, all replicas take the same step, and
that step equals one process trained on the whole global batch (the mean of the per-rank mean losses
is the global mean loss, for equal shares). The four ways differ only in how the mean is computed:

- (a) :class:`Naive`: one all-reduce per parameter tensor after ``backward()``, then divide: pays the
  latency alpha once per tensor (62 for ResNet-18);
- (b) :class:`Flat`: every gradient copied into one flat buffer, one all-reduce, copied back: alpha
  once, but nothing starts before ``backward()`` has ended;
- (c) :class:`Bucketed`: buckets of about ``bucket_bytes`` (:func:`assign_buckets`, last layers
  first); a gradient hook launches a bucket's all-reduce asynchronously as soon as its last gradient
  is ready, while backward goes on with earlier layers; the step waits for all of them (DDP's design);
- (d) :class:`ZeroOne` (ZeRO stage 1): the same all-reduce split into its two halves, reduce-scatter
  (each rank gets the summed gradient of its own shard, :func:`shard_bounds`) and all-gather (each
  rank hands out its updated shard); in between each rank steps only its shard, so it keeps the
  optimizer state (SGD's momentum) of 1/N of the parameters.

Each is an optimizer wrapper: ``step()`` synchronizes the gradients, then steps; the lab's one
training loop (:func:`lab_utils.core.loop.train_steps`) drives it like any optimizer. ``messages()``
lists the collectives of one step (kind, bytes), from which :func:`bytes_sent_per_rank` and
:func:`predicted_seconds` (the alpha-beta model of :mod:`lab_utils.core.ring`) follow.
:func:`run_in_ranks` runs a function in N forked gloo processes (the tests' and the graded
exercise's way to check code on 2 ranks without torchrun).
"""

from __future__ import annotations

import datetime
import os
import pickle
import select
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.core.ring import ring_allreduce_seconds, ring_bytes_per_rank

#: ``(rtol, atol)`` of ``torch.allclose`` by the parameters' dtype: an implementation equals one process
#: when only the order of the sums differs (a ring adds rank by rank, one process micro-batch by
#: micro-batch): units in the last place. In float32 (2^-24) such a difference can grow a thousandfold
#: in a step of this recipe (BatchNorm over a few images, lr 0.1: a ReLU that flips), so the check runs
#: in float64, where it stays near 1e-16; its tolerance is far above that and far below any real bug.
#: A bf16 all-reduce (the compression hook) is lossy by design: no tolerance calls it equal.
TOLERANCE: dict[str, tuple[float, float]] = {"float64": (1e-7, 1e-9), "float32": (1e-4, 1e-5)}
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"


def assign_buckets(sizes_bytes: Sequence[int], cap_bytes: float) -> list[list[int]]:
    """Parameter indices (``model.parameters()`` order) grouped into all-reduce buckets.

    Backward produces the last layer's gradient first, so buckets are filled in REVERSE order; a
    bucket holds at most ``cap_bytes`` (a tensor larger than the cap is a bucket of its own); every
    index is in exactly one bucket."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_bytes))):
        if current and filled + sizes_bytes[i] > cap_bytes:
            buckets.append(current)
            current, filled = [], 0
        current.append(i)
        filled += sizes_bytes[i]
    if current:
        buckets.append(current)
    return buckets


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's shard of ``numel`` elements: together they cover every element
    once, in order; sizes differ by at most one (the first ``numel % world_size`` ranks hold one more)."""
    base, extra = divmod(numel, world_size)
    return [(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra)) for r in range(world_size)]


class Local:
    """No communication: each rank steps on its own gradient (the replicas drift apart). The
    baseline a step with gradient synchronization is compared with (exposed communication)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        self.sync()
        self.optimizer.step()

    def sync(self) -> None:
        """Make every rank's gradients the mean over ranks (here: nothing)."""

    def messages(self) -> list[tuple[str, int]]:
        """The collectives of one step: ``(kind, bytes of the buffer)``."""
        return []


class Naive(Local):
    """(a) After backward, one all-reduce per gradient tensor, then divide by the number of ranks."""

    def sync(self) -> None:
        for p in self.params:
            dist.all_reduce(p.grad)     # the SUM over ranks, one message per tensor
            p.grad /= self.world        # the mean: the gradient of the global batch

    def messages(self) -> list[tuple[str, int]]:
        return [(ALL_REDUCE, p.numel() * p.element_size()) for p in self.params]


class Flat(Local):
    """(b) All gradients in one flat buffer, one all-reduce, then copied back."""

    def sync(self) -> None:
        grads = [p.grad for p in self.params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))

    def messages(self) -> list[tuple[str, int]]:
        return [(ALL_REDUCE, sum(p.numel() * p.element_size() for p in self.params))]


class Bucketed(Local):
    """(c) Buckets of at most ``bucket_bytes``, each all-reduced asynchronously as soon as its last
    gradient is ready (during backward), in bucket order only, so every rank issues its collectives in
    the same order (as in DDP); ``sync`` waits for all of them before the optimizer step."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: float):
        super().__init__(model, optimizer)
        sizes = [p.numel() * p.element_size() for p in self.params]
        groups = assign_buckets(sizes, bucket_bytes)
        self.buckets = [[self.params[i] for i in g] for g in groups]
        self.sizes = [sum(sizes[i] for i in g) for g in groups]
        self.ready = [0] * len(self.buckets)
        self.launched: list[tuple[int, torch.Tensor, Any]] = []
        for k, bucket in enumerate(self.buckets):
            for p in bucket:
                p.register_post_accumulate_grad_hook(partial(self._on_gradient, k))

    def _on_gradient(self, k: int, param: torch.Tensor) -> None:
        """Autograd calls this when ``param.grad`` is complete; a full bucket's all-reduce starts now."""
        self.ready[k] += 1
        while len(self.launched) < len(self.buckets):
            nxt = len(self.launched)
            if self.ready[nxt] < len(self.buckets[nxt]):
                break
            flat = torch.cat([p.grad.reshape(-1) for p in self.buckets[nxt]])
            self.launched.append((nxt, flat, dist.all_reduce(flat, async_op=True)))

    def sync(self) -> None:
        for k, flat, work in self.launched:
            work.wait()
            flat /= self.world
            for p, part in zip(self.buckets[k], flat.split([p.numel() for p in self.buckets[k]])):
                p.grad.copy_(part.view_as(p))
        if len(self.launched) != len(self.buckets):
            raise RuntimeError(f"only {len(self.launched)} of {len(self.buckets)} buckets were all-reduced: "
                               "a parameter got no gradient in this backward")
        self.launched, self.ready = [], [0] * len(self.buckets)

    def messages(self) -> list[tuple[str, int]]:
        return [(ALL_REDUCE, s) for s in self.sizes]


class ZeroOne(Local):
    """(d) ZeRO-1: the parameters live in one flat buffer cut into N shards (:func:`shard_bounds`);
    each rank keeps the optimizer state of its shard only. A step: reduce-scatter the gradients (each
    rank receives the summed gradient of its shard), step the shard, all-gather the updated shards.
    Shards are padded to the largest one for the two collectives."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer)
        rank = dist.get_rank()
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])
        offset = 0
        for p in self.params:  # each parameter becomes a view into the flat buffer
            p.data = self.flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.bounds = shard_bounds(self.flat.numel(), self.world)
        self.pad = max(end - start for start, end in self.bounds)
        start, end = self.bounds[rank]
        self.shard = torch.nn.Parameter(self.flat[start:end])  # a view: stepping it updates the model
        self.optimizer = type(optimizer)([self.shard], **optimizer.defaults)  # state for the shard only
        self.full = optimizer  # zero_grad clears the model's gradients through it

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.full.zero_grad(set_to_none=set_to_none)

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` laid out as N rows of ``pad`` elements, row r holding shard r."""
        out = flat.new_zeros(self.world, self.pad)
        for r, (start, end) in enumerate(self.bounds):
            out[r, :end - start] = flat[start:end]
        return out

    def sync(self) -> None:
        grads = torch.cat([p.grad.reshape(-1) for p in self.params])
        mine = grads.new_empty(self.pad)
        dist.reduce_scatter_tensor(mine, self._padded(grads).reshape(-1))  # the sum of my shard only
        start, end = self.bounds[dist.get_rank()]
        self.shard.grad = mine[:end - start] / self.world

    def step(self) -> None:
        self.sync()
        self.optimizer.step()           # only my shard: my 1/N of the momentum
        start, end = self.bounds[dist.get_rank()]
        mine = self.flat.new_zeros(self.pad)
        mine[:end - start] = self.shard.detach()
        gathered = self.flat.new_empty(self.world * self.pad)
        dist.all_gather_into_tensor(gathered, mine)   # every rank's updated shard, everywhere
        for r, (s, e) in enumerate(self.bounds):
            self.flat[s:e] = gathered[r * self.pad:r * self.pad + e - s]

    def messages(self) -> list[tuple[str, int]]:
        padded = self.world * self.pad * self.flat.element_size()
        return [(REDUCE_SCATTER, padded), (ALL_GATHER, padded)]


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors an optimizer keeps between steps (SGD: one momentum buffer per parameter)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t))


def bytes_sent_per_rank(messages: Sequence[Sequence[Any]], world_size: int) -> float:
    """Bytes one rank sends per step in ring collectives: ``2(P-1)/P x S`` per all-reduce of S bytes,
    half that per reduce-scatter or all-gather (an all-reduce is one of each)."""
    return sum(ring_bytes_per_rank(size, world_size) * (1.0 if kind == ALL_REDUCE else 0.5)
               for kind, size in messages)


def predicted_seconds(messages: Sequence[Sequence[Any]], world_size: int, alpha_seconds: float,
                      bandwidth_bytes_per_s: float, overlaps: bool) -> tuple[float, float]:
    """(communication, exposed) seconds of one step by the ring's alpha-beta model: every collective
    one after the other, ``2(P-1) alpha + 2(P-1)/P x S / B`` per all-reduce, half per reduce-scatter or
    all-gather; exposed is all of it, or where the collectives ``overlaps`` backward (bucketed, DDP) the
    last one alone, whose gradients are ready only when backward ends (a lower bound)."""
    times = [ring_allreduce_seconds(size, world_size, alpha_seconds, bandwidth_bytes_per_s)
             * (1.0 if kind == ALL_REDUCE else 0.5) for kind, size in messages]
    total = sum(times)
    return total, (times[-1] if overlaps and times else total)


def slowest_per_step(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each synchronized step's time: the slowest rank's (no rank finishes a collective before the last
    one arrives, as :mod:`lab_utils.core.ranks` says of epochs). ``per_rank[r][s]``: rank r, step s."""
    return [max(step) for step in zip(*per_rank)]


# --------------------------------------------------------------------------- N gloo ranks by fork


def run_in_ranks(fn: Callable[[int, int], Any], world_size: int, timeout_s: float = 20.0) -> list[Any]:
    """``fn(rank, world_size)`` in ``world_size`` forked processes joined in a gloo process group (over
    loopback: it works without a network, e.g. in the grading sandbox); their results in rank order.

    A rank that raises gives ``{"error": "<Type>: <message>"}``; one still running after ``timeout_s``
    is killed and gives ``{"error": "timed out"}``. Fork keeps whatever ``fn`` is (a notebook's
    function too) without pickling it; nothing CUDA may have been initialized in this process.

    No rank exits before every rank has answered: a rank that has answered waits for this process to
    close ``release``. A rank that exits sooner closes its sockets, and a peer still inside
    ``init_process_group`` then fails with gloo's "Connection closed by peer" (once in a loaded test
    run: the blank exercise answers at once on rank 0)."""
    folder = tempfile.mkdtemp(prefix="lab-ranks-")
    pids, pipes = [], []
    release, release_w = os.pipe()
    for rank in range(world_size):
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank: never returns into the caller's code
            os.close(read_fd)
            os.close(release_w)
            _rank_main(fn, rank, world_size, os.path.join(folder, "store"), write_fd, release, timeout_s)
        os.close(write_fd)
        pids.append(pid)
        pipes.append(read_fd)
    got: dict[int, bytes | None] = {}
    try:
        got = _collect(pipes, time.monotonic() + timeout_s)
    finally:  # also on Ctrl-C (a kernel interrupt): no rank is left waiting for its release
        os.close(release_w)  # every rank that answered exits now
        os.close(release)
        for pid, fd in zip(pids, pipes):
            if got.get(fd) is None:
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        shutil.rmtree(folder)
    return [pickle.loads(got[fd]) if got[fd] else {"error": "timed out"} for fd in pipes]


def _rank_main(fn: Callable[[int, int], Any], rank: int, world: int, store: str, out_fd: int,
               release: int, timeout_s: float) -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # no network needed (a sandbox has only loopback)
    torch.set_num_threads(1)  # no OpenMP pool in a forked child (the parent's threads are gone)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = fn(rank, world)
    except BaseException as e:  # noqa: BLE001 -- the caller reads it as the rank's answer
        result = {"error": f"{type(e).__name__}: {e}"[:300]}
    try:
        payload = pickle.dumps(result)
    except Exception as e:  # noqa: BLE001
        payload = pickle.dumps({"error": f"the result could not be sent back: {e}"[:300]})
    with os.fdopen(out_fd, "wb") as f:
        f.write(payload)
    os.read(release, 1)  # returns when the parent closes its end: every rank has answered
    os._exit(0)


def _collect(fds: list[int], deadline: float) -> dict[int, bytes | None]:
    """Everything each pipe delivers until it closes, or None for a pipe still open at the deadline."""
    chunks: dict[int, list[bytes]] = {fd: [] for fd in fds}
    open_fds = set(fds)
    while open_fds and time.monotonic() < deadline:
        readable, _, _ = select.select(list(open_fds), [], [], max(0.0, deadline - time.monotonic()))
        for fd in readable:
            data = os.read(fd, 1 << 16)
            if data:
                chunks[fd].append(data)
            else:
                open_fds.discard(fd)
    for fd in fds:
        os.close(fd)
    return {fd: None if fd in open_fds else b"".join(chunks[fd]) for fd in fds}
