"""A small worker for the launcher, plan and DDP tests (run with PYTHONPATH=tests/), in the lab's
worker shape (:mod:`lab_utils.engine.harness`): ``python -m torch.distributed.run ... -m
ddp_toy_worker JOB.json``, each configuration of the job a dict with its ``mode``:

- ``ok``: one record per configuration: every rank's (rank, world size, OMP threads).
- ``sleep``: print a line, then sleep ``seconds`` (for the timeout path).
- ``fail``: rank ``fail_rank`` prints a marker line and raises; the others wait in a barrier that
  never completes (torchrun must tear them down).
- ``oom``: rank ``fail_rank`` raises ``torch.OutOfMemoryError`` when ``size`` > ``fits`` (the
  others wait in a barrier); below it, like ``ok``.
- ``equality``: train a BatchNorm-free MLP with DDP for ``steps`` steps through the lab's own
  worker loop (``lab_utils.learn.loop.train_steps``), each rank on its contiguous shard of a seeded
  global batch; rank 0's record holds the final parameters.
- ``comm``: time a wider MLP's steps with the comm hook and the ``no_sync`` probe, once per
  ``bucket_cap_mb`` value (default one bucket, then several), plus rank 0's one-process step on
  the global batch (for method (a)).
- ``accum``: one optimizer step of the lab's own loop on a width-2 ResNet-18 with ``accum``
  micro-batches of ``batch`` images per rank: rank r takes blocks r x accum ... r x accum +
  accum - 1 of a seeded set of world x accum blocks. The record holds the parameters and the
  loop's step counts.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from lab_utils.engine.dist import gather
from lab_utils.engine.harness import serve
from lab_utils.engine.records import Record

METRICS_VERSION = 1  # every worker names its metrics' version (lab_utils.engine.plan.versioned)

FAIL_MARKER = "TOY-WORKER-FAILS-HERE"
DEFAULTS = {"fail_rank": 1, "steps": 3, "batch": 8, "comm_steps": 12, "comm_batch": 64, "lr": 0.1,
            "width": 512, "bucket_cap_mb": "25,0.25", "accum": 1, "seconds": 600, "size": 1, "fits": 1}


def toy_mlp(inputs: int = 12, hidden: int = 16, outputs: int = 4, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, outputs))


def toy_batches(steps: int, global_batch: int, inputs: int = 12, outputs: int = 4, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(steps, global_batch, inputs, generator=g)
    y = torch.randint(0, outputs, (steps, global_batch), generator=g)
    return x, y


def run_config(config, job, ctx, state) -> list[Record]:
    """One configuration of the job (see the module docstring); rank 0 returns its record."""
    a = SimpleNamespace(**{**DEFAULTS, **config})
    rank, world = ctx.rank, ctx.world_size
    print(f"toy worker rank {rank}/{world} mode {a.mode}", flush=True)
    if a.mode == "sleep":
        time.sleep(a.seconds)
        metrics: dict = {}
    elif a.mode in ("ok", "oom"):
        if a.mode == "oom" and a.size > a.fits and rank == a.fail_rank % world:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {a.size} GiB (toy)")
        metrics = {"ranks": gather({"rank": rank, "world": world, "omp": os.environ.get("OMP_NUM_THREADS")},
                                   ctx)}
    elif a.mode == "fail":
        if rank == a.fail_rank:
            print(f"rank {rank}: {FAIL_MARKER}", flush=True)
            raise RuntimeError(f"deliberate failure on rank {rank} ({FAIL_MARKER})")
        dist.barrier()  # never completes: the failing rank does not arrive
        metrics = {}
    elif a.mode == "accum":
        metrics = accum(a, rank, world)
    elif a.mode == "equality":
        metrics = equality(a, rank, world)
    elif a.mode == "comm":
        metrics = comm(a, rank, world)
    else:
        raise ValueError(f"unknown mode {a.mode}")
    return [Record(job.experiment, dict(config), metrics, profile=job.profile, hardware=ctx.hardware())]


def equality(a, rank: int, world: int) -> dict:
    """``--steps`` optimizer steps of the lab's own worker loop (:func:`lab_utils.learn.loop.train_steps`,
    skew barrier included) on a BatchNorm-free MLP, each rank on its contiguous shard of a seeded
    global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lab_utils.learn.loop import StepOptions, make_optimizer, train_steps
    from lab_utils.learn.timing import PhaseTimer

    model = toy_mlp()
    ddp = DDP(model)
    opt = make_optimizer(ddp, lr=a.lr)
    x, y = toy_batches(a.steps, a.batch * world)
    shard = slice(rank * a.batch, (rank + 1) * a.batch)
    batches = [(x[s, shard], y[s, shard]) for s in range(a.steps)]
    cpu = torch.device("cpu")
    sums = train_steps(ddp, batches, len(batches), opt, nn.CrossEntropyLoss(), PhaseTimer(cpu), cpu,
                       StepOptions(skew_barrier=world > 1))
    return {"params": [p.detach().tolist() for p in model.parameters()], "steps": sums.steps}


def accum_blocks(blocks: int, batch: int, seed: int = 3):
    """``blocks`` seeded CIFAR-shaped micro-batches of ``batch`` images (inputs, labels)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, batch, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (blocks, batch), generator=g)
    return [(x[i], y[i]) for i in range(blocks)]


def accum(a, rank: int, world: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lab_utils.learn.loop import StepOptions, make_optimizer, train_steps
    from lab_utils.learn.models import ResNet18
    from lab_utils.learn.timing import PhaseTimer

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = ResNet18(width=2)
    ddp = DDP(model)
    opt = make_optimizer(ddp, lr=a.lr)
    blocks = accum_blocks(world * a.accum, a.batch)
    mine = blocks[rank * a.accum:(rank + 1) * a.accum]
    timer = PhaseTimer(torch.device("cpu"))
    sums = train_steps(ddp, mine, len(mine), opt, nn.CrossEntropyLoss(), timer, torch.device("cpu"),
                       StepOptions(accumulation_steps=a.accum, skew_barrier=world > 1))
    return {"params": [p.detach().tolist() for p in model.parameters()], "steps": sums.steps,
            "micro_steps": sums.micro_steps, "images": sums.images,
            "skew_wait_count": timer.stats["skew_wait"].count if "skew_wait" in timer.stats else 0}


def comm(a, rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lab_utils.learn.comm_hooks import AllReduceTimer
    from lab_utils.learn.comm_probe import probe_exposed_comm

    torch.set_num_threads(1)
    inputs, outputs = 256, 10
    x, y = toy_batches(a.comm_steps, a.comm_batch * world, inputs, outputs)
    loss_fn = nn.CrossEntropyLoss()

    # T(1): rank 0 alone does each step on the whole global batch (the others wait)
    t1 = None
    if rank == 0:
        single = toy_mlp(inputs, a.width, outputs)
        times = []
        for s in range(a.comm_steps):
            t0 = time.perf_counter()
            single.zero_grad(set_to_none=True)
            loss_fn(single(x[s]), y[s]).backward()
            times.append(time.perf_counter() - t0)
        t1 = sorted(times[1:])[len(times[1:]) // 2]
    dist.barrier()

    shard = slice(rank * a.comm_batch, (rank + 1) * a.comm_batch)
    batches = [(x[s, shard], y[s, shard]) for s in range(a.comm_steps)]
    probes = {}
    for cap in (float(c) for c in str(a.bucket_cap_mb).split(",")):
        ddp = DDP(toy_mlp(inputs, a.width, outputs), bucket_cap_mb=cap)
        timer = AllReduceTimer(ddp)
        probe = probe_exposed_comm(ddp, batches, timer, loss_fn)
        out: list = [None] * world
        dist.all_gather_object(out, probe.as_dict())
        probes[str(cap)] = out
    return {"t1_step_seconds": t1, "probes": probes}


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
