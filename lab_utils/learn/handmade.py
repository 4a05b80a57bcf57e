"""Data parallelism by hand (notebook 09): five ways to keep N replicas of a model equal.

After ``backward()`` every rank holds the gradient of ITS share of the global batch. If every rank replaces
it with the mean over ranks before the optimizer step, all replicas take the same step, and that step
equals one process trained on the whole global batch (the mean of the per-rank mean losses is the global
mean loss, for equal shares). The five ways differ only in how the mean is computed: (a) :class:`Naive`,
(b) :class:`Flat`, (c) :class:`Bucketed`, (d) :class:`ZeroOne` and (e) :class:`PerTensor`; (a) - (e) is
what overlap alone buys, (e) - (c) what bucketing adds.

Each is an optimizer wrapper (:class:`Local`) that the lab's one training loop
(:func:`lab_utils.learn.loop.train_steps`) drives like any optimizer; :mod:`lab_utils.learn.traffic` models
its ``messages()``. The tests and graded exercises run them on 2 forked gloo ranks without torchrun
(:func:`lab_utils.engine.fork_ranks.run_in_ranks`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.learn.bucketing import assign_buckets, shard_bounds
from lab_utils.learn.traffic import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER

#: ``(rtol, atol)`` of ``torch.allclose`` by the parameters' dtype: an implementation equals one process
#: when only the order of the sums differs (a ring adds rank by rank, one process micro-batch by
#: micro-batch): units in the last place. In float32 (2^-24) such a difference can grow a thousandfold
#: in a step of this recipe (BatchNorm over a few images, lr 0.1: a ReLU that flips), so the check runs
#: in float64, where it stays near 1e-16; its tolerance is far above that and far below any real bug.
#: A bf16 all-reduce (the compression hook) is lossy by design: no tolerance calls it equal.
TOLERANCE: dict[str, tuple[float, float]] = {"float64": (1e-7, 1e-9), "float32": (1e-4, 1e-5)}


def broadcast_from_rank0(model: torch.nn.Module) -> None:
    """Every rank's parameters and buffers (BatchNorm's running statistics) made rank 0's, as DDP does
    when it is built: replicas start equal whatever each rank's seed was."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


class Local:
    """No gradient communication: each rank steps on its own gradient (the replicas drift apart), the
    baseline a synchronizing step is compared with (exposed communication). Every implementation starts
    from rank 0's weights (:func:`broadcast_from_rank0`, when built); ``step()`` syncs, then steps."""

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
    """(a) After backward, one all-reduce per gradient tensor (62 for ResNet-18), then divide by the ranks."""

    def sync(self) -> None:
        for p in self.params:
            dist.all_reduce(p.grad)     # the SUM over ranks, one message per tensor
            p.grad /= self.world        # the mean: the gradient of the global batch

    def messages(self) -> list[tuple[str, int]]:
        return [(ALL_REDUCE, p.numel() * p.element_size()) for p in self.params]


class Flat(Local):
    """(b) All gradients in one flat buffer, one all-reduce, then copied back: alpha once, but nothing
    starts before ``backward()`` has ended."""

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
    """(c) Buckets by DDP's rule (:func:`assign_buckets`, last layers first), each all-reduced
    asynchronously by a gradient hook once its last gradient is ready, while backward goes on, in bucket
    order only so that every rank issues its collectives in the same order (as DDP does); ``sync`` waits
    for all of them. A bucket of one tensor is all-reduced in place, without a copy."""

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
    """(e) (a)'s one all-reduce per gradient tensor, each launched asynchronously as soon as it is ready:
    (c) with buckets of one tensor each (a cap of 0 bytes closes every bucket at its first tensor)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        super().__init__(model, optimizer, bucket_bytes=0)


class ZeroOne(Local):
    """(d) ZeRO stage 1 as the paper has it (Rajbhandari et al. 2020, sec. 7.2.1): the parameters live in
    one flat buffer cut into N shards (:func:`shard_bounds`); each rank keeps the optimizer state of its
    shard only. A step: reduce-scatter the gradients (each rank receives the summed gradient of its
    shard), step the shard, all-gather the updated shards: the all-reduce's two halves, so the same bytes
    as DDP. (torch's ``ZeroRedundancyOptimizer`` is the other design: DDP's all-reduce, then a broadcast
    of each rank's updated shard: more bytes.) Both collectives pad the shards to the largest one:
    temporaries of about the gradient's size each (notebook 09's ``replica_memory`` counts them)."""

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
