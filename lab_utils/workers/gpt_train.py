"""Train the GPT in one process or under ``torchrun`` (DDP), timing every rank.

Command line (one process, or ``N`` ranks through :func:`lab_utils.launcher.launch`)::

    python -m lab_utils.workers.gpt_train --size tiny --batch-size 16 --accumulation-steps 4 \\
        --epochs 2 --steps-per-epoch 20 --dtype fp32 --out records.jsonl
    python -m torch.distributed.run --nproc-per-node 4 -m lab_utils.workers.gpt_train --batch-size 64 ...

``--batch-size`` is the micro-batch *per rank* in sequences; one optimizer step sees
``batch_size x accumulation_steps x world_size`` sequences of ``block_size`` tokens.

Gradient accumulation done right: every micro-step but the last runs its forward *and*
backward inside ``DDP.no_sync()`` (DDP decides at forward time whether the coming
backward all-reduces), so gradients cross the network once per optimizer step; each
micro-batch loss is divided by ``accumulation_steps`` so the accumulated gradient is the
gradient of the mean loss over all micro-batches (tested against one big batch).

What is timed, per rank and per epoch (seconds; every training epoch is THE epoch driver,
:func:`lab_utils.core.loop.run_epoch`, whose ``timing.PhaseTimer`` synchronizes the device at
every phase boundary; ``timing.NestedTimers`` keeps the run > epoch > training / validation
> forward / loss / backward tree). The names mean what :mod:`lab_utils.core.metrics` says, as
in every other record of the lab:

- ``epoch_seconds``: the training pass, loader waits included (validation is not in it:
  ``validation_seconds``);
- ``train_seconds``: data movement + compute + communication, loader waits EXCLUDED;
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
- ``tokens_per_s`` = tokens this rank trained on / its ``train_seconds`` (training time,
  loader waits excluded; the aggregate: all ranks' tokens / the slowest rank's);
- ``mfu``: FLOPs per token (counted by ``FlopCounterMode``) x tokens/s / the device's
  peak FLOP/s for the dtype (``lab_utils.core.hardware``); ``None`` on CPUs and unknown GPUs.

The aggregate of an epoch is :func:`lab_utils.core.ranks.aggregate_epoch` (as the ResNet
DDP worker's): the *slowest* rank's times (``slowest_rank``) since every step waits for it,
the means over ranks (``*_seconds_mean``) and the imbalance (max / min epoch time) to show
what averaging hides.

Output: one :class:`~lab_utils.core.records.Record` (rank 0 appends it to ``--out``): the
reported (last) epoch's aggregate at the top level of ``metrics``, ``ranks`` (its per-rank
dicts), ``epochs`` (every epoch's aggregate), the run's configuration, corpus, device, FLOPs
per token, memory and nested timers (``timers``: rank 0's, ``timers_slowest_rank``); status
``ok`` or ``oom``. Under DDP an out-of-memory error is not a status: it ends the rank
(:func:`lab_utils.core.dist.failure_ends_rank`), torchrun stops the others, and the caller
(:mod:`lab_utils.experiments.gpt`) turns the launch's error into an ``oom`` row.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lab_utils.core.backends import apply_training_backends
from lab_utils.core.comm_hooks import AllReduceTimer, overlap_figures, probe_exposed_comm
from lab_utils.core.config import loader_worker_options
from lab_utils.core.dist import DistContext, failure_ends_rank, gather, init_distributed
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import (
    bf16_supported,
    device_name,
    hardware_summary,
    peak_flops_per_s,
    software_versions,
)
from lab_utils.core.loop import EpochRecord, StepOptions, next_epoch, run_epoch
from lab_utils.core.loop import evaluate as loop_evaluate
from lab_utils.core.memory import catch_oom, free_device_memory
from lab_utils.core.ranks import aggregate_epoch
from lab_utils.core.records import Record, append_records
from lab_utils.core.schedules import LRSchedule
from lab_utils.core.text_data import TokenWindows, load_splits
from lab_utils.core.timing import NestedTimers
from lab_utils.launcher import setup_rank_logging
from lab_utils.models.gpt import (
    GPT,
    count_parameters,
    gpt_config,
    lm_loss,
    measure_train_flops_per_token,
    save_checkpoint,
    train_flops_per_token,
    unwrap,
)
from lab_utils.workers.args import TrainConfig

#: The run-level keys copied into the record's metrics next to the reported epoch's aggregate.
RUN_KEYS = ("parameters", "flops_per_token", "flops_per_token_formula", "steps_per_epoch", "total_steps",
            "tokens_per_step", "saved_activation_bytes", "peak_memory_bytes", "run_seconds", "backend",
            "device_type", "device_name", "precision", "peak_flops_per_s", "train_windows", "corpus",
            "steps_done", "checkpoint", "final_val_loss", "final_train_loss", "precision_note")


def run_dtype(dtype: str, device: torch.device) -> tuple[str, str | None]:
    """The dtype a run asked for ``dtype`` uses on ``device``, and why it differs (None when it does not).

    bf16 where the device has no native bf16 (:func:`lab_utils.core.hardware.bf16_supported`: a V100
    emulates it, slower than fp32, and autocast accepts it silently) runs in fp32, as notebooks 07 and
    08 do; the record says so (``precision``, ``precision_note``) and its MFU is against fp32's peak.
    """
    if dtype == "bf16" and not bf16_supported(device):
        return "fp32", (f"bf16 asked; {device_name(str(device))} has no native bf16 (needs compute "
                        "capability 8.0+; emulated bf16 is not measured), so fp32 ran")
    return dtype, None


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


def device_peak(device: torch.device, dtype: str) -> tuple[str, float | None, str]:
    """Device name, its peak FLOP/s for this dtype (None if unknown), precision used."""
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


def run_training(cfg: TrainConfig) -> list[Record]:
    """Train as configured; every rank returns the run's record (one :class:`Record`, in a list)."""
    cfg.validate()
    ctx = init_distributed(device=cfg.device, group_of_one=False)
    try:
        with failure_ends_rank(ctx):  # under DDP OOM (under NCCL any error) ends the rank (see there)
            return [_train(cfg, ctx)]
    finally:
        if ctx.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, ctx: DistContext) -> Record:
    device = ctx.device
    asked = cfg
    dtype, precision_note = run_dtype(cfg.dtype, device)
    cfg = replace(cfg, dtype=dtype)   # what runs; the record's config is what was asked
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
        "model_config": mcfg.to_dict(), "world_size": ctx.world_size,
        "backend": ctx.backend, "device_type": device.type, "device_name": name, "precision": precision,
        "peak_flops_per_s": peak, "corpus": splits.corpus_name,
        "vocab_size": splits.vocab.size, "train_tokens": splits.train_tokens, "val_tokens": splits.val_tokens,
        "train_windows": len(train_ds), "parameters": n_params, "flops_per_token": flops_per_token,
        "flops_per_token_formula": train_flops_per_token(mcfg), "steps_per_epoch": steps_per_epoch,
        "total_steps": total_steps, "tokens_per_step": cfg.batch_size * cfg.accumulation_steps
        * ctx.world_size * mcfg.block_size, "precision_note": precision_note,
    }
    epochs: list[dict[str, Any]] = []
    # One process: out of memory becomes the run's status (catch_oom keeps only the reason, so the
    # traceback and its tensors are dropped). Under DDP it is not caught here: it ends the rank
    # (run_training), because this rank must not go on to the gathers below while a peer is still
    # inside DDP's bucket all-reduce.
    oom = catch_oom()
    with oom if not ctx.ddp else nullcontext():
        epochs = _epochs(cfg, ctx, model, mcfg, train_ds, val_ds, total_steps, timers, base)
    if oom:  # after the with statement, so the failed step's memory can be given back
        model = None
        free_device_memory(device)
    run_timer.__exit__(None, None, None)
    rank_timers = gather(timers.table(), ctx)
    hardware = hardware_summary(str(device), ctx.world_size)
    common = {"synthetic": splits.synthetic, "dataset": splits.corpus_name, "hardware": hardware,
              "software": software_versions()}
    if oom:
        return Record("gpt", asdict(asked), {"saved_activation_bytes": base.get("saved_activation_bytes")},
                      status="oom", reason=oom.reason, **common)
    last = epochs[-1]
    peaks = [r["peak_memory_bytes"] for e in epochs for r in e["ranks"]]
    base.update({"run_seconds": timers.stats["run"].total_seconds,
                 "peak_memory_bytes": max(peaks) if peaks and None not in peaks else None,
                 "steps_done": sum(e["steps"] for e in epochs),
                 "final_val_loss": last["val_loss"], "final_train_loss": last["train_loss"]})
    if cfg.save and ctx.is_main:
        save_checkpoint(cfg.save, model, splits.vocab.chars, splits.corpus_name,
                        {"val_loss": last["val_loss"], "train_loss": last["train_loss"],
                         "steps": base["steps_done"], "synthetic": splits.synthetic,
                         "max_chars": cfg.max_chars})  # so notebook 07 evaluates on the same split
        base["checkpoint"] = cfg.save
    metrics = {k: v for k, v in last.items() if k != "ranks"}
    metrics.update({"reported_epoch": last["epoch"], "ranks": last["ranks"],
                    "epochs": [{k: v for k, v in e.items() if k != "ranks"} for e in epochs]})
    metrics.update({k: base[k] for k in RUN_KEYS if k in base})
    metrics["timers"] = rank_timers[0]                        # rank 0's nested timers
    metrics["timers_slowest_rank"] = rank_timers[last["slowest_rank"]]
    return Record("gpt", asdict(asked), metrics, **common)


def _epochs(cfg, ctx, model, mcfg, train_ds, val_ds, total_steps, timers, base) -> list[dict[str, Any]]:
    """Every epoch through :func:`~lab_utils.core.loop.run_epoch`, then validated and probed; one
    aggregate per epoch (:func:`gpt_epoch`)."""
    device = ctx.device
    # Activation memory of one micro-batch, measured once before training (untimed).
    x0 = torch.stack([train_ds[i][0] for i in range(min(cfg.batch_size, len(train_ds)))]).to(device)
    base["saved_activation_bytes"] = saved_activation_bytes(model, x0, cfg.dtype)
    del x0
    comm_timer = None
    if ctx.ddp:
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
    options = StepOptions(accumulation_steps=cfg.accumulation_steps, comm_timer=comm_timer,
                          autocast_dtype=torch.bfloat16 if cfg.dtype == "bf16" else None, count_correct=False,
                          lr_at=schedule.lr_at, grad_clip=cfg.grad_clip or None, step_timers=timers)
    out: list[dict[str, Any]] = []
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        n_steps = min(base["steps_per_epoch"], total_steps - step)
        n_micro = n_steps * cfg.accumulation_steps
        last: list = [None]  # the last micro-batch, for the communication probe below
        batches = _keeping_last(itertools.islice(loader, n_micro), last)
        val_before = _total(timers, "run/epoch/validation")
        with timers("epoch"):
            with timers("training"):
                ep = run_epoch(model, batches, optimizer, device, epoch=epoch, n_batches=n_micro,
                               loss_fn=lm_loss, options=next_epoch(options, step), global_sums=True,
                               desc=f"rank {ctx.rank} epoch {epoch}")
            with timers("validation"):
                v_sum, v_tok = evaluate(model, val_loader, device, cfg.val_batches, cfg.dtype)
        step += ep.steps
        mine = rank_epoch(ep, ctx.rank, mcfg.block_size, _total(timers, "run/epoch/validation") - val_before)
        mine.update(_probe(model, comm_timer, last[0], cfg, n_steps, timers, device))
        mine["mfu"] = base["flops_per_token"] * mine["tokens_per_s"] / base["peak_flops_per_s"] \
            if base["peak_flops_per_s"] and mine["tokens_per_s"] else None
        v_sum, v_tok = all_reduce_sum([v_sum, float(v_tok)], ctx)
        out.append(gpt_epoch(gather(mine, ctx), v_sum / max(v_tok, 1), base["peak_flops_per_s"],
                             base["flops_per_token"]))
    return out


def _total(timers: NestedTimers, name: str) -> float:
    return timers.stats[name].total_seconds if name in timers.stats else 0.0


def rank_epoch(ep: EpochRecord, rank: int, block_size: int, validation_seconds: float) -> dict[str, Any]:
    """One rank's entry for one epoch, from its :class:`EpochRecord` (tokens = sequences x block)."""
    tokens = ep.images * block_size
    return {
        "rank": rank, "epoch": ep.epoch, "steps": ep.steps, "micro_steps": ep.micro_steps,
        "sequences": ep.images, "tokens": tokens,
        "epoch_seconds": ep.epoch_seconds, "train_seconds": ep.train_seconds,
        "validation_seconds": validation_seconds,
        "data_loading_seconds": ep.data_loading_seconds, "data_movement_seconds": ep.data_movement_seconds,
        "compute_seconds": ep.compute_seconds, "communication_seconds": ep.communication_seconds,
        "allreduce_seconds": ep.allreduce_seconds or 0.0,
        "train_loss": ep.global_loss if ep.global_loss is not None else ep.loss,
        "train_loss_rank": ep.loss,
        "tokens_per_s": tokens / ep.train_seconds if ep.train_seconds else math.nan,
        "peak_memory_bytes": ep.peak_memory_bytes, "lr": ep.lr,
    }


def _probe(model, comm_timer, batch, cfg: TrainConfig, n_steps: int, timers, device) -> dict[str, Any]:
    """The untimed sync / no_sync probe on the epoch's last micro-batch (DDP only; zeros otherwise)."""
    if comm_timer is None or cfg.probe_steps <= 0 or batch is None:
        return {"exposed_comm_per_step_seconds": 0.0, "exposed_comm_seconds": 0.0, "overlap_seconds": 0.0,
                "overlap_fraction": None, "exposed_comm_noise_seconds": None, "probe": None}
    x, y = (v.to(device) for v in batch)
    with timers("comm_probe"), autocast_context(device, cfg.dtype):
        pr = probe_exposed_comm(model, [(x, y)] * (cfg.probe_steps + 1), comm_timer, loss_fn=lm_loss)
    exposed = pr.exposed_per_step_seconds * n_steps
    overlap, fraction = overlap_figures(exposed, pr.allreduce_per_step_seconds * n_steps)
    return {"exposed_comm_per_step_seconds": pr.exposed_per_step_seconds,
            "exposed_comm_seconds": exposed, "overlap_seconds": overlap,
            "overlap_fraction": fraction, "probe": pr.as_dict(),
            # standard error of the probe's mean difference, scaled like exposed_comm_seconds
            "exposed_comm_noise_seconds": (pr.noise_seconds * n_steps
                                           if math.isfinite(pr.noise_seconds) else None)}


def gpt_epoch(ranks: list[dict[str, Any]], val_loss: float, peak: float | None,
              flops_per_token: float) -> dict[str, Any]:
    """One epoch over all ranks: :func:`lab_utils.core.ranks.aggregate_epoch` (the slowest rank's times,
    means over ranks, imbalance, all ranks' tokens / the slowest rank's training seconds) plus the
    GPT's own: validation loss, MFU over all ``world_size`` devices' peak, the probe's overlap
    fraction, noise and buckets (the slowest rank's), and the per-rank dicts."""
    out = aggregate_epoch(ranks)
    slow = next(r for r in ranks if r["rank"] == out["slowest_rank"])
    out.update({
        "kind": "epoch", "val_loss": val_loss,
        "overlap_fraction": slow.get("overlap_fraction"),
        "exposed_comm_noise_seconds": slow.get("exposed_comm_noise_seconds"),
        "buckets": (slow.get("probe") or {}).get("buckets"),
        "mfu": flops_per_token * out["tokens_per_s"] / (peak * len(ranks)) if peak else None,
        "ranks": ranks,
    })
    return out


def main(argv: list[str] | None = None) -> int:
    setup_rank_logging()
    try:
        cfg, out = TrainConfig.from_argv(argv)
        records = run_training(cfg)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if int(os.environ.get("RANK", "0")) == 0:
        append_records(out, records)
        if not out:
            for r in records:
                print(r.to_json())
    return 0


if __name__ == "__main__":
    sys.exit(main())
