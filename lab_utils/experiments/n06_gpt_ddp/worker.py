"""The GPT training worker (notebook 06; notebook 07's fallback model), run by ``torchrun``.

``python -m torch.distributed.run --nproc-per-node N -m lab_utils.experiments.n06_gpt_ddp.worker JOB.json``: a
job of the lab's one worker protocol (:mod:`lab_utils.engine.harness`), written by
:func:`lab_utils.engine.plan.measure`. Each configuration is a :class:`TrainConfig` as a dict, the exact
``config`` of its records; ``job.options["save"]`` (not part of the key): where rank 0 writes the trained
checkpoint. CPU-only one-process runs may run in the caller's process (the same code).

``batch_size`` is the micro-batch *per rank* in sequences; one optimizer step sees ``batch_size x
accumulation_steps x devices`` sequences of ``block_size`` tokens. Gradient accumulation done right:
every micro-step but the last runs forward *and* backward inside ``DDP.no_sync()`` (DDP decides at
forward time whether the coming backward all-reduces), and each micro-batch loss is divided by the
steps, so the accumulated gradient is that of the mean loss (tested against one big batch).

Two passes, two purposes (issue 52, B3). **Throughput**: every epoch of every rank is THE epoch driver,
:func:`lab_utils.learn.loop.run_epoch`, *uninstrumented* (``timed=False``: the device synchronized only at
the two ends of the pass, so the host queues work ahead as in real training); its ``epoch_seconds`` (loader
waits included) gives ``epoch_tokens_per_s`` and the MFU. **Breakdown**: after the last epoch, one
*instrumented* pass of ``breakdown_steps`` optimizer steps (phase timers, nested forward / loss / backward /
optimizer timers, the timing comm hook and, under DDP, the loop's skew barrier, as in notebooks 02 and 03:
each boundary synchronizes the device) gives where the time goes, per step, and ``timer_overhead_ratio``,
what those synchronizations cost this run. It runs at lr 0 (AdamW then does all its work and changes no
weight) after the last validation, so the reported loss and the model are the last epoch's. Nested timers
(:class:`~lab_utils.learn.timing.NestedTimers`): run > epoch > training / validation, run > breakdown >
forward / loss / backward / optimizer. Under DDP, after each epoch the untimed ``no_sync`` probe gives each
rank's (b), (c) and overlap (:func:`lab_utils.learn.ranks.probe_seconds`).

Records (rank 0's): one **aggregate** whose epochs are :func:`lab_utils.learn.ranks.aggregate_epoch` of
the ranks' entries, with ``mfu`` (:func:`lab_utils.learn.flops.mfu`, computed here alone), the run's model,
FLOPs, precision, memory, the slowest rank's nested timers and the aggregated ``breakdown``; and one record
**per rank** (``{**config, "record": "rank", "rank": r}``). An out-of-memory error is the harness's (an
``oom`` row, or under DDP the rank's failure file).
"""

from __future__ import annotations

import itertools
import sys
from contextlib import nullcontext
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.config import CORPUS_CHOICES, loader_worker_options
from lab_utils.engine.dist import DistContext, gather
from lab_utils.engine.hardware import bf16_supported, device_name, peak_flops_per_s, software_versions
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.memory import free_device_memory
from lab_utils.engine.records import Record, run_records
from lab_utils.experiments.shared.gpt_checkpoint import save_checkpoint
from lab_utils.experiments.shared.text_data import TokenWindows, load_splits
from lab_utils.learn.comm_hooks import AllReduceTimer
from lab_utils.learn.comm_probe import probe_exposed_comm
from lab_utils.learn.epoch_record import EpochRecord
from lab_utils.learn.errors import LabError, check_choice, check_positive_int
from lab_utils.learn.evaluation import evaluate as loop_evaluate
from lab_utils.learn.flops import mfu
from lab_utils.learn.loop import StepOptions, next_epoch, run_epoch
from lab_utils.learn.models.gpt import GPT, count_parameters, lm_loss, unwrap
from lab_utils.learn.models.gpt_sizes import gpt_config, measure_train_flops_per_token, train_flops_per_token
from lab_utils.learn.ranks import aggregate_epoch, epochs_over_ranks, probe_seconds
from lab_utils.learn.schedules import LRSchedule
from lab_utils.learn.spread import STEP_PERCENTILE_KEYS
from lab_utils.learn.timing import NestedTimers

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so older records are measured again, not reused. 3 (issue 34):
#: allreduce_seconds is the probe's (c), per-rank records, speedups on train_seconds.
#: 4 (issue 52, B3): throughput (epoch_seconds, epoch_tokens_per_s, mfu) from an uninstrumented pass; the
#: phases, nested timers and comm hook from a separate instrumented pass (breakdown, timer_overhead_ratio).
METRICS_VERSION = 4
DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainConfig:
    """One GPT training run, every value resolved (``corpus``: "shakespeare" or "stdlib"): what the plan
    writes, the worker reads and the records' ``config`` holds. Batch sizes in sequences per rank."""

    devices: int = 1
    device_type: str = "cpu"
    size: str = "small"
    batch_size: int = 64
    accumulation_steps: int = 1
    epochs: int = 1
    max_steps: int | None = None          # optimizer steps over the whole run
    steps_per_epoch: int | None = None    # cap on optimizer steps per epoch
    dtype: str = "fp32"
    lr: float = 1e-3                      # AdamW's peak
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    dropout: float = 0.0
    corpus: str | None = None             # None: not resolved yet (refused; the plan resolves $LAB_CORPUS)
    max_chars: int | None = None          # characters of the corpus used (None: all)
    stride: int | None = None             # tokens between training windows (None: block_size)
    val_batches: int | None = 20          # per rank; None: the whole validation split
    val_batch_size: int = 32
    probe_steps: int = 3                  # sync/no_sync probe pairs per epoch (DDP), + 1 warm-up
    breakdown_steps: int = 5              # optimizer steps of the instrumented pass (0: none), <= an epoch's
    seed: int = 0
    num_workers: int = 0

    def validate(self) -> TrainConfig:
        """Raise :class:`LabError` for a value no run can take (before anything is started)."""
        for name in ("devices", "batch_size", "accumulation_steps", "epochs", "val_batch_size"):
            check_positive_int(getattr(self, name), name.replace("_", " "))
        for name in ("max_steps", "steps_per_epoch", "val_batches", "stride", "max_chars"):
            if getattr(self, name) is not None:
                check_positive_int(getattr(self, name), name.replace("_", " "))
        check_choice(self.dtype, DTYPES, "dtype")
        check_choice(self.device_type, ("cpu", "cuda"), "device type")
        check_choice(self.corpus, CORPUS_CHOICES[1:], "corpus (resolve it: core.text_data.resolve_corpus)")
        gpt_config(self.size)  # an unknown size: one sentence naming the sizes
        if not self.lr > 0:
            raise LabError(f"lr must be positive, got {self.lr!r}.")
        if min(self.warmup_steps, self.probe_steps, self.breakdown_steps, self.num_workers) < 0:
            raise LabError("warmup_steps, probe_steps, breakdown_steps and num_workers must be 0 or more.")
        return self

    def config(self) -> dict[str, Any]:
        """The records' ``config`` (the resume key): the fields and ``record``/``rank`` (the plan adds the
        metrics version, :func:`lab_utils.engine.plan.versioned`)."""
        return {"record": "aggregate", "rank": None, **asdict(self)}

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> TrainConfig:
        return cls(**{f.name: cfg[f.name] for f in fields(cls) if f.name in cfg})


def run_dtype(dtype: str, device: torch.device) -> tuple[str, str | None]:
    """The dtype a run asked for ``dtype`` uses on ``device``, and why it differs (None when it does not).

    bf16 where the device has no native bf16 (:func:`lab_utils.engine.hardware.bf16_supported`: a V100
    emulates it, slower than fp32, and autocast accepts it silently) runs in fp32; the record says so
    (``precision``, ``precision_note``) and its MFU is against fp32's peak.
    """
    if dtype == "bf16" and not bf16_supported(device):
        return "fp32", (f"bf16 asked; {device_name(str(device))} has no native bf16 (needs compute "
                        "capability 8.0+; emulated bf16 is not measured), so fp32 ran")
    return dtype, None


def autocast_context(device: torch.device, dtype: str):
    """bf16 autocast for ``dtype="bf16"``; nothing for fp32."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16) if dtype == "bf16" else nullcontext()


def saved_activation_bytes(model: nn.Module, x: torch.Tensor, dtype: str = "fp32") -> int:
    """Bytes of tensors autograd keeps for backward after one forward on ``x`` (saved-tensor hooks, each
    storage once, parameters excluded): the activation memory of one micro-batch, on any device."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast_context(x.device, dtype):
        unwrap(model)(x)
    return int(sum(seen.values()))


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, max_batches: int | None,
             dtype: str = "fp32") -> tuple[float, int]:
    """Summed validation loss (nats) and token count over this rank's share of ``loader``
    (the lab's one evaluation pass, :func:`lab_utils.learn.evaluation.evaluate`, over tokens)."""
    ev = loop_evaluate(unwrap(model), loader, device, loss_fn=lm_loss, max_batches=max_batches,
                       autocast_dtype=torch.bfloat16 if dtype == "bf16" else None, count_correct=False)
    return ev.loss * ev.images, ev.images


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
                       f"each of {world} ranks but the training split has only {windows} windows; lower the "
                       "batch size or the accumulation steps, use a smaller stride, or a longer corpus.")
    total = per_epoch * cfg.epochs
    return micro, per_epoch, total if cfg.max_steps is None else min(total, cfg.max_steps)


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: Any) -> list[Record]:
    """Train one configuration; rank 0 returns its records (aggregate first), the other ranks []."""
    cfg = TrainConfig.from_config(config).validate()
    if cfg.devices != ctx.world_size:
        raise LabError(f"The configuration is for {cfg.devices} devices; the job has {ctx.world_size} ranks.")
    device = ctx.device
    dtype, precision_note = run_dtype(cfg.dtype, device)
    apply_training_backends()
    timers = NestedTimers(device)
    with timers("run"):
        splits = load_splits(cfg.corpus, max_chars=cfg.max_chars)
        mcfg = gpt_config(cfg.size, vocab_size=splits.vocab.size, dropout=cfg.dropout)
        train_ds = TokenWindows(splits.train, mcfg.block_size, cfg.stride or mcfg.block_size)
        val_ds = TokenWindows(splits.val, mcfg.block_size, mcfg.block_size)
        _, per_epoch, total_steps = plan_steps(cfg, len(train_ds), ctx.world_size)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
        model: nn.Module = GPT(mcfg).to(device)
        name, peak, precision = device_peak(device, dtype)
        x0 = torch.stack([train_ds[i][0] for i in range(min(cfg.batch_size, len(train_ds)))]).to(device)
        run = {"parameters": count_parameters(model), "flops_per_token": measure_train_flops_per_token(model),
               "flops_per_token_formula": train_flops_per_token(mcfg), "steps_per_epoch": per_epoch,
               "total_steps": total_steps, "train_windows": len(train_ds), "corpus": splits.corpus_name,
               "tokens_per_step": cfg.batch_size * cfg.accumulation_steps * ctx.world_size * mcfg.block_size,
               "saved_activation_bytes": saved_activation_bytes(model, x0, dtype),  # untimed, before training
               "backend": ctx.backend, "device_type": device.type,
               "device_name": name, "precision": precision, "precision_note": precision_note,
               "peak_flops_per_s": peak, "threads_per_rank": torch.get_num_threads()}
        del x0
        epochs, probe, breakdown = _train(cfg, dtype, ctx, model, train_ds, val_ds, per_epoch, total_steps,
                                          timers)
    if job.options.get("save") and ctx.is_main:  # notebook 07 evaluates on the same split (max_chars)
        save_checkpoint(job.options["save"], model, splits.vocab.chars, splits.corpus_name,
                        {"val_loss": epochs[-1]["val_loss"], "train_loss": epochs[-1]["train_loss"],
                         "steps": sum(e["steps"] for e in epochs), "synthetic": splits.synthetic,
                         "max_chars": cfg.max_chars})
        run["checkpoint"] = job.options["save"]
    del model
    free_device_memory(device)  # gc first (DDP's hooks hold cycles): the next configuration starts empty
    gathered = gather({"epochs": epochs, "timers": timers.table(), "comm_probe": probe,
                       "breakdown": breakdown}, ctx)
    if ctx.rank != 0:
        return []
    common = {"profile": job.profile, "synthetic": splits.synthetic, "dataset": splits.corpus_name,
              "hardware": ctx.hardware(), "software": software_versions()}
    return build_records(job.experiment, config, run, gathered, common)


def _train(cfg: TrainConfig, dtype: str, ctx: DistContext, model: nn.Module, train_ds, val_ds, per_epoch: int,
           total_steps: int, timers: NestedTimers):
    """Every epoch through :func:`~lab_utils.learn.loop.run_epoch` uninstrumented, validated and probed, then
    the instrumented pass: this rank's epoch entries, its last probe (None with one process) and its
    breakdown entry (None with ``breakdown_steps=0``)."""
    device = ctx.device
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
    pin = device.type == "cuda"  # pinned host memory: the copies to the GPU can overlap
    loader = DataLoader(train_ds, batch_size=cfg.batch_size, sampler=sampler, drop_last=True,
                        **loader_worker_options(cfg.num_workers, pin))
    val_loader = DataLoader(val_ds, batch_size=cfg.val_batch_size, num_workers=0,
                            sampler=DistributedSampler(val_ds, num_replicas=ctx.world_size, rank=ctx.rank,
                                                       shuffle=False))
    # the throughput pass: nothing inside it synchronizes the device (the hook stays registered: it only
    # records CUDA events, never waits for them)
    plain = StepOptions(accumulation_steps=cfg.accumulation_steps,
                        autocast_dtype=torch.bfloat16 if dtype == "bf16" else None, count_correct=False,
                        lr_at=schedule.lr_at, grad_clip=cfg.grad_clip or None)
    out: list[dict[str, Any]] = []
    probe = None
    step = 0
    for epoch in range(1, cfg.epochs + 1):
        if step >= total_steps:
            break
        sampler.set_epoch(epoch)  # a different shuffle every epoch, the same on every rank
        n_steps = min(per_epoch, total_steps - step)
        n_micro = n_steps * cfg.accumulation_steps
        last: list = [None]  # the epoch's last micro-batch, for the probe
        batches = _keeping_last(itertools.islice(loader, n_micro), last)
        val_before = _seconds(timers, "run/epoch/validation")
        with timers("epoch"):
            with timers("training"):
                ep = run_epoch(model, batches, optimizer, device, epoch=epoch, n_batches=n_micro,
                               loss_fn=lm_loss, options=next_epoch(plain, step), timed=False,
                               global_sums=True, desc=f"rank {ctx.rank} epoch {epoch}")
            with timers("validation"):
                v_sum, v_tok = evaluate(model, val_loader, device, cfg.val_batches, dtype)
        step += ep.steps
        mine = rank_epoch(ep, ctx.rank, unwrap(model).config.block_size,
                          _seconds(timers, "run/epoch/validation") - val_before)
        if comm_timer is not None and cfg.probe_steps > 0 and last[0] is not None:
            x, y = (v.to(device) for v in last[0])
            with timers("comm_probe"), autocast_context(device, dtype):
                probe = probe_exposed_comm(model, [(x, y)] * (cfg.probe_steps + 1), comm_timer,
                                           loss_fn=lm_loss).as_dict()
            mine.update(probe_seconds(probe, n_steps))  # (b), (c), overlap: aggregated like any phase
        v_sum, v_tok = _all_reduce_sum([v_sum, float(v_tok)], ctx)
        mine["val_loss"] = v_sum / max(v_tok, 1)
        out.append(mine)
    breakdown = None
    if cfg.breakdown_steps > 0 and out:
        # the instrumented pass: every phase synchronized, the comm hook read, the skew barrier under DDP
        # (as notebooks 02 and 03 time a step); at lr 0, so AdamW does all its work and changes no weight
        n_micro = min(cfg.breakdown_steps, per_epoch) * cfg.accumulation_steps
        instrumented = replace(plain, comm_timer=comm_timer, skew_barrier=ctx.ddp, step_timers=timers,
                               lr_at=_zero_lr)
        sampler.set_epoch(cfg.epochs + 1)
        with timers("breakdown"):
            bd = run_epoch(model, itertools.islice(loader, n_micro), optimizer, device, epoch=cfg.epochs + 1,
                           n_batches=n_micro, loss_fn=lm_loss, options=next_epoch(instrumented, step),
                           desc=f"rank {ctx.rank} breakdown")
        breakdown = breakdown_entry(bd, ctx.rank, unwrap(model).config.block_size)
    return out, probe, breakdown


def _zero_lr(step: int) -> float:
    """The instrumented pass's learning rate: AdamW with lr 0 computes its whole update and applies none."""
    return 0.0


def _keeping_last(batches, slot: list):
    """Yield ``batches``, keeping the latest one in ``slot[0]``."""
    for b in batches:
        slot[0] = b
        yield b


def _seconds(timers: NestedTimers, name: str) -> float:
    return timers.stats[name].total_seconds if name in timers.stats else 0.0


def _all_reduce_sum(values: list[float], ctx: DistContext) -> list[float]:
    """Sum floats over ranks (identity with one process)."""
    return [sum(col) for col in zip(*gather(values, ctx))]


def rank_epoch(ep: EpochRecord, rank: int, block_size: int, validation_seconds: float) -> dict[str, Any]:
    """One rank's entry for one epoch of the uninstrumented pass, from its :class:`EpochRecord` (tokens =
    sequences x block): its wall time, work, loss and memory; no phases (none were timed)."""
    return {
        "rank": rank, "epoch": ep.epoch, "steps": ep.steps, "micro_steps": ep.micro_steps,
        "sequences": ep.images, "tokens": ep.images * block_size,
        "epoch_seconds": ep.epoch_seconds, "validation_seconds": validation_seconds,
        "train_loss": ep.global_loss if ep.global_loss is not None else ep.loss, "train_loss_rank": ep.loss,
        "peak_memory_bytes": ep.peak_memory_bytes, "lr": ep.lr,
    }


def breakdown_entry(ep: EpochRecord, rank: int, block_size: int) -> dict[str, Any]:
    """One rank's instrumented pass: its wall time, the synchronized phases (``train_seconds`` = data
    movement + compute + communication, loader and skew waits apart), the comm hook's all-reduce time and
    the spread of its steps, in seconds over the pass."""
    return {
        "rank": rank, "steps": ep.steps, "micro_steps": ep.micro_steps, "sequences": ep.images,
        "tokens": ep.images * block_size, "epoch_seconds": ep.epoch_seconds,
        "train_seconds": ep.train_seconds,
        "data_loading_seconds": ep.data_loading_seconds, "data_movement_seconds": ep.data_movement_seconds,
        "compute_seconds": ep.compute_seconds, "communication_seconds": ep.communication_seconds,
        "skew_wait_seconds": ep.skew_wait_seconds, "epoch_allreduce_seconds": ep.allreduce_seconds,
        **{k: getattr(ep, k) for k in STEP_PERCENTILE_KEYS},
    }


def throughput(per_rank: list[dict[str, Any]], flops_per_token: float, peak: float | None) -> dict[str, Any]:
    """One uninstrumented epoch over the ranks (:func:`aggregate_epoch`: T(N) = the slowest rank's
    ``epoch_seconds``), with ``epoch_tokens_per_s`` = all ranks' tokens / T(N) and its ``mfu``."""
    agg = aggregate_epoch(per_rank)
    agg.pop("tokens_per_s", None)  # over train_seconds, which an uninstrumented pass does not have
    agg["epoch_tokens_per_s"] = agg["tokens"] / agg["epoch_seconds"] if agg["epoch_seconds"] > 0 else None
    agg["mfu"] = mfu(flops_per_token, agg["epoch_tokens_per_s"], peak, len(per_rank))
    return agg


def build_records(experiment: str, config: dict[str, Any], run: dict[str, Any],
                  gathered: list[dict[str, Any]], common: dict[str, Any]) -> list[Record]:
    """Rank 0: the aggregate record (every epoch over the ranks, :func:`throughput`; the instrumented pass
    aggregated the same way as ``breakdown``, and ``timer_overhead_ratio``, its wall time per optimizer step
    over the reported epoch's) and one record per rank."""
    history = epochs_over_ranks(gathered, lambda per_rank: throughput(per_rank, run["flops_per_token"],
                                                                      run["peak_flops_per_s"]))
    reported = history[-1]
    slow = gathered[reported["slowest_rank"]]
    peaks = [e["peak_memory_bytes"] for g in gathered for e in g["epochs"]]
    metrics = {k: v for k, v in reported.items() if k != "epoch"}
    metrics.update(run, reported_epoch=reported["epoch"], epochs=history, timers=slow["timers"],
                   steps_done=sum(e["steps"] for e in history),
                   peak_memory_bytes=max(peaks) if None not in peaks else None)
    if all(g.get("breakdown") for g in gathered):
        bd = {k: v for k, v in aggregate_epoch([g["breakdown"] for g in gathered]).items() if k != "epoch"}
        metrics["breakdown"] = bd
        metrics["timer_overhead_ratio"] = ((bd["epoch_seconds"] / bd["steps"])
                                           / (reported["epoch_seconds"] / reported["steps"]))
    if slow["comm_probe"]:
        metrics["allreduce_buckets"] = max(g["comm_probe"]["buckets"] for g in gathered)
    return run_records(experiment, config, metrics, gathered, common,
                       rank_extra=lambda g: {"timers": g["timers"], "comm_probe": g["comm_probe"],
                                             "breakdown": g.get("breakdown")})


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
