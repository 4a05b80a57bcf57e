"""Train the GPT in one process or under ``torchrun`` (DDP), timing every rank.

Command line (one process, or ``N`` ranks through :func:`lab_utils.launcher.launch`)::

    python -m lab_utils.workers.gpt_train --size tiny --batch-size 16 --accumulation-steps 4 \\
        --epochs 2 --steps-per-epoch 20 --dtype fp32 --out records.json
    python -m torch.distributed.run --nproc-per-node 4 -m lab_utils.workers.gpt_train --batch-size 64 ...

``--batch-size`` is the micro-batch *per rank* in sequences; one optimizer step sees
``batch_size x accumulation_steps x world_size`` sequences of ``block_size`` tokens.

Gradient accumulation done right: every micro-step but the last runs its forward *and*
backward inside ``DDP.no_sync()`` (DDP decides at forward time whether the coming
backward all-reduces), so gradients cross the network once per optimizer step; each
micro-batch loss is divided by ``accumulation_steps`` so the accumulated gradient is the
gradient of the mean loss over all micro-batches (tested against one big batch).

What is timed, per rank and per epoch (seconds; ``timing.PhaseTimer`` and
``timing.NestedTimers`` synchronize the device at every boundary):

- ``epoch_seconds``: the training loop plus validation;
- ``train_seconds``: the training loop (loader waits included);
- ``data_loading_seconds`` (waiting on the DataLoader), ``data_movement_seconds``
  (host to device), ``compute_seconds`` and ``communication_seconds``;
- communication is *measured* with :mod:`lab_utils.core.comm_hooks`, as in notebook 03: a
  timing communication hook (:class:`~lab_utils.core.comm_hooks.AllReduceTimer`) sees every
  bucket's all-reduce on the synchronizing micro-step. ``communication_seconds`` is the
  exposed wait at the end of backward (last bucket ready -> backward returned), moved
  out of ``compute_seconds``; ``allreduce_seconds`` is the time any all-reduce was in
  flight (mostly hidden behind backward). After each epoch an untimed probe
  (:func:`~lab_utils.core.comm_hooks.probe_exposed_comm`) alternates synchronizing
  forward+backward steps with ``no_sync`` ones on the same micro-batch:
  ``exposed_comm_per_step_seconds`` (their difference, >= 0; it includes waiting for the
  slowest rank), ``exposed_comm_seconds`` (that x optimizer steps), ``overlap_seconds``
  and ``overlap_fraction``. With one process all of these are 0 / None;
- ``tokens_per_s`` = tokens this rank trained on / ``train_seconds``;
- ``mfu``: FLOPs per token (counted by ``FlopCounterMode``) x tokens/s / the device's
  peak FLOP/s for the dtype (``lab_utils.core.hardware``); ``None`` on CPUs and unknown GPUs.

The aggregate of an epoch takes the *slowest* rank's times (``slowest_rank``) since
every step waits for it, and also reports the mean over ranks and the imbalance
(max / min epoch time) to show what averaging hides.

Output (``--out``; rank 0 writes it): a JSON list of one ``{"kind": "epoch", ...}``
dict per epoch (aggregate fields plus ``"ranks"``: the per-rank dicts) and a final
``{"kind": "run", ...}`` dict (configuration, corpus, device, FLOPs per token, memory,
nested timers of every rank, the cuDNN / matmul ``backends`` settings, status ``ok`` or
``oom``). Under DDP an out-of-memory error is not a status: it ends the rank
(:func:`lab_utils.core.dist.oom_ends_rank`), torchrun stops the others, and the caller
(:func:`lab_utils.experiments.gpt`) turns the launch's error into an ``oom`` row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lab_utils.core.backends import apply_training_backends, backend_settings
from lab_utils.core.config import check_choice, check_positive_int, loader_worker_options
from lab_utils.core.dist import DistContext, gather, init_distributed, oom_ends_rank
from lab_utils.core.errors import LabError
from lab_utils.core.loop import evaluate as loop_evaluate
from lab_utils.core.loop import train_steps
from lab_utils.core.memory import catch_oom, free_device_memory
from lab_utils.core.progress import progress
from lab_utils.core.schedules import LRSchedule
from lab_utils.core.text_data import CORPUS_CHOICES, TokenWindows, load_splits
from lab_utils.core.timing import NestedTimers, PhaseTimer
from lab_utils.models.gpt import (
    GPT,
    GPT_SIZES,
    count_parameters,
    gpt_config,
    lm_loss,
    measure_train_flops_per_token,
    save_checkpoint,
    train_flops_per_token,
    unwrap,
)

DTYPES = ("fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class TrainConfig:
    """One training run. Batch sizes are in sequences per rank; lr is AdamW's peak."""

    size: str = "small"
    batch_size: int = 64
    accumulation_steps: int = 1
    epochs: int = 1
    max_steps: int | None = None          # optimizer steps over the whole run
    steps_per_epoch: int | None = None    # cap on optimizer steps per epoch
    dtype: str = "fp32"
    lr: float = 1e-3
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    corpus: str = "auto"
    max_chars: int | None = None
    stride: int | None = None             # tokens between training windows (default block_size)
    val_batches: int | None = 20          # per rank; None: the whole validation split
    val_batch_size: int = 32              # sequences per validation batch (independent of --batch-size)
    probe_steps: int = 3                  # sync/no_sync probe pairs per epoch (DDP), + 1 warm-up
    seed: int = 0
    num_workers: int = 0
    device: str = "auto"
    save: str | None = None               # checkpoint path (rank 0 writes it)

    def validate(self) -> TrainConfig:
        """Raise :class:`LabError` for bad values, before any expensive work."""
        check_choice(self.size, GPT_SIZES, "GPT size")
        check_positive_int(self.batch_size, "batch size (--batch-size)")
        check_positive_int(self.accumulation_steps, "accumulation steps (--accumulation-steps)")
        check_positive_int(self.epochs, "epochs (--epochs)")
        check_positive_int(self.val_batch_size, "validation batch size (--val-batch-size)")
        for name in ("max_steps", "steps_per_epoch", "val_batches", "stride", "max_chars"):
            v = getattr(self, name)
            if v is not None:
                check_positive_int(v, f"{name} (--{name.replace('_', '-')})")
        check_choice(self.dtype, DTYPES, "dtype")
        check_choice(self.device, DEVICES, "device")
        check_choice(self.corpus, CORPUS_CHOICES, "corpus")
        if not self.lr > 0:
            raise LabError(f"lr must be positive, got {self.lr!r}.")
        if self.warmup_steps < 0 or self.probe_steps < 0 or self.num_workers < 0:
            raise LabError("warmup_steps, probe_steps and num_workers must be 0 or more.")
        return self


# --------------------------------------------------------------------------- distributed


# --------------------------------------------------------------------------- one step


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast for ``dtype="bf16"``; nothing for fp32."""
    if dtype == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return nullcontext()


def _keeping_last(batches, slot: list):
    """Yield ``batches``, keeping the latest one in ``slot[0]``."""
    for b in batches:
        slot[0] = b
        yield b


def saved_activation_bytes(model: nn.Module, x: torch.Tensor, dtype: str = "fp32") -> int:
    """Bytes of tensors autograd keeps for backward after one forward on ``x``.

    Measured with ``torch.autograd.graph.saved_tensors_hooks`` (each storage counted
    once; parameters excluded). Device-independent, so it shows on a CPU too how the
    activation memory grows with the micro-batch. Bytes.
    """
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in params:
            seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(x.device, dtype):
        out = unwrap(model)(x)
    del out
    return int(sum(seen.values()))


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, max_batches: int | None,
             dtype: str = "fp32") -> tuple[float, int]:
    """Summed validation loss (nats) and token count over this rank's share of ``loader``
    (the lab's one evaluation pass, :func:`lab_utils.core.loop.evaluate`, over tokens)."""
    ev = loop_evaluate(unwrap(model), loader, device, loss_fn=lm_loss, max_batches=max_batches,
                       autocast_dtype=torch.bfloat16 if dtype == "bf16" else None, count_correct=False)
    return ev.loss * ev.images, ev.images


def all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum floats over ranks (identity with one process)."""
    if not dist.is_initialized():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t)
    return t.tolist()


# --------------------------------------------------------------------------- the run


def device_peak(device: torch.device, dtype: str) -> tuple[str, float | None, str]:
    """Device name, its peak FLOP/s for this dtype (None if unknown), precision used."""
    from lab_utils.core.hardware import device_name, peak_flops_per_s

    name = device_name(str(device))
    if device.type != "cuda":
        return name, None, dtype
    if dtype == "bf16":
        precision = "bf16"
    else:  # a GPT is matmuls: TF32 only when torch allows it for matmuls (off by default)
        tf32 = torch.backends.cuda.matmul.allow_tf32 and peak_flops_per_s(name, "tf32") is not None
        precision = "tf32" if tf32 else "fp32"
    return name, peak_flops_per_s(name, precision), precision


def plan_steps(cfg: TrainConfig, windows: int, world: int) -> tuple[int, int, int]:
    """(micro-batches per rank per epoch, optimizer steps per epoch, total steps)."""
    micro = windows // world // cfg.batch_size  # DistributedSampler(drop_last) + DataLoader(drop_last)
    per_epoch = micro // cfg.accumulation_steps
    if cfg.steps_per_epoch is not None:
        per_epoch = min(per_epoch, cfg.steps_per_epoch)
    if per_epoch == 0:
        raise LabError(f"An optimizer step needs {cfg.batch_size} x {cfg.accumulation_steps} sequences on "
                       f"each of {world} ranks but the training split has only {windows} windows; lower "
                       "--batch-size or --accumulation-steps, use a smaller --stride, or a longer corpus.")
    total = per_epoch * cfg.epochs
    if cfg.max_steps is not None:
        total = min(total, cfg.max_steps)
    return micro, per_epoch, total


def run_training(cfg: TrainConfig) -> list[dict[str, Any]]:
    """Train as configured; every rank returns the same list of records (see module doc)."""
    cfg.validate()
    ctx = init_distributed(device=cfg.device, group_of_one=False)
    try:
        with oom_ends_rank(ctx):  # under DDP an out-of-memory error ends the rank (see there)
            return _train(cfg, ctx)
    finally:
        if ctx.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: DistContext) -> list[dict[str, Any]]:
    device = ctx.device
    apply_training_backends()
    timers = NestedTimers(device)
    run_timer = timers("run")
    run_timer.__enter__()
    # -- data and plan (cheap checks first)
    splits = load_splits(cfg.corpus, max_chars=cfg.max_chars)
    mcfg = gpt_config(cfg.size, vocab_size=splits.vocab.size, dropout=cfg.dropout)
    stride = cfg.stride or mcfg.block_size
    train_ds = TokenWindows(splits.train, mcfg.block_size, stride)
    val_ds = TokenWindows(splits.val, mcfg.block_size, mcfg.block_size)
    micro_per_epoch, steps_per_epoch, total_steps = plan_steps(cfg, len(train_ds), ctx.world_size)

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    model: nn.Module = GPT(mcfg).to(device)
    n_params = count_parameters(model)
    flops_per_token = measure_train_flops_per_token(model)
    name, peak, precision = device_peak(device, cfg.dtype)
    base: dict[str, Any] = {
        "config": asdict(cfg), "model_config": mcfg.to_dict(), "world_size": ctx.world_size,
        "backend": ctx.backend, "device_type": device.type, "device_name": name, "precision": precision,
        "peak_flops_per_s": peak, "corpus": splits.corpus_name, "synthetic": splits.synthetic,
        "vocab_size": splits.vocab.size, "train_tokens": splits.train_tokens, "val_tokens": splits.val_tokens,
        "train_windows": len(train_ds), "parameters": n_params, "flops_per_token": flops_per_token,
        "flops_per_token_formula": train_flops_per_token(mcfg), "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps, "tokens_per_step": cfg.batch_size * cfg.accumulation_steps
        * ctx.world_size * mcfg.block_size,
    }
    records: list[dict[str, Any]] = []
    # One process: out of memory becomes the run's status (catch_oom keeps only the reason, so the
    # traceback and its tensors are dropped). Under DDP it is not caught here: it ends the rank
    # (run_training), because this rank must not go on to the gathers below while a peer is still
    # inside DDP's bucket all-reduce.
    oom = catch_oom()
    with oom if not ctx.ddp else nullcontext():
        records = _epochs(cfg, ctx, model, mcfg, splits, train_ds, val_ds, steps_per_epoch, total_steps,
                          timers, base)
    status, reason = ("oom", oom.reason) if oom else ("ok", None)
    if oom:  # after the with statement, so the failed step's memory can be given back
        model = None
        free_device_memory(device)
    run_timer.__exit__(None, None, None)
    rank_timers = gather(timers.table(), ctx)
    peaks = gather(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None, ctx)
    summary = {"kind": "run", "status": status, "reason": reason, **base, "backends": backend_settings(),
               "run_seconds": timers.stats["run"].total_seconds,
               "peak_memory_bytes": max(peaks) if all(p is not None for p in peaks) else None,
               "timers_by_rank": rank_timers}
    if status == "ok":
        summary.update(records[-1]["final"])
    if status == "ok" and cfg.save and ctx.is_main:
        final = records[-1]
        save_checkpoint(cfg.save, model, splits.vocab.chars, splits.corpus_name,
                        {"val_loss": final["val_loss"], "train_loss": final["train_loss"],
                         "steps": summary["steps_done"], "synthetic": splits.synthetic,
                         "max_chars": cfg.max_chars})  # so notebook 07 evaluates on the same split
        summary["checkpoint"] = cfg.save
    for r in records:
        r.pop("final", None)
    return [*records, summary]


def _epochs(cfg, ctx, model, mcfg, splits, train_ds, val_ds, steps_per_epoch, total_steps, timers, base):
    device = ctx.device
    k = cfg.accumulation_steps
    # Activation memory of one micro-batch, measured once before training (untimed).
    x0 = torch.stack([train_ds[i][0] for i in range(min(cfg.batch_size, len(train_ds)))]).to(device)
    base["saved_activation_bytes"] = saved_activation_bytes(model, x0, cfg.dtype)
    del x0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    comm_timer = None
    if ctx.ddp:
        from lab_utils.core.comm_hooks import AllReduceTimer

        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[ctx.local_rank] if device.type == "cuda" else None)
        comm_timer = AllReduceTimer(model)  # the hook all-reduces like DDP's default, and times it
    optimizer = torch.optim.AdamW(unwrap(model).parameters(), lr=cfg.lr, betas=(0.9, 0.99),
                                  weight_decay=cfg.weight_decay)
    schedule = LRSchedule(peak_lr=cfg.lr, total_steps=total_steps,
                          warmup_steps=min(cfg.warmup_steps, total_steps), warmup_start_lr=cfg.lr / 10,
                          decay="cosine")
    sampler = DistributedSampler(train_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True,
                                 seed=cfg.seed, drop_last=True)
    pin = device.type == "cuda"
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        **loader_worker_options(cfg.num_workers, pin))
    val_sampler = DistributedSampler(val_ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=False)
    val_loader = DataLoader(val_ds, batch_size=cfg.val_batch_size, sampler=val_sampler, num_workers=0)
    peak = base["peak_flops_per_s"]
    fpt = base["flops_per_token"]
    tokens_per_micro = cfg.batch_size * mcfg.block_size

    records: list[dict[str, Any]] = []
    step = 0
    before = {"epoch": 0.0, "epoch/training": 0.0, "epoch/validation": 0.0}
    for epoch in range(1, cfg.epochs + 1):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        phases = PhaseTimer(device)
        n_steps = min(steps_per_epoch, total_steps - step)
        model.train()
        with timers("epoch"):
            with timers("training"):
                n_micro = n_steps * k
                last: list = [None]  # the last micro-batch, for the communication probe below
                batches = _keeping_last(itertools.islice(loader, n_micro), last)
                sums = train_steps(
                    model, progress(batches, total=n_micro, desc=f"rank {ctx.rank} epoch {epoch}"),
                    n_micro, optimizer, lm_loss, phases, device, accumulation_steps=k, comm_timer=comm_timer,
                    skew_barrier=False, autocast_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None,
                    count_correct=False, lr_at=schedule.lr_at, first_step=step,
                    grad_clip=cfg.grad_clip or None, step_timers=timers)
                step += sums.steps
                micro_done, allreduce = sums.micro_steps, sums.allreduce_seconds
                loss_sum = sums.loss_sum / cfg.batch_size  # the sum of the micro-steps' mean losses
                lr = optimizer.param_groups[0]["lr"]
            with timers("validation"):
                v_sum, v_tok = evaluate(model, val_loader, device, cfg.val_batches, cfg.dtype)
        totals = {n: timers.stats[f"run/{n}"].total_seconds
                  for n in ("epoch", "epoch/training", "epoch/validation")}
        epoch_seconds, train_seconds, val_seconds = (totals[n] - before[n] for n in totals)
        before = totals
        probe = {"exposed_comm_per_step_seconds": 0.0, "exposed_comm_seconds": 0.0, "overlap_seconds": 0.0,
                 "overlap_fraction": None, "exposed_comm_noise_seconds": None, "probe": None}
        if comm_timer is not None and cfg.probe_steps > 0:
            from lab_utils.core.comm_hooks import overlap_figures, probe_exposed_comm

            x, y = (v.to(device) for v in last[0])  # the epoch's last micro-batch
            with timers("comm_probe"), autocast_context(device, cfg.dtype):
                pr = probe_exposed_comm(model, [(x, y)] * (cfg.probe_steps + 1), comm_timer, loss_fn=lm_loss)
            exposed = pr.exposed_per_step_seconds * n_steps
            overlap, fraction = overlap_figures(exposed, pr.allreduce_per_step_seconds * n_steps)
            probe = {"exposed_comm_per_step_seconds": pr.exposed_per_step_seconds,
                     "exposed_comm_seconds": exposed, "overlap_seconds": overlap,
                     "overlap_fraction": fraction, "probe": pr.as_dict(),
                     # standard error of the probe's mean difference, scaled like exposed_comm_seconds
                     "exposed_comm_noise_seconds": (pr.noise_seconds * n_steps
                                                    if math.isfinite(pr.noise_seconds) else None)}
        tokens = micro_done * tokens_per_micro
        tps = tokens / train_seconds if train_seconds > 0 else math.nan
        mine = {
            "rank": ctx.rank, "epoch": epoch, "steps": n_steps, "micro_steps": micro_done,
            "sequences": micro_done * cfg.batch_size, "tokens": tokens,
            "epoch_seconds": epoch_seconds, "train_seconds": train_seconds, "validation_seconds": val_seconds,
            "data_loading_seconds": phases.seconds("data_loading"),
            "data_movement_seconds": phases.seconds("data_movement"),
            "compute_seconds": phases.seconds("compute"),
            "communication_seconds": phases.seconds("communication"), "allreduce_seconds": allreduce,
            **probe,
            "train_loss": float(loss_sum) / max(micro_done, 1), "tokens_per_s": tps,
            "mfu": fpt * tps / peak if peak else None,
            "peak_memory_bytes": (int(torch.cuda.max_memory_allocated(device))
                                  if device.type == "cuda" else None),
            "lr": lr,
        }
        v_sum, v_tok = all_reduce_sum([v_sum, float(v_tok)], ctx)
        ranks = gather(mine, ctx)
        records.append(aggregate_epoch(ranks, v_sum / max(v_tok, 1), peak, fpt))
    records[-1]["final"] = {"steps_done": step, "final_val_loss": records[-1]["val_loss"],
                            "final_train_loss": records[-1]["train_loss"]}
    return records


def aggregate_epoch(ranks: list[dict[str, Any]], val_loss: float, peak: float | None,
                    flops_per_token: float) -> dict[str, Any]:
    """One epoch over all ranks: the slowest rank's times, means, imbalance, global rates.

    ``epoch_seconds`` is the maximum over ranks (everyone waits for the slowest);
    ``epoch_seconds_mean`` is what averaging would report. ``tokens_per_s`` is all
    ranks' tokens / the slowest rank's training time. ``mfu`` divides by the peak of
    all ``world_size`` devices.
    """
    world = len(ranks)
    slow = max(ranks, key=lambda r: r["epoch_seconds"])
    fast = min(ranks, key=lambda r: r["epoch_seconds"])
    tokens = sum(r["tokens"] for r in ranks)
    train_max = max(r["train_seconds"] for r in ranks)
    tps = tokens / train_max if train_max > 0 else math.nan

    def mean(key: str) -> float:
        return sum(r[key] for r in ranks) / world

    out = {
        "kind": "epoch", "epoch": slow["epoch"], "world_size": world, "slowest_rank": slow["rank"],
        "fastest_rank": fast["rank"], "steps": slow["steps"], "tokens": tokens,
        "epoch_seconds": slow["epoch_seconds"], "epoch_seconds_mean": mean("epoch_seconds"),
        "epoch_seconds_min": fast["epoch_seconds"],
        "imbalance": slow["epoch_seconds"] / fast["epoch_seconds"] if fast["epoch_seconds"] > 0 else None,
        "train_seconds": train_max, "train_seconds_mean": mean("train_seconds"),
        "train_loss": mean("train_loss"), "val_loss": val_loss, "tokens_per_s": tps,
        "overlap_fraction": slow.get("overlap_fraction"),
        "exposed_comm_noise_seconds": slow.get("exposed_comm_noise_seconds"),
        "buckets": (slow.get("probe") or {}).get("buckets"),
        "mfu": flops_per_token * tps / (peak * world) if peak else None,
        "ranks": ranks,
    }
    for key in ("data_loading_seconds", "data_movement_seconds", "compute_seconds", "communication_seconds",
                "validation_seconds", "allreduce_seconds", "exposed_comm_seconds", "overlap_seconds"):
        out[key] = slow[key]              # the slowest rank's breakdown: it sums to its epoch time
        out[f"{key[:-8]}_mean_seconds" if key.endswith("_seconds") else f"{key}_mean"] = mean(key)
    return out


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="python -m lab_utils.workers.gpt_train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default=d.size, help=f"model size: {', '.join(GPT_SIZES)}")
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="micro-batch per rank (sequences)")
    p.add_argument("--accumulation-steps", type=int, default=d.accumulation_steps)
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps over the whole run")
    p.add_argument("--steps-per-epoch", type=int, default=None, help="cap on optimizer steps per epoch")
    p.add_argument("--dtype", default=d.dtype, help=f"{', '.join(DTYPES)} (bf16: autocast)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--grad-clip", type=float, default=d.grad_clip)
    p.add_argument("--dropout", type=float, default=d.dropout)
    p.add_argument("--corpus", default=d.corpus, help=f"{', '.join(CORPUS_CHOICES)}")
    p.add_argument("--max-chars", type=int, default=None, help="use only the first N characters")
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (default block_size)")
    p.add_argument("--val-batches", type=int, default=d.val_batches, help="per rank; 0 = all")
    p.add_argument("--val-batch-size", type=int, default=d.val_batch_size)
    p.add_argument("--probe-steps", type=int, default=d.probe_steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--num-workers", type=int, default=d.num_workers)
    p.add_argument("--device", default=d.device, help=f"{', '.join(DEVICES)}")
    p.add_argument("--save", default=None, help="write the trained checkpoint here (rank 0)")
    p.add_argument("--out", default=None, help="rank 0 writes the JSON records here")
    return p


def config_to_args(cfg: TrainConfig) -> list[str]:
    """The command-line arguments that reproduce ``cfg`` (for the launcher)."""
    args: list[str] = []
    for name, value in asdict(cfg).items():
        if name == "val_batches" and value is None:
            value = 0  # the command line's "all"
        if value is None:
            continue
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    kw = {k: v for k, v in vars(ns).items() if k != "out"}
    if kw.get("val_batches") == 0:
        kw["val_batches"] = None
    return TrainConfig(**kw)


def main(argv: list[str] | None = None) -> int:
    from lab_utils.launcher import setup_rank_logging, write_worker_output

    setup_rank_logging()
    ns = build_parser().parse_args(argv)
    try:
        cfg = config_from_args(ns)
        records = run_training(cfg)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        write_worker_output(records, ns.out)
        if not ns.out:
            for r in records:
                print(json.dumps({k: v for k, v in r.items() if k not in ("ranks", "timers_by_rank")},
                                 default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
