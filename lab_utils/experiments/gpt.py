"""Notebook 06's experiments: GPT scaling over devices, gradient accumulation, the final model.

This is the SPEC's *Part 2: an earlier project* (a GPT trained with DDP), not a question of
the assignment (whose questions Q1-Q7 are notebooks 01-05).

Every run goes through :mod:`lab_utils.workers.gpt_train` (one process in the notebook's kernel
for one device, ``torchrun`` through :func:`lab_utils.launcher.launch` for more) and
becomes one record in the result store:

- ``gpt_scaling``: one record per (devices, per-device batch). Without GPUs the lab runs
  gloo *CPU processes* (labelled ``backend gloo`` / ``cpu``); a device count the machine
  cannot provide gets a ``skipped`` row saying ``needs N GPUs``. The metrics are the
  reported (last) epoch's aggregate (slowest rank's times, means over ranks, imbalance),
  ``ranks`` (per-rank dicts of that epoch) and ``epochs`` (every epoch's aggregate).
- ``gpt_accumulation``: one record per micro-batch at a constant effective batch
  (micro-batch x accumulation steps per device), with rank 0's nested timers (whole
  run, epoch, training, validation; forward, loss, backward), tokens/s, and memory:
  ``peak_memory_bytes`` on a GPU (``torch.cuda.max_memory_allocated``) and everywhere
  ``saved_activation_bytes`` (what autograd keeps for backward for one micro-batch).
- ``gpt_train``: the run whose model is saved for notebook 07
  (:func:`lab_utils.models.gpt.checkpoint_path`).

Epoch = one pass over the training windows (the 90 % split, windows every ``stride``
tokens), shared among the ranks by ``DistributedSampler``: with N devices each does 1/N
of the steps, so epoch time answers a *strong scaling* question about the epoch (the
global batch grows with N, so the optimization is not the same). Epoch 1 warms up
(allocator, kernels, caches); the last epoch is reported.

Knobs per profile are in :data:`GPT_SETTINGS`.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lab_utils import launcher
from lab_utils.core import profiles
from lab_utils.core.backends import pinned_threads
from lab_utils.core.comm_hooks import derived_comm, noise_flag
from lab_utils.core.config import check_batch_sizes, check_positive_int
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import cpu_cores, hardware_summary
from lab_utils.core.memory import catch_oom, free_device_memory, mentions_out_of_memory, oom_reason_from_log
from lab_utils.core.text_data import TextSplits, TokenWindows, load_splits
from lab_utils.models.gpt import (
    GPT,
    checkpoint_path,
    count_parameters,
    gpt_config,
    load_checkpoint,
    measure_train_flops_per_token,
    parameter_count,
    train_flops_per_token,
)
from lab_utils.store import Record, ResultStore
from lab_utils.workers.args import TrainConfig
from lab_utils.workers.gpt_train import evaluate, run_training

SCALING = "gpt_scaling"
ACCUMULATION = "gpt_accumulation"
TRAIN = "gpt_train"


@dataclass(frozen=True)
class GPTSettings:
    """Notebook 06's knobs for one profile. Batch sizes are sequences per device."""

    size: str
    dtype: str
    lr: float
    corpus: str = "auto"
    max_chars: int | None = None          # characters of the corpus used (None: all)
    stride: int | None = None             # tokens between training windows (None: block_size)
    val_batches: int | None = None        # per rank, per evaluation (None: the whole split)
    # scaling
    scaling_devices: tuple[int, ...] = (1, 2, 4)
    scaling_batch_sizes: tuple[int, ...] = (64, 128)
    scaling_epochs: int = 2
    cpu_processes: int = 2                # gloo processes at most, when there is no GPU
    # accumulation
    effective_batch: int = 1024           # micro-batch x accumulation steps, per device
    micro_batches: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
    accumulation_epochs: int = 2
    accumulation_steps_per_epoch: int | None = None
    accumulation_devices: int | None = None   # None: every GPU up to 4; 1 process on a CPU
    # the model saved for notebook 07
    train_batch_size: int = 64
    train_epochs: int = 1
    train_max_steps: int | None = None
    sample_chars: int = 300
    timeout_s: float = 3600.0

    @property
    def label(self) -> str:
        return f"GPT {self.size}, {self.dtype}"


# Per-profile values: lab_utils.core.profiles (one table for every notebook).
GPT_SETTINGS: dict[str, GPTSettings] = profiles.table(GPTSettings)


def resolve_settings(profile: str, settings: GPTSettings | None = None, **overrides: Any) -> GPTSettings:
    """The profile's :class:`GPTSettings` with the non-``None`` overrides applied, checked."""
    s = profiles.override(settings or GPT_SETTINGS[profile], "GPT", **overrides)
    check_batch_sizes(s.scaling_batch_sizes, "scaling batch sizes")
    check_batch_sizes(s.scaling_devices, "scaling device counts")
    check_batch_sizes(s.micro_batches, "micro-batches")
    check_positive_int(s.effective_batch, "effective batch")
    bad = [m for m in s.micro_batches if s.effective_batch % m]
    if bad:
        raise LabError(f"Micro-batches {bad} do not divide the effective batch {s.effective_batch}; "
                       "use divisors of it (e.g. powers of two).")
    gpt_config(s.size)  # an unknown size: one sentence naming the sizes
    TrainConfig(size=s.size, dtype=s.dtype, lr=s.lr, corpus=s.corpus, max_chars=s.max_chars, stride=s.stride,
                batch_size=s.train_batch_size, epochs=s.train_epochs, max_steps=s.train_max_steps).validate()
    return s


def _train_config(s: GPTSettings, **kw: Any) -> TrainConfig:
    base = {"size": s.size, "dtype": s.dtype, "lr": s.lr, "corpus": s.corpus, "max_chars": s.max_chars,
            "stride": s.stride, "val_batches": s.val_batches}
    base.update(kw)
    return TrainConfig(**base).validate()


# --------------------------------------------------------------------------- running


@dataclass
class Devices:
    """What this machine can run: GPUs, or gloo CPU processes."""

    kind: str          # "cuda" or "cpu"
    available: int     # GPUs, or CPU processes allowed
    gpus: int
    threads_per_process: int | None = None   # CPU: one "device" = this many cores, whatever N is

    def reason(self, n: int) -> str | None:
        """Why ``n`` devices cannot run here, or None."""
        if n <= self.available:
            return None
        if self.kind == "cuda":
            return f"needs {n} GPUs (this machine has {self.gpus})"
        return f"needs {n} GPUs (no GPU here; at most {self.available} gloo CPU processes)"


def available_devices(settings: GPTSettings) -> Devices:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return Devices("cuda", gpus, gpus)
    procs = max(1, min(settings.cpu_processes, cpu_cores()))
    return Devices("cpu", procs, 0, threads_per_process=max(1, cpu_cores() // procs))


def execute(cfg: TrainConfig, nproc: int, devices: Devices, log_dir,
            timeout_s: float) -> tuple[Record, float]:
    """Run ``cfg`` on ``nproc`` ranks; returns the worker's record and the wall seconds.

    One rank runs in this process (no process start-up; the same code path without
    DDP); more go through ``torchrun``. Wall seconds include start-up for launched runs.
    On a CPU every process, the in-process one included, gets the same number of
    threads (cores / the most processes used), so a "device" is the same compute
    whatever the device count.
    """
    threads = None
    if devices.kind == "cpu":
        cfg = replace(cfg, device="cpu")
        threads = devices.threads_per_process
    t0 = time.perf_counter()
    if nproc == 1:
        with pinned_threads(threads):
            records = run_training(cfg)
        free_device_memory()  # not in the finally: after a failure, _measure frees once the traceback is gone
        return records[-1], time.perf_counter() - t0
    res = launcher.launch("lab_utils.workers.gpt_train", cfg.to_argv(), nproc=nproc, timeout_s=timeout_s,
                          log_dir=log_dir, threads_per_rank=threads)
    return res.records[-1], res.wall_seconds


def _measure(experiment: str, cfg_key: dict, cfg: TrainConfig, nproc: int, devices: Devices,
             store: ResultStore, settings: GPTSettings) -> Record:
    log_dir = store.root / "logs" / f"{experiment}_{nproc}x{cfg.batch_size}x{cfg.accumulation_steps}"
    # Out of memory outside the worker's training loop (building the model, counting its
    # FLOPs) in this process: a row, and the memory is freed after the with statement.
    # Under DDP a rank that runs out of memory ends itself (core.dist.oom_ends_rank) and the
    # launch fails with that rank's log: a LaunchError that says out of memory is a row too,
    # as in scaling._run_ddp; any other failure propagates.
    launch_oom: str | None = None
    with catch_oom() as oom:
        try:
            rec, wall = execute(cfg, nproc, devices, log_dir, settings.timeout_s)
        except LaunchError as e:
            if not mentions_out_of_memory(str(e)):
                raise
            launch_oom = oom_reason_from_log(str(e))
    if oom or launch_oom:
        free_device_memory()
        return Record(experiment=experiment, config=cfg_key, status="oom", reason=oom.reason or launch_oom,
                      hardware=hardware_summary(devices.kind, nproc))
    rec.hardware = hardware_summary(devices.kind, nproc)
    if rec.status == "ok":
        rec.metrics["wall_seconds"] = wall                  # includes process start-up when launched
        rec.metrics["threads_per_process"] = devices.threads_per_process
    return rec


#: Bumped when a metric of these records changes meaning, so that records measured under the old
#: meaning are measured again instead of reused (it is part of every resume key). 2 (issue 26):
#: ``train_seconds`` and ``tokens_per_s`` exclude loader waits, ``epoch_seconds`` is the training
#: pass alone (validation in ``validation_seconds``), ``*_mean_seconds`` became ``*_seconds_mean``.
METRICS_VERSION = 2


def _key(cfg: TrainConfig, devices: int, kind: str, **extra: Any) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("save", None)
    return {"devices": devices, "device_type": kind, **d, **extra, "metrics_version": METRICS_VERSION}


@dataclass
class GPTResult:
    records: list[Record]
    settings: GPTSettings

    @property
    def ok(self) -> list[Record]:
        return [r for r in self.records if r.status == "ok"]


def _unpack(lab: Any) -> tuple[str, ResultStore]:
    if hasattr(lab, "profile") and hasattr(lab, "store"):
        return lab.profile.name, lab.store
    if isinstance(lab, str) or lab is None:
        store = ResultStore(lab)
        return store.profile, store
    raise LabError(f"Pass the notebook's session (lab = start(PROFILE)), got {type(lab).__name__}.")


def _say(rec: Record, what: str) -> None:
    if rec.status != "ok":
        print(f"{what}: {rec.status} ({rec.reason})")
        return
    m = rec.metrics
    print(f"{what}: epoch {m['reported_epoch']} {m['epoch_seconds']:.2f} s "
          f"(slowest rank {m['slowest_rank']}), {m['tokens_per_s']:.0f} tokens/s, "
          f"val loss {m['val_loss']:.3f}")


def run_scaling(lab: Any, settings: GPTSettings | None = None, force: bool = False,
                verbose: bool = True, **overrides: Any) -> GPTResult:
    """Per-device batch x device count: one record each in ``gpt_scaling`` (resumable)."""
    profile, store = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    devs = available_devices(s)
    out = []
    for bs in s.scaling_batch_sizes:
        for n in s.scaling_devices:
            cfg = _train_config(s, batch_size=bs, epochs=s.scaling_epochs)
            key = _key(cfg, n, devs.kind)
            why = devs.reason(n)
            if why is not None:
                rec = Record(experiment=SCALING, config=key, status="skipped", reason=why, profile=profile,
                             hardware=hardware_summary(devs.kind, n))
            else:
                rec = store.run(SCALING, key, lambda cfg=cfg, n=n, key=key: _measure(
                    SCALING, key, cfg, n, devs, store, s), force=force,
                    hardware=hardware_summary(devs.kind, n))
            if verbose:
                _say(rec, f"batch {bs}/device x {n} {'GPU' if devs.kind == 'cuda' else 'CPU process'}(es)")
            out.append(rec)
    return GPTResult(out, s)


def run_accumulation(lab: Any, settings: GPTSettings | None = None, force: bool = False,
                     verbose: bool = True, **overrides: Any) -> GPTResult:
    """Constant effective batch, micro-batch x accumulation steps; stops after the first OOM."""
    profile, store = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    devs = available_devices(s)
    n = s.accumulation_devices or (min(devs.gpus, 4) if devs.kind == "cuda" else 1)
    out: list[Record] = []
    oom = False
    for mb in s.micro_batches:
        k = s.effective_batch // mb
        cfg = _train_config(s, batch_size=mb, accumulation_steps=k, epochs=s.accumulation_epochs,
                            steps_per_epoch=s.accumulation_steps_per_epoch)
        key = _key(cfg, n, devs.kind, effective_batch=s.effective_batch)
        why = devs.reason(n)
        if oom or why:
            rec = Record(experiment=ACCUMULATION, config=key, status="skipped", profile=profile,
                         reason=why or "a smaller micro-batch already ran out of memory",
                         hardware=hardware_summary(devs.kind, n))
        else:
            rec = store.run(ACCUMULATION, key, lambda cfg=cfg, key=key: _measure(
                ACCUMULATION, key, cfg, n, devs, store, s), force=force,
                hardware=hardware_summary(devs.kind, n))
            oom = rec.status == "oom"
        if verbose:
            _say(rec, f"micro-batch {mb} x {k} steps")
        out.append(rec)
    return GPTResult(out, s)


def train_final(lab: Any, settings: GPTSettings | None = None, force: bool = False,
                verbose: bool = True, **overrides: Any) -> Record:
    """Train the model notebook 07 uses, on every available device, and save the checkpoint."""
    profile, store = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    devs = available_devices(s)
    n = devs.available
    path = checkpoint_path(profile)
    cfg = _train_config(s, batch_size=s.train_batch_size, epochs=s.train_epochs, max_steps=s.train_max_steps,
                        save=str(path))
    key = _key(cfg, n, devs.kind)
    if not path.exists():
        force = True
    rec = store.run(TRAIN, key, lambda: _measure(TRAIN, key, cfg, n, devs, store, s), force=force,
                    hardware=hardware_summary(devs.kind, n))
    if verbose:
        _say(rec, f"final training on {n} {'GPU' if devs.kind == 'cuda' else 'CPU process'}(es)")
        if rec.status == "ok":
            print(f"checkpoint: {path}")
    return rec


# --------------------------------------------------------------------------- text samples


def corpus_splits(lab: Any, settings: GPTSettings | None = None, **overrides: Any) -> TextSplits:
    profile, _ = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    return load_splits(s.corpus, max_chars=s.max_chars)


def sample_text(model: GPT, splits: TextSplits, n_chars: int, prompt_chars: int = 40, seed: int = 0,
                temperature: float = 0.8) -> tuple[str, str]:
    """``(prompt, continuation)``: the model continues the start of the validation text."""
    prompt = splits.val[:prompt_chars].unsqueeze(0)
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev).manual_seed(seed)
    out = model.generate(prompt.to(dev), n_chars, temperature=temperature, top_k=None, generator=g)
    return splits.vocab.decode(prompt[0]), splits.vocab.decode(out[0, prompt_chars:].cpu())


def validation_loss(model: GPT, splits: TextSplits, batches: int | None, batch_size: int = 32) -> float:
    """Mean next-character loss (nats/char) over the first ``batches`` validation batches."""
    from torch.utils.data import DataLoader

    dev = next(model.parameters()).device
    ds = TokenWindows(splits.val, model.config.block_size, model.config.block_size)
    total, tokens = evaluate(model, DataLoader(ds, batch_size=batch_size), dev, batches)
    return total / max(tokens, 1)


def samples_before_after(lab: Any, settings: GPTSettings | None = None, **overrides: Any):
    """A table: the untrained model and the trained checkpoint continuing the same prompt."""
    import pandas as pd

    profile, _ = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    splits = corpus_splits(lab, s)
    torch.manual_seed(0)
    untrained = GPT(gpt_config(s.size, vocab_size=splits.vocab.size)).eval()
    trained, payload = load_checkpoint(checkpoint_path(profile))
    if payload["vocab"] != splits.vocab.chars:
        raise LabError("The checkpoint was trained on another corpus than this notebook now uses; "
                       "re-run the final training with FORCE = True.")
    rows = []
    for stage, model in (("before training", untrained), ("after training", trained)):
        prompt, text = sample_text(model, splits, s.sample_chars)
        rows.append({"model": stage, "val_loss_nats_per_char": validation_loss(model, splits, s.val_batches),
                     "prompt": prompt, "generated": text})
    df = pd.DataFrame(rows)
    df.attrs["vocab_size"] = splits.vocab.size
    df.attrs["corpus"] = splits.corpus_name
    return df


def print_samples(df) -> None:
    """The samples as plain text (newlines kept), prompt and continuation marked."""
    for _, row in df.iterrows():
        print(f"--- {row['model']} (validation loss {row['val_loss_nats_per_char']:.3f} nats/char) ---")
        print(f"[prompt] {row['prompt']}[model] {row['generated']}\n")


def markdown_safe(text: str) -> str:
    """One-line text for a Markdown table cell: newlines shown as ⏎, pipes escaped."""
    return text.replace("|", "\\|").replace("\n", " ⏎ ")


def save_samples(store: ResultStore, df, record: Record | None = None):
    """Save the samples table as ``gpt_samples`` (newlines shown as ⏎)."""
    vocab_size = df.attrs["vocab_size"]
    table = df.copy()
    for c in ("prompt", "generated"):
        table[c] = table[c].map(markdown_safe)
    store.save_table(table, "gpt_samples", [record] if record else None, title="GPT text samples",
                     notes=["Same prompt (the start of the validation text), temperature 0.8, seed 0.",
                            "Loss: mean next-character cross-entropy on validation batches (nats/char); "
                            f"guessing uniformly among the {vocab_size} characters gives "
                            f"ln({vocab_size}) = {math.log(vocab_size):.2f}."])
    return table


# --------------------------------------------------------------------------- tables


def _num(v: Any) -> Any:
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else v


def _blanks(df):
    """Missing numbers print as blanks in the Markdown tables, not as 'nan'."""
    return df.astype(object).where(df.notna(), None)


# The earlier project's GPT report (SPEC.md, Part 2), as published: every rank's total epoch time
# (seconds) by (per-GPU batch, GPUs), and the "average" row it printed (the mean over ranks), from
# which it took its speedups. One copy of each; the test checks them against SPEC.md.
EARLIER_GPT_RANK_SECONDS: dict[tuple[int, int], tuple[float, ...]] = {
    (64, 1): (2233.50,), (128, 1): (2082.29,),
    (64, 2): (1384.64, 806.75), (128, 2): (1188.86, 693.97),
    (64, 4): (833.37, 819.76, 827.95, 816.87), (128, 4): (706.41, 418.27, 415.71, 418.10),
}
EARLIER_GPT_SECONDS_MEAN: dict[tuple[int, int], float] = {
    (64, 1): 2233.50, (64, 2): 1095.70, (64, 4): 824.49,
    (128, 1): 2082.29, (128, 2): 941.42, (128, 4): 489.62,
}


def earlier_report_frame():
    """The earlier project's per-rank table with its speedups recomputed two ways: T(1)/T(N) with the
    report's mean over ranks (as it published them: 2.04 / 2.71 at batch 64 on 2 / 4 GPUs, 2.21 /
    4.25 at 128, three of them above N) and with the SLOWEST rank (1.61 / 2.68 and 1.75 / 2.95).
    Every step waits for the slowest rank, so that is the epoch's real length. Seconds as published;
    speedups rounded to 2 decimals, as the report gave them."""
    import pandas as pd

    ranks = max(len(t) for t in EARLIER_GPT_RANK_SECONDS.values())
    rows = []
    for (b, n), times in sorted(EARLIER_GPT_RANK_SECONDS.items()):
        t1, mean, slow = EARLIER_GPT_SECONDS_MEAN[(b, 1)], EARLIER_GPT_SECONDS_MEAN[(b, n)], max(times)
        row: dict[str, Any] = {"per-GPU batch": b, "GPUs": n}
        row.update({f"rank {r} (s)": times[r] if r < len(times) else None for r in range(ranks)})
        row.update({"report's mean (s)": mean, "speedup on the mean (as reported)": round(t1 / mean, 2),
                    "slowest rank (s)": slow, "speedup on the slowest rank": round(t1 / slow, 2),
                    "note": "super-linear: speedup > N on the mean" if n > 1 and t1 / mean > n else ""})
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


def earlier_report_note() -> str:
    """One sentence: the earlier project's published speedups (on the mean over ranks) next to the
    slowest rank's, from :func:`earlier_report_frame`."""
    df = earlier_report_frame()
    parts = []
    for b, g in df[df["GPUs"] > 1].groupby("per-GPU batch"):
        mean = " / ".join(f"{v:.2f}" for v in g["speedup on the mean (as reported)"])
        slow = " / ".join(f"{v:.2f}" for v in g["speedup on the slowest rank"])
        gpus = " / ".join(str(n) for n in g["GPUs"])
        parts.append(f"batch {b} on {gpus} GPUs: {mean} on the mean over ranks, {slow} on the slowest rank")
    return ("Earlier project (SPEC.md, Part 2), speedups T(1)/T(N) as it reported them and recomputed: "
            + "; ".join(parts) + " (earlier_report_frame).")


def scaling_table(result: GPTResult):
    """gpt_scaling: time (slowest rank), speedup T(1)/T(N), efficiency, and what averaging would say.

    Runs on different device counts need not do the same work: ``drop_last`` batches per rank
    make, e.g., 13 steps on one device (53,248 tokens) but 2 x 6 on two (49,152). So beside the
    epoch-time speedup the table gives the tokens each run trained and the speedup on
    training tokens/s (work-equalized), and flags unequal work.
    """
    import pandas as pd

    base: dict[int, Record] = {r.config["batch_size"]: r for r in result.ok if r.config["devices"] == 1}
    rows = []
    for r in result.records:
        bs, n = r.config["batch_size"], r.config["devices"]
        row: dict[str, Any] = {"per-device batch": bs, "devices": n, "status": r.status}
        if r.status == "ok":
            m = r.metrics
            t = m["epoch_seconds"]
            one = base.get(bs)
            t1 = one.metrics["epoch_seconds"] if one else None
            speed = t1 / t if t1 else None
            mean_speed = t1 / m["epoch_seconds_mean"] if t1 else None
            tokens, tokens1 = m.get("tokens"), (one.metrics.get("tokens") if one else None)
            tps1 = one.metrics.get("tokens_per_s") if one else None
            tps_speed = m["tokens_per_s"] / tps1 if tps1 and m.get("tokens_per_s") else None
            row.update({
                "backend": m["backend"] or "one process", "epoch (s), slowest rank": t,
                "speedup T1/TN": speed, "efficiency": speed / n if speed else None,
                "speedup if averaged over ranks": mean_speed, "slowest rank": m["slowest_rank"],
                "imbalance max/min": m["imbalance"], "tokens/s": m["tokens_per_s"], "MFU": _num(m["mfu"]),
                "val loss": m["val_loss"], "reason": None,
                "tokens trained (epoch)": tokens,
                "work vs 1 device": tokens / tokens1 if tokens and tokens1 else None,
                "speedup on tokens/s (equal work)": tps_speed,
                "efficiency on tokens/s": tps_speed / n if tps_speed else None,
                "work note": unequal_work_note(tokens, tokens1, n)})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


def unequal_work_note(tokens: int | None, tokens_one: int | None, devices: int) -> str:
    """"" when an N-device epoch trained as many tokens as the one-device epoch, else a flag
    saying by how much they differ and which speedup to use."""
    if devices == 1 or not tokens or not tokens_one or tokens == tokens_one:
        return ""
    return (f"unequal work: {tokens:,} tokens vs {tokens_one:,} on 1 device ({tokens / tokens_one:.3f}x); "
            "T1/TN compares different work, use the tokens/s speedup")


SCALING_TIME_BASIS = [
    "Time basis of each column. 'epoch (s), slowest rank': the slowest rank's training loop + validation "
    "of the reported epoch (wall seconds). 'speedup T1/TN' and 'efficiency': ratios of those epoch times "
    "(they compare different work when the token counts differ). 'speedup if averaged over ranks': T1 over "
    "the MEAN over ranks of that epoch time. 'tokens/s': all ranks' training tokens / the slowest rank's "
    "training-loop seconds (validation excluded). 'speedup on tokens/s (equal work)': tokens/s(N) / "
    "tokens/s(1), the same training-loop basis, independent of how many tokens each run did.",
    "tokens trained (epoch): all ranks' tokens in the reported epoch; work vs 1 device: that / the "
    "one-device run's (drop_last batches per rank: e.g. 13 steps x 4,096 = 53,248 tokens on 1 device, "
    "2 x 6 x 4,096 = 49,152 on 2).",
]


def compute_comm_table(result: GPTResult):
    """gpt_compute_vs_comm: measured compute and communication (hook and probe), and the derived method."""
    import pandas as pd


    base = {r.config["batch_size"]: r for r in result.ok if r.config["devices"] == 1}
    rows = []
    for r in result.ok:
        n = r.config["devices"]
        if n == 1:
            continue
        m = r.metrics
        one = base.get(r.config["batch_size"])
        d_comp, d_comm = (derived_comm(one.metrics["epoch_seconds"], m["epoch_seconds"], n) if one
                          else (None, None))
        comp, comm = m["compute_seconds"], m["communication_seconds"]
        rows.append({
            "per-device batch": r.config["batch_size"], "devices": n,
            "compute (s)": comp, "communication (s), exposed wait": comm,
            "comm / compute": comm / comp if comp else None,
            "all-reduce in flight (s)": m["allreduce_seconds"],
            "exposed by no_sync probe (s)": m["exposed_comm_seconds"],
            "probe noise ± (s)": _num(m.get("exposed_comm_noise_seconds")),
            "noise flag": noise_flag(m["exposed_comm_seconds"], _num(m.get("exposed_comm_noise_seconds"))),
            "overlap fraction": _num(m.get("overlap_fraction")), "buckets": m.get("buckets"),
            "derived compute T1/N (s)": d_comp, "derived comm TN - T1/N (s)": d_comm,
        })
    return _blanks(pd.DataFrame(rows))


def rank_table(result: GPTResult):
    """gpt_rank_breakdown: every rank's phases in the reported epoch, the slowest marked."""
    import pandas as pd

    rows = []
    for r in result.ok:
        m = r.metrics
        if r.config["devices"] == 1:
            continue
        for rk in m["ranks"]:
            rows.append({
                "per-device batch": r.config["batch_size"], "devices": r.config["devices"],
                "rank": rk["rank"],
                "slowest": "yes" if rk["rank"] == m["slowest_rank"] else "",
                "epoch (s)": rk["epoch_seconds"], "training (s)": rk["train_seconds"],
                "data loading (s)": rk["data_loading_seconds"],
                "data movement (s)": rk["data_movement_seconds"],
                "compute (s)": rk["compute_seconds"], "communication (s)": rk["communication_seconds"],
                "validation (s)": rk["validation_seconds"], "train loss": rk["train_loss_rank"],
                "tokens/s": rk["tokens_per_s"]})
        rows.append({"per-device batch": r.config["batch_size"], "devices": r.config["devices"],
                     "rank": "mean", "slowest": "", "epoch (s)": m["epoch_seconds_mean"],
                     "training (s)": m["train_seconds_mean"],
                     "data loading (s)": m["data_loading_seconds_mean"],
                     "data movement (s)": m["data_movement_seconds_mean"],
                     "compute (s)": m["compute_seconds_mean"],
                     "communication (s)": m["communication_seconds_mean"],
                     "validation (s)": m["validation_seconds_mean"], "train loss": m["train_loss"],
                     "tokens/s": None})
    return _blanks(pd.DataFrame(rows))


def _timer(m: dict, name: str) -> dict:
    for row in m.get("timers", []):
        if row["timer"] == name:
            return row
    return {"count": 0, "total_seconds": None, "mean_seconds": None}


def accumulation_table(result: GPTResult):
    """gpt_accumulation: nested timers, tokens/s and memory per micro-batch."""
    import pandas as pd

    rows = []
    for r in result.records:
        c = r.config
        row: dict[str, Any] = {"micro-batch": c["batch_size"], "accumulation steps": c["accumulation_steps"],
                               "devices": c["devices"], "status": r.status}
        if r.status == "ok":
            m = r.metrics
            tr = "run/epoch/training"
            row.update({
                "whole run (s)": _timer(m, "run")["total_seconds"],
                "epochs (s)": _timer(m, "run/epoch")["total_seconds"],
                "training (s)": _timer(m, tr)["total_seconds"],
                "validation (s)": _timer(m, "run/epoch/validation")["total_seconds"],
                "forward total (s)": _timer(m, f"{tr}/forward")["total_seconds"],
                "forward mean (ms)": _ms(_timer(m, f"{tr}/forward")["mean_seconds"]),
                "loss total (s)": _timer(m, f"{tr}/loss")["total_seconds"],
                "loss mean (ms)": _ms(_timer(m, f"{tr}/loss")["mean_seconds"]),
                "backward total (s)": _timer(m, f"{tr}/backward")["total_seconds"],
                "backward mean (ms)": _ms(_timer(m, f"{tr}/backward")["mean_seconds"]),
                f"tokens/s (epoch {m['reported_epoch']})": m["tokens_per_s"],
                "peak memory (GiB)": _gib(m.get("peak_memory_bytes")),
                "activations per micro-batch (MiB)": (m["saved_activation_bytes"] / 2**20
                                                      if m.get("saved_activation_bytes") else None),
                "val loss": m["val_loss"], "reason": None})
        else:
            row["reason"] = r.reason
        rows.append(row)
    return _blanks(pd.DataFrame(rows))


def _ms(s: float | None) -> float | None:
    return None if s is None else 1e3 * s


def _gib(b: int | None) -> float | None:
    return None if b is None else b / 2**30


def plot_accumulation(result: GPTResult):
    """Tokens/s and memory against micro-batch (log x), constant effective batch."""
    import matplotlib.pyplot as plt

    ok = result.ok
    xs = [r.config["batch_size"] for r in ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax1.plot(xs, [r.metrics["tokens_per_s"] for r in ok], "o-")
    ax1.set_ylabel("training tokens/s (reported epoch)")
    gpu = [r.metrics.get("peak_memory_bytes") for r in ok]
    if ok and all(g is not None for g in gpu):
        ax2.plot(xs, [g / 2**30 for g in gpu], "o-", color="tab:red", label="peak GPU memory")
    ax2.plot(xs, [(r.metrics.get("saved_activation_bytes") or 0) / 2**30 for r in ok], "s--",
             color="tab:purple", label="activations kept for backward (one micro-batch)")
    ax2.set_ylabel("GiB")
    ax2.legend(fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"micro-batch (x steps = {result.settings.effective_batch} sequences per device)")
        ax.grid(True, which="both", alpha=0.3)
        if xs:
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
        for r in result.records:
            if r.status == "oom":
                ax.axvline(r.config["batch_size"], color="tab:red", ls=":")
    fig.suptitle(f"Gradient accumulation at a constant effective batch ({result.settings.label})")
    fig.tight_layout()
    return fig


def save_scaling_tables(store: ResultStore, result: GPTResult):
    """Save gpt_scaling, gpt_compute_vs_comm and gpt_rank_breakdown (md + csv); return them."""
    recs = result.records
    ep = result.settings.scaling_epochs
    scaling = scaling_table(result)
    cpu = any(r.metrics.get("device_type") == "cpu" for r in result.ok)
    notes = [f"{result.settings.label}; epoch {ep} of {ep} reported (epoch 1 warms up); an epoch is one pass "
             "over the training windows shared among the devices (strong scaling of the epoch).",
             "Epoch time = the SLOWEST rank's training loop + validation; 'if averaged' divides by the mean "
             "over ranks instead, which flatters the speedup.",
             "speedup = T(1)/T(N); efficiency = speedup / N.", *SCALING_TIME_BASIS, earlier_report_note()]
    if cpu:
        threads = {r.metrics.get("threads_per_process") for r in result.ok}
        notes.append(f"No GPU: each 'device' is a CPU process with {', '.join(map(str, sorted(threads)))} "
                     "thread(s) (gloo between processes) on a shared machine; the numbers show the mechanics "
                     "of DDP, not GPU scaling.")
    store.save_table(scaling, "gpt_scaling", recs, title="GPT: DDP scaling at a fixed per-device batch",
                     notes=notes)
    comm = compute_comm_table(result)
    store.save_table(comm, "gpt_compute_vs_comm", result.ok, title="GPT: compute vs communication (measured)",
                     notes=["compute = forward + loss + backward + optimizer minus the exposed wait; "
                            "communication = the wait at the end of backward for all-reduces still running "
                            "(timing comm hook, lab_utils.core.comm_hooks), summed over the epoch, "
                            "slowest rank.",
                            "all-reduce in flight: time any bucket's all-reduce was running (mostly hidden "
                            "behind backward); no_sync probe: sync step minus no_sync step x steps, with "
                            "the standard error of that difference (x steps) as its noise.",
                            "noise flag 'noise >= effect: not a result': 2 x the probe noise >= the probe's "
                            "exposed time; then that time and the overlap fraction are not results (repeat "
                            "with more probe steps).",
                            "derived: the assignment's method, compute = T(1)/N and comm = T(N) - T(1)/N; "
                            "it calls every inefficiency communication and goes negative when "
                            "T(N) < T(1)/N."])
    ranks = rank_table(result)
    store.save_table(ranks, "gpt_rank_breakdown", result.ok,
                     title="GPT: per-rank breakdown of the reported epoch",
                     notes=["Every rank's phases (seconds); 'mean' is the average over ranks, which hides "
                            "the slowest rank that everyone waits for."])
    return scaling, comm, ranks


def save_accumulation_table(store: ResultStore, result: GPTResult):
    table = accumulation_table(result)
    s = result.settings
    notes = [f"{s.label}; effective batch {s.effective_batch} sequences per device = micro-batch x "
             "accumulation steps; gradients are all-reduced once per optimizer step (no_sync on the other "
             "micro-steps).",
             "Nested timers of rank 0 over the whole run (both epochs): run > epoch > training (forward, "
             "loss, backward per micro-step) and validation; means are per micro-step.",
             "Peak memory: torch.cuda.max_memory_allocated (GPU only); activations: bytes autograd keeps for "
             "backward for one micro-batch (measured with saved-tensor hooks, any device)."]
    store.save_table(table, "gpt_accumulation", result.records, title="GPT: gradient accumulation trade-off",
                     notes=notes)
    return table


def save_accumulation_figure(store: ResultStore, result: GPTResult):
    """Plot tokens/s and memory against micro-batch, save it as ``gpt_accumulation.png``; return it."""
    fig = plot_accumulation(result)
    store.save_figure(fig, "gpt_accumulation", result.records)
    return fig


def model_summary(lab: Any, settings: GPTSettings | None = None, **overrides: Any):
    """A small table: the model's shape, parameters (formula and counted) and FLOPs per token."""
    import pandas as pd


    profile, _ = _unpack(lab)
    s = resolve_settings(profile, settings, **overrides)
    splits = corpus_splits(lab, s)
    cfg = gpt_config(s.size, vocab_size=splits.vocab.size)
    model = GPT(cfg)
    return pd.DataFrame([{
        "size": s.size, "layers": cfg.n_layer, "heads": cfg.n_head, "width": cfg.n_embd,
        "context (tokens)": cfg.block_size, "vocabulary": cfg.vocab_size,
        "parameters (formula)": parameter_count(cfg), "parameters (counted)": count_parameters(model),
        "train FLOPs/token (6N+12LCT)": train_flops_per_token(cfg),
        "train FLOPs/token (FlopCounterMode)": measure_train_flops_per_token(model),
        "corpus": splits.corpus_name, "train tokens": splits.train_tokens, "val tokens": splits.val_tokens,
    }])


__all__ = ["GPT_SETTINGS", "GPTSettings", "run_scaling", "run_accumulation", "train_final",
           "samples_before_after", "save_samples", "save_scaling_tables", "save_accumulation_table",
           "save_accumulation_figure", "print_samples",
           "model_summary", "scaling_table", "compute_comm_table", "rank_table", "accumulation_table",
           "plot_accumulation"]
