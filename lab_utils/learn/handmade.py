"""Data parallelism by hand (notebook 09): five ways to keep N replicas of a model equal.

After ``backward()`` every rank holds the gradient of ITS share of the global batch. If every rank
replaces it with the mean over ranks before the optimizer step, all replicas take the same step, and
that step equals one process trained on the whole global batch (the mean of the per-rank mean losses
is the global mean loss, for equal shares). The five ways differ only in how the mean is computed:

- (a) :class:`Naive`: one all-reduce per parameter tensor after ``backward()`` (62 for ResNet-18);
- (e) :class:`PerTensor`: the same 62 all-reduces, each launched asynchronously as soon as its
  gradient is ready, during backward: (a) - (e) is what overlap alone buys, (e) - (c) what bucketing
  adds;
- (b) :class:`Flat`: every gradient copied into one flat buffer, one all-reduce, copied back: alpha
  once, but nothing starts before ``backward()`` has ended;
- (c) :class:`Bucketed`: buckets by DDP's rule (:func:`assign_buckets`, last layers first); a gradient
  hook launches a bucket's all-reduce asynchronously as soon as its last gradient is ready, while
  backward goes on with earlier layers; the step waits for all of them;
- (d) :class:`ZeroOne`: ZeRO stage 1 as the paper has it (Rajbhandari et al. 2020, sec. 7.2.1), the
  all-reduce split into its two halves, reduce-scatter (each rank gets the summed gradient of its own
  shard, :func:`shard_bounds`) and all-gather (each rank hands out its updated shard), so the same
  bytes as DDP; in between each rank steps only its shard, so it keeps the optimizer state of 1/N of
  the parameters. (torch's ``ZeroRedundancyOptimizer`` is the other design: DDP's all-reduce, then
  a broadcast of each rank's updated shard: more bytes.)

Each is an optimizer wrapper that starts, as DDP does, from rank 0's parameters and buffers (one
broadcast when it is built); ``step()`` synchronizes the gradients, then steps; the lab's one
training loop (:func:`lab_utils.learn.loop.train_steps`) drives it like any optimizer. ``messages()``
lists the collectives of one step (kind, bytes), from which :func:`bytes_sent_per_rank` and
:func:`predicted_seconds` (the alpha-beta model of :mod:`lab_utils.learn.ring`) follow;
:func:`overlap_exposed_seconds` and :func:`optimal_bucket_bytes` are that model for equal buckets
(Exercise 09-d). :func:`memory_use` measures the bytes an implementation holds and its peak in a
step. :func:`run_in_ranks` runs a function in N forked gloo processes (the tests' and the graded
exercises' way to check code on 2 ranks without torchrun).
"""

from __future__ import annotations

import datetime
import gc
import math
import os
import pickle
import select
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from lab_utils.learn.ring import ring_allreduce_seconds, ring_bytes_per_rank

#: ``(rtol, atol)`` of ``torch.allclose`` by the parameters' dtype: an implementation equals one process
#: when only the order of the sums differs (a ring adds rank by rank, one process micro-batch by
#: micro-batch): units in the last place. In float32 (2^-24) such a difference can grow a thousandfold
#: in a step of this recipe (BatchNorm over a few images, lr 0.1: a ReLU that flips), so the check runs
#: in float64, where it stays near 1e-16; its tolerance is far above that and far below any real bug.
#: A bf16 all-reduce (the compression hook) is lossy by design: no tolerance calls it equal.
TOLERANCE: dict[str, tuple[float, float]] = {"float64": (1e-7, 1e-9), "float32": (1e-4, 1e-5)}
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER = "all_reduce", "reduce_scatter", "all_gather"


def assign_buckets(sizes_bytes: Sequence[int], cap_bytes: float,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Parameter indices (``model.parameters()`` order) grouped into all-reduce buckets by DDP's rule.

    torch's ``compute_bucket_assignment_by_size`` (reducer.cpp), as DDP applies it when it rebuilds its
    buckets in the order gradients become ready: parameters in REVERSE order (backward produces the last
    layer's gradient first); each is added to the open bucket, which closes once it holds at least its
    cap, so a bucket can exceed its cap by its last tensor. The first bucket's cap is ``first_cap_bytes``
    (DDP: 1 MiB when ``bucket_cap_mb`` is not given, else the same cap; None: ``cap_bytes``), every later
    one ``cap_bytes``. Every index is in exactly one bucket; the last one may be below its cap."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        if filled >= (first_cap_bytes if not buckets and first_cap_bytes is not None else cap_bytes):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's shard of ``numel`` elements: together they cover every element
    once, in order; sizes differ by at most one (the first ``numel % world_size`` ranks hold one more)."""
    base, extra = divmod(numel, world_size)
    return [(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra)) for r in range(world_size)]


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every rank's parameters and buffers (BatchNorm's running statistics) made rank 0's, as DDP does
    when it is built: replicas start equal whatever each rank's seed was."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


class Local:
    """No gradient communication: each rank steps on its own gradient (the replicas drift apart). The
    baseline a step with gradient synchronization is compared with (exposed communication). Like every
    implementation here it starts from rank 0's weights (:func:`broadcast_from_rank0`, once, outside any
    step)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = optimizer
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        broadcast_from_rank0(model)

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
        """The collectives of one step: ``(kind, bytes of the buffer)``, in the order they are sent."""
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
    """(c) Buckets by DDP's rule (:func:`assign_buckets`), each all-reduced asynchronously as soon as its
    last gradient is ready (during backward), in bucket order only, so every rank issues its collectives
    in the same order (as in DDP); ``sync`` waits for all of them before the optimizer step. A bucket of
    one tensor is all-reduced in place, without a copy."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, bucket_bytes: float,
                 first_bucket_bytes: float | None = None):
        super().__init__(model, optimizer)
        sizes = [p.numel() * p.element_size() for p in self.params]
        groups = assign_buckets(sizes, bucket_bytes, first_bucket_bytes)
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
            bucket = self.buckets[nxt]
            flat = bucket[0].grad if len(bucket) == 1 else torch.cat([p.grad.reshape(-1) for p in bucket])
            self.launched.append((nxt, flat, dist.all_reduce(flat, async_op=True)))

    def sync(self) -> None:
        for k, flat, work in self.launched:
            work.wait()
            flat /= self.world
            if len(self.buckets[k]) > 1:   # a bucket of one tensor was reduced in its own gradient
                for p, part in zip(self.buckets[k], flat.split([p.numel() for p in self.buckets[k]])):
                    p.grad.copy_(part.view_as(p))
        if len(self.launched) != len(self.buckets):
            raise RuntimeError(f"only {len(self.launched)} of {len(self.buckets)} buckets were all-reduced: "
                               "a parameter got no gradient in this backward")
        self.launched, self.ready = [], [0] * len(self.buckets)

    def messages(self) -> list[tuple[str, int]]:
        return [(ALL_REDUCE, s) for s in self.sizes]


class PerTensor(Bucketed):
    """(e) (a)'s one all-reduce per gradient tensor, but each launched asynchronously as soon as that
    gradient is ready, during backward, in place: (c) with buckets of one tensor each (a cap of 0
    bytes closes every bucket at its first tensor)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer, bucket_bytes=0)


class ZeroOne(Local):
    """(d) ZeRO-1 as the paper has it: the parameters live in one flat buffer cut into N shards
    (:func:`shard_bounds`); each rank keeps the optimizer state of its shard only. A step: reduce-scatter
    the gradients (each rank receives the summed gradient of its shard), step the shard, all-gather the
    updated shards: together the bytes of one all-reduce. Shards are padded to the largest one for the
    two collectives (a padded copy of the gradients, and the gathered buffer: temporaries of about the
    gradient's size each, which :func:`memory_use` sees)."""

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
        self.shard.grad = None

    def _padded(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` laid out as N rows of ``pad`` elements, row r holding shard r."""
        out = flat.new_zeros(self.world, self.pad)
        for r, (start, end) in enumerate(self.bounds):
            out[r, :end - start] = flat[start:end]
        return out

    def sync(self) -> None:
        padded = self._padded(torch.cat([p.grad.reshape(-1) for p in self.params]))
        mine = padded.new_empty(self.pad)
        dist.reduce_scatter_tensor(mine, padded.reshape(-1))  # the sum of my shard only
        start, end = self.bounds[dist.get_rank()]
        self.shard.grad = mine[:end - start].div_(self.world)

    def step(self) -> None:
        self.sync()
        self.optimizer.step()           # only my shard: my 1/N of the optimizer state
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
    """Bytes of the tensors an optimizer keeps between steps (SGD: one momentum buffer per parameter;
    Adam: two moments and a step count)."""
    opt = getattr(optimizer, "optimizer", optimizer)
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if torch.is_tensor(t))


# --------------------------------------------------------------------------- memory


@dataclass(frozen=True)
class MemoryUse:
    """Bytes of one implementation on one rank, counted from before it was built: ``held_bytes`` after
    its warm-up steps (what it keeps between steps: the model, its gradients, the optimizer state, its
    own buffers), ``peak_bytes`` the most allocated at once during one more step (that, plus the step's
    activations and temporaries)."""

    held_bytes: int
    peak_bytes: int


def memory_use(build: Callable[[], Any], step: Callable[[Any], Any], device: torch.device,
               warm_steps: int = 2) -> tuple[MemoryUse, Any]:
    """``build()`` an implementation, run ``warm_steps`` of ``step(it)`` (the optimizer state exists
    after the first, DDP's rebuilt buckets after the second), then one measured step; its
    :class:`MemoryUse` and the implementation. Every tensor allocated meanwhile is counted, so nothing
    else may allocate and keep tensors during the call; what an earlier implementation left for the
    garbage collector is collected first.

    On a GPU: ``torch.cuda.memory_allocated`` before and after, ``max_memory_allocated`` over the
    measured step after ``reset_peak_memory_stats``. On a CPU, where torch keeps no such counter, the
    tensors are counted (:class:`TensorBytes`). Neither sees a collective's own buffers inside gloo or
    NCCL (not tensors of this process's ops)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        it = build()
        for _ in range(warm_steps):
            step(it)
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)
        step(it)
        torch.cuda.synchronize(device)
        return MemoryUse(held, torch.cuda.max_memory_allocated(device) - start), it
    with TensorBytes() as count:
        it = build()
        for _ in range(warm_steps):
            step(it)
        held = count.reset_peak()
        step(it)
    return MemoryUse(held, count.peak), it


class TensorBytes(TorchDispatchMode):
    """``with TensorBytes() as count:``: the bytes of every tensor storage an op creates inside, from
    its creation until it is freed: ``count.allocated`` now, ``count.peak`` the most at once (after any
    op) since entering or :meth:`reset_peak`. A storage's end is a weak reference's callback, which runs
    on whatever thread frees it (gloo's, when it holds a collective's tensor last). A storage an op only
    writes into (in place, ``out=``) was made before and is not counted; nor is memory inside an op."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated = self.peak = 0
        self._alive: dict[int, Any] = {}   # storage address -> its weak reference (kept alive here)

    def reset_peak(self) -> int:
        """Start a new peak from what is allocated now; returns that."""
        self.peak = self.allocated
        return self.allocated

    def _freed(self, key: int, nbytes: int, _ref: Any) -> None:
        if self._alive.pop(key, None) is not None:
            self.allocated -= nbytes

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in inputs or key in self._alive or st.nbytes() == 0:
                continue
            self._alive[key] = weakref.ref(st, partial(self._freed, key, st.nbytes()))
            self.allocated += st.nbytes()
        self.peak = max(self.peak, self.allocated)
        return out


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nest of lists, tuples and dicts."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (list, tuple)):
        return [t for x in tree for t in _tensors(x)]
    if isinstance(tree, dict):
        return [t for x in tree.values() for t in _tensors(x)]
    return []


# --------------------------------------------------------------------------- traffic and time models


def bytes_sent_per_rank(messages: Sequence[Sequence[Any]], world_size: int) -> float:
    """Bytes one rank sends per step in ring collectives: ``2(P-1)/P x S`` per all-reduce of S bytes,
    half that per reduce-scatter or all-gather (an all-reduce is one of each)."""
    return sum(ring_bytes_per_rank(size, world_size) * (1.0 if kind == ALL_REDUCE else 0.5)
               for kind, size in messages)


def predicted_seconds(messages: Sequence[Sequence[Any]], world_size: int, alpha_seconds: float,
                      bandwidth_bytes_per_s: float, overlaps: bool,
                      backward_seconds: float | None = None) -> tuple[float, float]:
    """(communication, exposed) seconds of one step by the ring's alpha-beta model: every collective
    one after the other, ``2(P-1) alpha + 2(P-1)/P x S / B`` per all-reduce, half per reduce-scatter or
    all-gather. Exposed: all of it, unless the collectives ``overlaps`` backward (per tensor, bucketed,
    DDP). Then, with ``backward_seconds`` T, the queue of :func:`overlap_exposed_seconds` over these
    messages (a message can start once backward has produced its bytes, at a steady S bytes in T, and
    once the one before it is done; exposed = the last one's end - T); without T, the last message
    alone (a lower bound)."""
    times = [ring_allreduce_seconds(size, world_size, alpha_seconds, bandwidth_bytes_per_s)
             * (1.0 if kind == ALL_REDUCE else 0.5) for kind, size in messages]
    total = sum(times)
    if not overlaps or not times:
        return total, total
    if backward_seconds is None:
        return total, times[-1]
    produced, done = 0.0, 0.0
    whole = sum(size for _, size in messages) or 1
    for (_, size), t in zip(messages, times):
        produced += size
        done = max(done, backward_seconds * produced / whole) + t
    return total, max(0.0, done - backward_seconds)


def _exposed_by_buckets(k: int, gradient_bytes: float, world_size: int, alpha_seconds: float,
                        bandwidth_bytes_per_s: float, backward_seconds: float) -> float:
    c = ring_allreduce_seconds(gradient_bytes / k, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return max(c, backward_seconds / k + k * c - backward_seconds)


def overlap_exposed_seconds(bucket_bytes: float, gradient_bytes: float, world_size: int,
                            alpha_seconds: float, bandwidth_bytes_per_s: float,
                            backward_seconds: float) -> float:
    """Exercise 09-d's model: the communication left after backward ends, in seconds, when the
    ``gradient_bytes`` S are cut into ``k = ceil(S / bucket_bytes)`` equal buckets, backward produces
    them at a steady rate over ``backward_seconds`` T, and their ring all-reduces run one at a time,
    each ``c = 2(P-1) alpha + 2(P-1)/P x (S/k) / B``. Bucket j is ready at ``jT/k``: if ``c <= T/k``
    each all-reduce ends before the next bucket is ready and only the last is exposed (c); otherwise
    they queue from the first bucket on and end at ``T/k + k c``. Exposed = ``max(c, T/k + k c - T)``."""
    k = max(1, math.ceil(gradient_bytes / bucket_bytes))
    return _exposed_by_buckets(k, gradient_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s,
                               backward_seconds)


def optimal_bucket_bytes(gradient_bytes: float, world_size: int, alpha_seconds: float,
                         bandwidth_bytes_per_s: float, backward_seconds: float) -> float:
    """The bucket size ``S / k`` whose whole number of buckets k minimizes
    :func:`overlap_exposed_seconds` (bytes). With ``A = 2(P-1) alpha`` and ``W = 2(P-1)/P x S / B``: while
    a bucket's all-reduce is no longer than the backward time that makes the next one
    (``A + W/k <= T/k``, i.e. up to ``k_c = (T - W) / A``), more buckets expose less (the last one,
    ``A + W/k``); past ``k_c`` they queue and expose ``kA + W + T/k - T``, smallest at ``k = sqrt(T/A)``.
    So the best k is ``max(k_c, sqrt(T/A), 1)``, rounded to the better neighbouring whole number: at
    ``k_c`` a bucket's communication takes exactly as long as its computation (CS336's assumption is
    this optimum). Without latency (alpha = 0) smaller buckets are always better: 0.0."""
    a = 2 * (world_size - 1) * alpha_seconds
    if a <= 0:
        return 0.0
    t = backward_seconds
    w = ring_allreduce_seconds(gradient_bytes, world_size, 0.0, bandwidth_bytes_per_s)
    best = max(1.0, (t - w) / a, math.sqrt(t / a))
    k = min({max(1, math.floor(best)), math.ceil(best)},
            key=lambda n: (_exposed_by_buckets(n, gradient_bytes, world_size, alpha_seconds,
                                               bandwidth_bytes_per_s, t), n))
    return gradient_bytes / k


def slowest_per_step(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """Each synchronized step's time: the slowest rank's (no rank finishes a collective before the last
    one arrives, as :mod:`lab_utils.learn.ranks` says of epochs). ``per_rank[r][s]``: rank r, step s."""
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
