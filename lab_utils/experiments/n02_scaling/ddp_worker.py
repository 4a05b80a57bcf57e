"""The DDP training worker for ResNet-18 on CIFAR-10 (notebooks 02, 03, 05), run by ``torchrun``.

``python -m torch.distributed.run --nproc-per-node N -m lab_utils.experiments.n02_scaling.ddp_worker
JOB.json``: a job of the lab's one worker protocol (:mod:`lab_utils.engine.harness`), written by
:func:`lab_utils.engine.plan.measure`. Each configuration is a :class:`RunConfig` as a dict, the exact
``config`` of its records (the store's resume key). Gradient accumulation: ``accumulation_steps``
micro-batches per optimizer step, the first K-1 under ``no_sync`` (global batch = batch x world size x K). A
TEST KNOB (``debug_slow_rank`` / ``debug_slow_loader_seconds``: that rank's loader sleeps so long per batch)
is recorded in the config and a ``debug_note``, so a slowed run is never taken for a normal one. The
configurations of a job run one after another in one process group, each with a fresh model; the data sets are
built once (:func:`prepare`).

A run: the training set sharded by ``DistributedSampler`` (``set_epoch`` every epoch), the test set
split evenly by rank (no padding); the same initial weights on every rank; SGD with the lr schedule of
:func:`lab_utils.learn.schedules.make_schedule` stepped every optimizer step; each epoch of each rank is
THE epoch driver, :func:`lab_utils.learn.loop.run_epoch`. The per-rank results are gathered
(``all_gather_object``) and rank 0 builds the records; the worker never writes the result store.

Records (stable: notebooks 02, 03, 05 and the Table 3 code read them; every metric name is defined,
with its unit, in the glossary :mod:`lab_utils.learn.metrics`): one **aggregate** record and one record
**per rank**, all under the same experiment. ``config`` is :meth:`RunConfig.config` (identical in all
of them but ``record`` and ``rank``).

- Aggregate ``metrics``: ``epochs``, the per-epoch history, each epoch
  :func:`lab_utils.learn.ranks.aggregate_epoch` of the ranks' entries (the slowest rank defines T(N);
  ``*_mean`` / ``*_max`` over ranks beside it) plus ``cumulative_train_seconds``; the reported (last)
  epoch's entries copied to the top level with ``reported_epoch``; ``time_rule``; the run's
  ``world_size``, ``backend``, ``device_type``, ``threads_per_rank``, ``parameters``, ``gradient_bytes``
  (fp32), ``steps_per_epoch``, ``global_batch``, ``peak_lr``, ``warmup_steps``, ``accumulation_steps``,
  ``batches_per_epoch``, ``bucket_bytes`` (DDP's gradient buckets in the order it all-reduces them,
  :func:`lab_utils.learn.comm_hooks.ddp_bucket_bytes`), ``startup_seconds`` (slowest rank: the data
  sets + this configuration's loaders, model, DDP wrapper and optimizer; not the process start-up nor
  ``import torch``),
  ``worker_seconds``; ``accumulation_note`` and ``debug_note`` when used. With ``measure_comm``: the
  slowest rank's ``comm_probe`` (:mod:`lab_utils.learn.comm_probe`) and its (b), (c) and overlap per
  epoch for the reported epoch (:func:`lab_utils.learn.ranks.probe_seconds`), ``allreduce_buckets``.
- Per-rank ``metrics``: ``rank``, ``epochs`` (that rank's phases, loss and accuracy over its images,
  ``sample_order_head``: the sampler's first indices, to check ``set_epoch``), the reported epoch's
  values at the top level, and its ``comm_probe``.

Per-rank phases: :func:`lab_utils.learn.loop.train_steps` (its ``skew_wait`` says why a rank's wait for the
slowest loader is not ``compute``). Records written before the skew phase existed have no
``skew_wait_seconds`` (tables show it blank) and their ``compute``/``train_seconds`` include that wait.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.config import DATASET_CHOICES, check_batch_size, get_profile, loader_worker_options
from lab_utils.engine.dist import DistContext, gather
from lab_utils.engine.hardware import software_versions
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.memory import free_device_memory
from lab_utils.engine.records import Record, run_records
from lab_utils.experiments.shared.data import cifar10_dataset, test_transform, train_transform
from lab_utils.learn.comm_hooks import AllReduceTimer, ddp_bucket_bytes
from lab_utils.learn.comm_probe import probe_exposed_comm
from lab_utils.learn.epoch_record import EpochRecord
from lab_utils.learn.errors import LabError, check_choice, check_positive_int
from lab_utils.learn.evaluation import evaluate
from lab_utils.learn.loop import StepOptions, make_optimizer, run_epoch
from lab_utils.learn.models import ResNet18, count_parameters
from lab_utils.learn.ranks import epochs_over_ranks, probe_seconds
from lab_utils.learn.ring import gradient_bytes
from lab_utils.learn.schedules import DECAYS, LR_RULES, make_schedule
from lab_utils.learn.spread import REPEAT, STEP_STAT_KEYS
from lab_utils.learn.timing import synchronize

SAMPLE_ORDER_HEAD = 8
#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
#: 2 (issue 52 B1): a communication run's (b) holds the BatchNorm buffer broadcast (before, it cancelled
#: out; only those runs carried the key then, the others had none).
METRICS_VERSION = 2
TIME_RULE = ("epoch_seconds and train_seconds are the SLOWEST rank's (max over ranks; the step "
             "cannot finish before every rank's all-reduce); *_mean are means over ranks")


@dataclass(frozen=True)
class RunConfig:
    """One ResNet-18 run (DDP here, DataParallel in :mod:`lab_utils.experiments.n02_scaling.dp_worker`),
    every value resolved: what the plan writes, the worker reads, and the records' ``config`` holds.

    ``batch_size`` is per device; ``devices`` the world size; ``backend`` "nccl" (a GPU per rank) or
    "gloo" (CPU processes). ``train_images`` / ``test_images`` are counts, ``dataset`` "cifar10" or
    "synthetic" (resolved by the plan, :func:`lab_utils.engine.config.resolve_dataset`).
    """

    devices: int
    backend: str
    batch_size: int
    epochs: int = 2
    width: int = 64
    train_images: int = 50_000
    test_images: int = 10_000
    dataset: str = "synthetic"
    num_workers: int = 0
    lr: float = 0.1
    lr_rule: str = "fixed"
    base_batch: int = 128
    warmup_epochs: float = 0.0
    decay: str = "constant"
    eval: bool = False
    measure_comm: bool = False
    comm_steps: int | None = None
    bucket_cap_mb: float | None = None
    accumulation_steps: int = 1
    seed: int = 0
    tag: str = ""
    debug_slow_rank: int | None = None
    debug_slow_loader_seconds: float | None = None
    method: str = "DDP"
    repeat: int = 0     # 0: the first measurement; r > 0: the (r+1)-th of REPEATS (notebooks 02, 03)

    def validate(self) -> RunConfig:
        """Raise :class:`LabError` on a value no run can take (before any process starts)."""
        check_batch_size(self.batch_size, "per-device batch size")
        for what in ("devices", "epochs", "width", "base_batch", "accumulation_steps", "train_images",
                     "test_images"):
            check_positive_int(getattr(self, what), what.replace("_", " "))
        if self.measure_comm:
            check_positive_int(self.comm_steps, "comm steps")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise LabError(f"bucket_cap_mb must be positive, got {self.bucket_cap_mb}.")
        if (self.debug_slow_rank is None) != (self.debug_slow_loader_seconds is None):
            raise LabError("debug_slow_rank and debug_slow_loader_seconds go together; give both or neither.")
        check_choice(self.dataset, DATASET_CHOICES[1:], "dataset (resolved)")
        check_choice(self.lr_rule, LR_RULES, "lr rule")
        check_choice(self.decay, DECAYS, "decay")
        if not self.lr > 0:
            raise LabError(f"lr must be positive, got {self.lr}.")
        if not 0 <= self.warmup_epochs <= self.epochs:
            raise LabError(f"warmup_epochs must be between 0 and epochs ({self.epochs}), "
                           f"got {self.warmup_epochs}.")
        return self

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.devices * self.accumulation_steps

    def config(self, record: str = "aggregate", rank: int | None = None) -> dict[str, Any]:
        """The records' ``config`` (stable: it is the resume key; the plan adds the metrics version,
        :func:`lab_utils.engine.plan.versioned`). ``accumulation_steps``, the repeat and the test knob
        appear only when used."""
        cfg = {
            "method": self.method, "record": record, "rank": rank, "devices": self.devices,
            "backend": self.backend, "device_type": "cuda" if self.backend == "nccl" else "cpu",
            "batch_size": self.batch_size, "global_batch": self.global_batch, "epochs": self.epochs,
            "width": self.width, "train_images": self.train_images, "test_images": self.test_images,
            "dataset": self.dataset, "num_workers": self.num_workers, "lr": self.lr, "lr_rule": self.lr_rule,
            "base_batch": self.base_batch, "warmup_epochs": self.warmup_epochs, "decay": self.decay,
            "eval": self.eval, "measure_comm": self.measure_comm,
            "comm_steps": self.comm_steps if self.measure_comm else None, "bucket_cap_mb": self.bucket_cap_mb,
            "seed": self.seed, "tag": self.tag,
        }
        if self.accumulation_steps != 1:
            cfg["accumulation_steps"] = self.accumulation_steps
        if self.repeat:
            cfg[REPEAT] = self.repeat
        if self.debug_slow_rank is not None:
            cfg["debug_slow_rank"] = self.debug_slow_rank
            cfg["debug_slow_loader_seconds"] = self.debug_slow_loader_seconds
        return cfg

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> RunConfig:
        """Back from a record's ``config`` (the keys that are not fields, e.g. ``record``, are derived)."""
        return cls(**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg})


# --------------------------------------------------------------------------- data


def train_dataset(args: RunConfig):
    """The (resolved) training subset with the spec's train transforms (synthetic: only its images built)."""
    ds, _ = cifar10_dataset(True, args.dataset, train_transform(), size=args.train_images)
    return Subset(ds, range(args.train_images)) if args.train_images < len(ds) else ds


def test_shard(args: RunConfig, rank: int, world: int):
    """This rank's share of the test subset: images rank, rank+world, ... (no padding, no duplicates)."""
    ds, _ = cifar10_dataset(False, args.dataset, test_transform(), size=args.test_images)
    return Subset(ds, range(rank, args.test_images, world))


def sample_order_head(sampler, n: int = SAMPLE_ORDER_HEAD) -> list[int]:
    """The first ``n`` indices the sampler yields this epoch (after ``set_epoch``)."""
    return [int(i) for i in itertools.islice(sampler, n)]


# --------------------------------------------------------------------------- training


def prepare(job: Job, ctx: DistContext) -> dict[str, Any]:
    """What every configuration of the job shares: the training set (and this rank's test shard),
    built once (the job's configurations share their data settings: the plan groups them so)."""
    apply_training_backends()  # the cuDNN settings of every training path; each record states them
    t0 = time.perf_counter()
    first = RunConfig.from_config(job.configs[0])
    return {"train": train_dataset(first),
            "test": test_shard(first, ctx.rank, ctx.world_size) if any(c.get("eval") for c in job.configs)
            else None,
            "data_seconds": time.perf_counter() - t0}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: dict[str, Any]) -> list[Record]:
    """Train one configuration (one per-device batch size): every epoch through
    :func:`~lab_utils.learn.loop.run_epoch`, then the records (rank 0; an empty list elsewhere)."""
    t_config = time.perf_counter()
    args = RunConfig.from_config(config).validate()
    train_ds, data_seconds = state["train"], state["data_seconds"]
    test_ds = state["test"] if args.eval else None
    if args.devices != ctx.world_size:
        raise LabError(f"The configuration is for {args.devices} devices but the job has "
                       f"{ctx.world_size} ranks.")
    device = ctx.device
    cuda = device.type == "cuda"
    if args.debug_slow_rank is not None and args.debug_slow_rank >= ctx.world_size:
        raise LabError(f"debug_slow_rank {args.debug_slow_rank} is not a rank of this run "
                       f"(0..{ctx.world_size - 1}).")
    if ctx.rank == 0:
        print(f"config: {ctx.world_size} x {ctx.backend} ({device.type}), batch {args.batch_size} per device",
              flush=True)
    # data: the sampler shards the training set; each rank sees 1/world of it per epoch
    sampler = DistributedSampler(train_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=args.seed, drop_last=False)
    common = loader_worker_options(args.num_workers, cuda)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, **common)
    test_loader = (None if test_ds is None else
                   DataLoader(test_ds, batch_size=get_profile(job.profile).test_batch_size, shuffle=False,
                              **common))
    # model: identical initialisation on every rank (DDP also broadcasts rank 0's weights)
    torch.manual_seed(args.seed)
    model = ResNet18(width=args.width).to(device)
    n_params, grad_bytes = count_parameters(model), gradient_bytes(model)
    ddp = DDP(model, device_ids=[device.index] if cuda else None,
              **({} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}))
    torch.manual_seed(args.seed + 1000 * (ctx.rank + 1))  # different augmentation on each rank
    comm_timer = AllReduceTimer(ddp) if args.measure_comm else None
    # optimizer and lr schedule (per optimizer step; one step = accumulation_steps batches)
    batches_per_epoch = len(train_loader)
    steps_per_epoch = math.ceil(batches_per_epoch / args.accumulation_steps)
    schedule = make_schedule(args.lr, args.lr_rule, args.global_batch, args.base_batch, steps_per_epoch,
                             args.epochs, args.warmup_epochs, args.decay)
    optimizer = make_optimizer(ddp, lr=schedule.peak_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.lambda_for(schedule.peak_lr))
    options = StepOptions(accumulation_steps=args.accumulation_steps, scheduler=scheduler,
                          comm_timer=comm_timer, skew_barrier=ctx.world_size > 1)
    slow = args.debug_slow_loader_seconds if args.debug_slow_rank == ctx.rank else None
    synchronize(device)
    startup = data_seconds + time.perf_counter() - t_config

    epochs: list[dict[str, Any]] = []
    step = 0
    t_train0 = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        sampler.set_epoch(epoch - 1)  # a different shuffle every epoch, the same on every rank
        head = sample_order_head(sampler)
        lr_first = schedule.lr_at(step)
        ep = run_epoch(ddp, train_loader if slow is None else _slowed(train_loader, slow), optimizer, device,
                       epoch=epoch, n_batches=batches_per_epoch, options=options, global_sums=True,
                       desc=f"rank {ctx.rank} epoch {epoch}")
        step += ep.steps
        rec = rank_epoch(ep, head, lr_first, schedule.lr_at(max(step - 1, 0)))
        if test_loader is not None:
            rec.update(_evaluate(ddp, test_loader, device))
        rec["elapsed_seconds"] = time.perf_counter() - t_train0
        epochs.append(rec)
        if ctx.rank == 0:
            acc = f", test acc {rec['test_accuracy']:.4f}" if "test_accuracy" in rec else ""
            print(f"epoch {epoch}/{args.epochs}: {ep.epoch_seconds:.2f} s (rank 0), train loss "
                  f"{rec['train_loss']:.4f}{acc}", flush=True)
    probe = _probe(ddp, train_loader, comm_timer, args.comm_steps, ctx) if comm_timer is not None else None
    if probe is not None:  # (b) and (c) per epoch from this rank's probe: aggregated like any phase
        epochs[-1].update(probe_seconds(probe, epochs[-1]["steps"]))
    mine = {"rank": ctx.rank, "epochs": epochs, "startup_seconds": startup, "comm_probe": probe,
            "threads": torch.get_num_threads()}
    buckets = ddp_bucket_bytes(ddp)  # as DDP rebuilt them in the first backward, the same on every rank
    gathered = gather(mine, ctx)
    # Everything that holds the model's memory goes before the cache is emptied: the LR
    # scheduler holds the optimizer (and through it the parameters and momentum buffers), the
    # comm timer and the loaders' iterators the DDP module and pinned batches.
    del ddp, model, optimizer, scheduler, comm_timer, options, train_loader, test_loader
    free_device_memory(device)  # gc.collect(), then empty_cache() on a GPU
    if ctx.rank != 0:
        return []
    summary = {"parameters": n_params, "gradient_bytes": grad_bytes, "steps_per_epoch": steps_per_epoch,
               "global_batch": args.global_batch, "peak_lr": schedule.peak_lr,
               "warmup_steps": schedule.warmup_steps, "accumulation_steps": args.accumulation_steps,
               "batches_per_epoch": batches_per_epoch, "bucket_bytes": buckets,
               "worker_seconds": time.perf_counter() - t_config + data_seconds}
    return build_records(config, job, args, ctx, gathered, summary)


def rank_epoch(ep: EpochRecord, head: list[int], lr_first: float, lr: float) -> dict[str, Any]:
    """One rank's per-epoch entry of the records (see the schema above) from its :class:`EpochRecord`."""
    rec: dict[str, Any] = {
        "epoch": ep.epoch, "steps": ep.steps, "micro_steps": ep.micro_steps, "images": ep.images,
        "epoch_seconds": ep.epoch_seconds, "train_seconds": ep.train_seconds,
        "data_loading_seconds": ep.data_loading_seconds, "data_movement_seconds": ep.data_movement_seconds,
        "compute_seconds": ep.compute_seconds, "communication_seconds": ep.communication_seconds,
        "skew_wait_seconds": ep.skew_wait_seconds,
        "train_loss_rank": ep.loss, "train_accuracy_rank": ep.accuracy,
        "train_loss": ep.global_loss, "train_accuracy": ep.global_accuracy, "global_images": ep.global_images,
        "lr_first": lr_first, "lr": lr, "sample_order_head": head,
        **{k: getattr(ep, k) for k in STEP_STAT_KEYS},
    }
    if ep.allreduce_seconds is not None:  # the comm hook during the epoch itself (not the probe)
        rec["epoch_allreduce_seconds"] = ep.allreduce_seconds
        rec["exposed_tail_seconds"] = ep.exposed_tail_seconds
    return rec


def _probe(ddp, train_loader, comm_timer, comm_steps: int, ctx: DistContext) -> dict[str, Any] | None:
    """The ``no_sync`` probe after the last epoch, on the epoch's first batches (see comm_hooks)."""
    device = ctx.device
    batches = [(x.to(device), y.to(device)) for x, y in itertools.islice(train_loader, comm_steps + 1)]
    if batches:  # an epoch of one step: time its batch again (the probe does not train)
        batches = [batches[i % len(batches)] for i in range(comm_steps + 1)]
    counts: list[Any] = [None] * ctx.world_size  # every rank must run the same number of steps
    dist.all_gather_object(counts, len(batches))
    batches = batches[:min(counts)]
    return (probe_exposed_comm(ddp, batches, comm_timer, nn.CrossEntropyLoss()).as_dict()
            if len(batches) >= 2 else None)


def _slowed(loader, seconds: float):
    """Test knob (``--debug-slow-rank``): ``loader``'s batches, each ``seconds`` late (a sleep in
    the fetch, so it counts as this rank's loader wait)."""
    for batch in loader:
        time.sleep(seconds)
        yield batch


def _evaluate(ddp, loader, device) -> dict[str, float]:
    """Test loss/accuracy over all ranks' shards; rank 0's BatchNorm statistics first broadcast."""
    t0 = time.perf_counter()
    model = ddp.module
    with torch.no_grad():
        for b in model.buffers():  # running mean/var differ slightly per rank: use rank 0's
            dist.broadcast(b, src=0)
    ev = evaluate(model, loader, device)  # this rank's shard, synchronized at its ends
    n = ev.images
    sums = torch.tensor([ev.loss * n, ev.accuracy * n, n], device=device, dtype=torch.float64)
    dist.all_reduce(sums)
    loss, correct, n = sums.tolist()
    return {"test_loss": loss / max(n, 1), "test_accuracy": correct / max(n, 1), "test_images": int(n),
            "eval_seconds": time.perf_counter() - t0}


def accumulation_note(batch_size: int, devices: int, accumulation_steps: int) -> str:
    """E.g. ``4 x 512 emulated with 2 devices x 2 accumulation steps (...)``."""
    total = devices * accumulation_steps
    return (f"{total} x {batch_size} emulated with {devices} device{'s' if devices > 1 else ''} x "
            f"{accumulation_steps} accumulation steps (global batch {total * batch_size}; BatchNorm "
            f"normalizes each micro-batch of {batch_size} as each of {total} devices would, but its "
            f"running statistics get {accumulation_steps} updates per step)")


def build_records(config: dict[str, Any], job: Job, args: RunConfig, ctx: DistContext,
                  gathered: list[dict[str, Any]], summary: dict[str, Any]) -> list[Record]:
    """Rank 0: the aggregate record and one record per rank."""
    synthetic = args.dataset == "synthetic"
    dataset_name = "synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10"
    hardware = ctx.hardware()
    threads = gathered[0].get("threads")
    if ctx.device.type == "cpu":
        hardware["threads_per_process"] = threads
    history = epochs_over_ranks(gathered)
    cumulative = 0.0
    for agg in history:
        cumulative += agg["train_seconds"]
        agg["cumulative_train_seconds"] = cumulative
    reported = history[-1]
    metrics: dict[str, Any] = {k: v for k, v in reported.items() if k != "epoch"}
    metrics.update({
        "reported_epoch": reported["epoch"], "epochs": history, "time_rule": TIME_RULE,
        "world_size": ctx.world_size, "backend": ctx.backend, "device_type": ctx.device.type,
        "threads_per_rank": threads, **summary,
        "startup_seconds": max(g["startup_seconds"] for g in gathered),
    })
    probe = next((g["comm_probe"] for g in gathered if g["rank"] == reported["slowest_rank"]), None)
    if probe:  # (b), (c) and their overlap per epoch are the slowest rank's (aggregate_epoch), as T(N)
        metrics.update({"comm_probe": probe,
                        "allreduce_buckets": max(g["comm_probe"]["buckets"] for g in gathered)})
    if args.accumulation_steps > 1:
        metrics["accumulation_note"] = accumulation_note(args.batch_size, ctx.world_size,
                                                         args.accumulation_steps)
    if args.debug_slow_rank is not None:
        metrics["debug_note"] = (f"TEST KNOB: rank {args.debug_slow_rank}'s loader was slowed by "
                                 f"{args.debug_slow_loader_seconds} s per batch; not a real measurement")
    common = {"profile": job.profile, "synthetic": synthetic, "dataset": dataset_name,
              "hardware": hardware, "software": software_versions()}
    return run_records(job.experiment, config, metrics, gathered, common, drop=("sample_order_head",),
                       rank_extra=lambda g: {"rank": g["rank"], "startup_seconds": g["startup_seconds"],
                                             "comm_probe": g.get("comm_probe")})


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
