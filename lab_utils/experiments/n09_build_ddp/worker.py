"""Notebook 09's worker: data parallelism by hand (:mod:`lab_utils.learn.handmade`) beside torch's DDP.

``torchrun ... -m lab_utils.experiments.n09_build_ddp.worker JOB.json`` (the harness protocol,
:mod:`lab_utils.engine.harness`). ResNet-18 with notebook 03's data and recipe (the spec's train
transforms, SGD lr 0.1, momentum 0.9, weight decay 5e-4, cross-entropy), every step through the lab's
one loop (:func:`lab_utils.learn.loop.train_steps`). Each rank takes its first batches from a
``DistributedSampler`` once, onto its device, and reuses them: no step waits for a loader. A
configuration's ``kind``:

- ``check``: K steps of every implementation from the same initial weights (in ``dtype``, float64:
  :data:`~lab_utils.learn.handmade.TOLERANCE` says why), then each rank's
  parameters against one process trained on the global batch (rank 0: the same loop over every rank's
  batch in turn, gradients accumulated and divided by N, so BatchNorm normalizes each rank's share on
  its own as it does under DDP); ``max_abs_diff`` over ranks, ``equal`` within
  :data:`~lab_utils.learn.handmade.TOLERANCE` of the dtype the gradients travelled in; the optimizer
  state each rank holds (``sgd_state_bytes``, per rank).
- ``bench``: this run's own all-reduce times on a few message sizes and their alpha-beta fit
  (:func:`lab_utils.learn.alpha_beta.fit_alpha_beta`), for when notebook 04's fit is not in the store.
- ``memory``: each implementation in turn, built from nothing, with SGD or Adam
  (``implementations``: ``[name, bucket_mb, optimizer]``): :func:`.replica_memory.memory_use` over
  two warm-up steps and one measured step, the largest over ranks (``held_bytes``,
  ``peak_bytes``) and ``optimizer_state_bytes``.
- ``compare``: the implementations side by side, interleaved step by step (round r runs every
  implementation once, in an order rotated each round, after a barrier), so machine noise hits them
  alike. Per implementation: ``step_seconds`` (median over the timed steps of the slowest rank's step;
  p10 and p90 beside it), ``comm_exposed_seconds`` (median over rounds of its step minus the
  no-communication step of the same round), the step's collectives (``messages``) and
  ``bytes_per_rank_per_step``, the loss of the last step over all ranks and ``sgd_state_bytes``. Then
  ``backward_seconds``: the no-communication replica's backward alone (the loop's backward timer,
  device synchronized at both ends; mean over ``steps`` more steps, the slowest rank's), the time the
  overlapping implementations can hide communication behind.
- ``trace``: ``torch.profiler`` on every rank over a few steps of (b), (c) and DDP, one Chrome trace per
  rank into ``options["trace_dir"]`` (the parent merges them; the record lists the files).

A step's time (seconds): from a barrier to the end of the optimizer step, device synchronized;
forward, loss, backward, gradient synchronization and the optimizer step, nothing else.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import profile, record_function, supported_activities
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.dist import DistContext, gather
from lab_utils.engine.hardware import software_versions
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.records import Record
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig, train_dataset
from lab_utils.experiments.n04_allreduce.allreduce_worker import measure_size
from lab_utils.experiments.n09_build_ddp import replica_memory
from lab_utils.learn import handmade, traffic
from lab_utils.learn.alpha_beta import fit_alpha_beta
from lab_utils.learn.errors import LabError
from lab_utils.learn.loop import StepOptions, make_optimizer, train_steps
from lab_utils.learn.models import ResNet18
from lab_utils.learn.ring import gradient_bytes
from lab_utils.learn.spread import percentile
from lab_utils.learn.timing import NestedTimers, synchronize

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1

__all__ = ["IMPLEMENTATIONS", "Replica", "prepare", "run_config"]

#: Implementation names of a configuration, and how tables call them.
IMPLEMENTATIONS = {"local": "no communication", "naive": "(a) naive",
                   "per_tensor": "(e) per tensor, overlapped", "flat": "(b) flat", "bucketed": "(c) bucketed",
                   "zero1": "(d) ZeRO-1 (paper)", "ddp": "torch DDP", "ddp_bf16": "torch DDP, bf16 hook"}
_OVERLAPPING = ("per_tensor", "bucketed", "ddp", "ddp_bf16")
MB = 2**20  # bucket sizes in MB as DDP's bucket_cap_mb counts them (2^20 bytes)


def prepare(job: Job, ctx: DistContext) -> dict[str, Any]:
    """The training set every configuration draws its batches from (built once)."""
    apply_training_backends()
    first = job.configs[0]
    spec = RunConfig(devices=ctx.world_size, backend=first["backend"], batch_size=first["batch_size"],
                     train_images=first["train_images"], dataset=first["dataset"])
    return {"train": train_dataset(spec)}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> list[Record]:
    """One configuration (see the module docstring); rank 0 returns its record."""
    kind = config["kind"]
    run = {"check": _check, "bench": _bench, "memory": _memory, "compare": _compare, "trace": _trace}[kind]
    metrics = run(config, job, ctx, state)
    if ctx.rank != 0:
        return []
    synthetic = config["dataset"] == "synthetic"
    return [Record(job.experiment, dict(config), metrics, profile=job.profile, synthetic=synthetic,
                   dataset="synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10",
                   hardware=ctx.hardware(), software=software_versions())]


# --------------------------------------------------------------------------- replicas


def _batches(config: dict[str, Any], state: dict[str, Any], ctx: DistContext, batch: int, n: int) -> list:
    """This rank's first ``n`` batches of the sampler's shard (fewer when the subset is smaller: then
    they repeat), on the device."""
    sampler = DistributedSampler(state["train"], num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=config["seed"])
    torch.manual_seed(config["seed"] + ctx.rank)  # each rank its own augmentation, the same every run
    loader = DataLoader(state["train"], batch_size=batch, sampler=sampler)
    out = [(x.to(ctx.device), y.to(ctx.device)) for x, y in itertools.islice(loader, n)]
    return [out[i % len(out)] for i in range(n)]


class Replica:
    """One implementation's model and optimizer(-wrapper), trained by the lab's loop: the recipe's SGD,
    or Adam (``optimizer="adam"``, torch's defaults: two moments per parameter) to size the state."""

    def __init__(self, name: str, bucket_mb: float | None, config: dict[str, Any], ctx: DistContext,
                 optimizer: str = "sgd"):
        torch.manual_seed(config["seed"])  # the same initial weights on every rank and in every replica
        self.name, self.bucket_mb = name, bucket_mb
        self.model = _model(config, ctx)
        params = self.model.parameters()
        inner = torch.optim.Adam(params) if optimizer == "adam" else make_optimizer(self.model)
        cap = int(bucket_mb * MB) if bucket_mb is not None else float("inf")   # as DDP rounds its cap
        self.net: nn.Module = self.model
        if name.startswith("ddp"):
            self.net = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            if name == "ddp_bf16":
                self.net.register_comm_hook(None, bf16_compress_hook)
            self.optimizer: Any = inner
        else:
            make = {"local": handmade.Local, "naive": handmade.Naive, "per_tensor": handmade.PerTensor,
                    "flat": handmade.Flat, "zero1": handmade.ZeroOne}
            self.optimizer = (handmade.Bucketed(self.model, inner, cap) if name == "bucketed"
                              else make[name](self.model, inner))

    def step(self, batch: tuple, device: torch.device, options: StepOptions | None = None) -> torch.Tensor:
        """One training step through the lab's loop; its mean loss on this rank."""
        sums = train_steps(self.net, [batch], 1, self.optimizer, nn.CrossEntropyLoss(), None, device,
                           options or StepOptions())
        return sums.loss_sum / sums.images

    def timed_step(self, batch: tuple, device: torch.device) -> tuple[float, torch.Tensor]:
        """One step timed from a barrier to its end, device synchronized (seconds), and its loss."""
        _barrier(device)
        t0 = time.perf_counter()
        loss = self.step(batch, device)
        synchronize(device)
        return time.perf_counter() - t0, loss

    def messages(self) -> list[tuple[str, int]]:
        """The collectives of one step; DDP's from its own bucket sizes (read after its first steps)."""
        if not self.name.startswith("ddp"):
            return self.optimizer.messages()
        data = self.net._get_ddp_logging_data()   # the buckets DDP rebuilt after its first step, if it did
        listed = str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", ""))
        sizes = [int(s) for s in listed.split(",") if s.strip()]
        half = 2 if self.name == "ddp_bf16" else 1   # the hook sends bf16: half the bytes
        return [(traffic.ALL_REDUCE, s // half) for s in sizes]


def _model(config: dict[str, Any], ctx: DistContext) -> nn.Module:
    """ResNet-18 of the configuration's width, in its dtype (float32 unless the check asks float64)."""
    return ResNet18(width=config["width"]).to(ctx.device, getattr(torch, config.get("dtype", "float32")))


def _barrier(device: torch.device) -> None:
    """Every rank here before the clock starts (an all-reduce of one number: gloo and NCCL alike)."""
    dist.all_reduce(torch.zeros(1, device=device))
    synchronize(device)


def _flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _global_mean(value: torch.Tensor, ctx: DistContext) -> float:
    t = value.detach().double().reshape(1).clone()
    dist.all_reduce(t)
    return float(t) / ctx.world_size


# --------------------------------------------------------------------------- the kinds of configuration


def _check(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    """K steps of each implementation against one process on the global batch (module docstring)."""
    steps, dtype = config["steps"], getattr(torch, config["dtype"])
    batches = [(x.to(dtype), y) for x, y in _batches(config, state, ctx, config["batch_size"], steps)]
    every = gather([(x.cpu(), y.cpu()) for x, y in batches], ctx)   # every rank's batches, in rank order
    reference = torch.zeros(0, device=ctx.device, dtype=dtype)
    if ctx.rank == 0:
        torch.manual_seed(config["seed"])
        model = _model(config, ctx)
        order = [(x.to(ctx.device), y.to(ctx.device)) for s in range(steps) for x, y in (r[s] for r in every)]
        train_steps(model, order, len(order), make_optimizer(model), nn.CrossEntropyLoss(), None, ctx.device,
                    StepOptions(accumulation_steps=ctx.world_size))
        reference = _flat_params(model)
    sizes = gather(reference.numel(), ctx)
    if ctx.rank != 0:
        reference = torch.zeros(sizes[0], device=ctx.device, dtype=dtype)
    dist.broadcast(reference, src=0)
    rows = []
    for name, bucket_mb in config["implementations"]:
        rep = Replica(name, bucket_mb, config, ctx)
        for batch in batches:
            loss = rep.step(batch, ctx.device)
        rtol, atol = handmade.TOLERANCE[config["dtype"]]
        mine = _flat_params(rep.model)
        diff = float((mine - reference).abs().max())
        close = bool(torch.allclose(mine, reference, rtol=rtol, atol=atol))
        per_rank = gather((diff, close, replica_memory.optimizer_state_bytes(rep.optimizer)), ctx)
        lossy = name == "ddp_bf16"  # bf16 gradients: close, never equal
        rows.append({"implementation": name, "bucket_mb": bucket_mb,
                     "dtype": "bfloat16" if lossy else config["dtype"],
                     "max_abs_diff": max(d for d, _, _ in per_rank),
                     "equal": None if lossy else all(c for _, c, _ in per_rank),
                     "rtol": None if lossy else rtol, "atol": None if lossy else atol,
                     "last_step_loss": _global_mean(loss, ctx),
                     "sgd_state_bytes": [b for _, _, b in per_rank]})
        del rep
    return {"implementations": rows, "check_steps": steps}


#: Sweeps over the message sizes of a bench run; each size keeps its best (see :func:`_bench`).
BENCH_REPEATS = 3


def _bench(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    """All-reduce seconds per message size on these ranks and their fit: per size, notebook 04's
    :func:`~lab_utils.experiments.n04_allreduce.allreduce_worker.measure_size` (the slowest rank's mean over
    ``iters``), the
    best of :data:`BENCH_REPEATS` sweeps over the sizes (on a shared CPU another process's burst can land
    in one sweep; the best one is the link's)."""
    times = [math.inf] * len(config["sizes_bytes"])
    for _ in range(BENCH_REPEATS):
        for i, size in enumerate(config["sizes_bytes"]):
            m = measure_size(size, config["iters"], config["warmup"], ctx.device, ctx.rank, ctx.world_size)
            times[i] = min(times[i], m["time_us"] / 1e6)
    try:
        fit = fit_alpha_beta(config["sizes_bytes"], times, ctx.world_size).as_dict()
    except LabError as e:  # noisy timings (a loaded CPU): the run keeps its times, the tables say why
        fit = {"problem": str(e)}
    return {"bench_time_us": [t * 1e6 for t in times], "fit": fit}


def _memory(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    """Each implementation's bytes on this rank, built one at a time (module docstring)."""
    batch = _batches(config, state, ctx, config["batch_size"], 1)[0]
    rows = []
    for name, bucket_mb, optimizer in config["implementations"]:
        use, rep = replica_memory.memory_use(partial(Replica, name, bucket_mb, config, ctx, optimizer),
                                       lambda r: r.step(batch, ctx.device), ctx.device)
        state_bytes = replica_memory.optimizer_state_bytes(rep.optimizer)
        per_rank = gather((use.held_bytes, use.peak_bytes, state_bytes), ctx)
        del rep
        rows.append({"implementation": name, "bucket_mb": bucket_mb, "optimizer": optimizer,
                     **{k: max(r[i] for r in per_rank)
                        for i, k in enumerate(("held_bytes", "peak_bytes", "optimizer_state_bytes"))}})
    params = sum(p.numel() * p.element_size() for p in _model(config, ctx).parameters())
    return {"implementations": rows, "parameter_bytes": params}


def _compare(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    """Every implementation, interleaved step by step (module docstring)."""
    warmup, steps = config["warmup"], config["steps"]
    batches = _batches(config, state, ctx, config["batch_size"], warmup + steps)
    reps = [Replica(name, mb, config, ctx) for name, mb in config["implementations"]]
    seconds: list[list[float]] = [[] for _ in reps]
    losses: list[torch.Tensor] = [torch.zeros(()) for _ in reps]
    for i, batch in enumerate(batches):
        for k in (list(range(len(reps)))[i % len(reps):] + list(range(len(reps)))[:i % len(reps)]):
            dt, losses[k] = reps[k].timed_step(batch, ctx.device)
            if i >= warmup:
                seconds[k].append(dt)
    every = gather(seconds, ctx)   # [rank][replica][step]
    last_losses = [_global_mean(loss, ctx) for loss in losses]
    state_bytes = gather([replica_memory.optimizer_state_bytes(r.optimizer) for r in reps], ctx)
    slowest = [traffic.slowest_per_step([ranks[k] for ranks in every]) for k in range(len(reps))]
    base = next((s for s, r in zip(slowest, reps) if r.name == "local"), None)
    backward = _backward_seconds(reps, batches[warmup:], ctx)
    rows = []
    for k, rep in enumerate(reps):
        msgs = rep.messages()
        row = {"implementation": rep.name, "bucket_mb": rep.bucket_mb, **_spread("step_seconds", slowest[k]),
               "messages": msgs,
               "bytes_per_rank_per_step": traffic.bytes_sent_per_rank(msgs, ctx.world_size),
               "overlaps": rep.name in _OVERLAPPING, "last_step_loss": last_losses[k],
               "sgd_state_bytes": max(b[k] for b in state_bytes)}
        if base is not None:  # paired by round: the same batch, moments apart
            row.update(_spread("comm_exposed_seconds", [t - b for t, b in zip(slowest[k], base)]))
        rows.append(row)
    params = list(reps[0].model.parameters())
    return {"implementations": rows, "timed_steps": steps, "parameters": sum(p.numel() for p in params),
            "tensors": len(params), "gradient_bytes": gradient_bytes(reps[0].model),
            "backward_seconds": backward}


def _backward_seconds(reps: list[Replica], batches: list, ctx: DistContext) -> float | None:
    """The no-communication replica's backward pass alone, seconds: the loop's backward timer (device
    synchronized at both ends) over one more step per batch, its mean; the slowest rank's. None
    without that replica."""
    local = next((r for r in reps if r.name == "local"), None)
    if local is None:
        return None
    timers = NestedTimers(ctx.device)
    for batch in batches:
        local.step(batch, ctx.device, StepOptions(step_timers=timers))
    return max(gather(timers.stats["backward"].mean_seconds, ctx))


def _spread(name: str, values: list[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile of ``values`` as ``name``, ``name_p10``, ``name_p90``."""
    return {name: percentile(values, 50), f"{name}_p10": percentile(values, 10),
            f"{name}_p90": percentile(values, 90)}


def _trace(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> dict[str, Any]:
    """``torch.profiler`` on this rank over a few steps of each implementation; one Chrome trace per rank."""
    steps = config["steps"]
    batches = _batches(config, state, ctx, config["batch_size"], steps + 1)
    reps = [Replica(name, mb, config, ctx) for name, mb in config["implementations"]]
    for rep in reps:
        rep.step(batches[0], ctx.device)  # warm-up (DDP builds its buckets), not traced
    folder = Path(job.options["trace_dir"])
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"build_ddp_{ctx.world_size}x{config['batch_size']}_rank{ctx.rank}.json"
    with profile(activities=supported_activities()) as prof:
        for rep in reps:
            for batch in batches[1:]:
                _barrier(ctx.device)
                with record_function(IMPLEMENTATIONS[rep.name]):
                    rep.step(batch, ctx.device)
                synchronize(ctx.device)
    prof.export_chrome_trace(str(path))
    return {"trace_paths": [str(p) for p in gather(path, ctx)], "steps_traced": steps}


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
