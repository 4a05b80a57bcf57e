"""Notebook 06's experiments: GPT scaling over devices, gradient accumulation, the final model.

This is the SPEC's *Part 2: an earlier project* (a GPT trained with DDP), not a question of
the assignment (whose questions Q1-Q7 are notebooks 01-05).

Every run goes through :mod:`lab_utils.workers.gpt_train` (``torchrun`` through
:func:`lab_utils.launcher.launch`; on GPUs for one device too, so that the kernel opens no CUDA
context; without a GPU one process runs in the notebook's kernel) and becomes one record in the
result store:

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

Knobs per profile: :class:`Settings` (values in :data:`lab_utils.core.profiles.GPT`). This module
measures; the tables and the figure are in :mod:`lab_utils.experiments.gpt_tables`, the model
summary and the text samples in :mod:`lab_utils.experiments.gpt_samples`.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from lab_utils import launcher
from lab_utils.core import profiles
from lab_utils.core.backends import pinned_threads
from lab_utils.core.config import check_batch_sizes, check_positive_int
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import cpu_cores, hardware_summary
from lab_utils.core.memory import catch_oom, free_device_memory, mentions_out_of_memory, oom_reason_from_log
from lab_utils.core.text_data import resolve_corpus
from lab_utils.models.gpt import checkpoint_path, gpt_config
from lab_utils.session import session_for
from lab_utils.store import Record, ResultStore
from lab_utils.workers.args import TrainConfig
from lab_utils.workers.gpt_train import run_training

__all__ = ["ACCUMULATION", "METRICS_VERSION", "SCALING", "TRAIN", "Devices", "Settings", "available_devices",
           "measure", "measure_accumulation", "measure_final"]

SCALING = "gpt_scaling"
ACCUMULATION = "gpt_accumulation"
TRAIN = "gpt_train"


@dataclass(frozen=True)
class Settings:
    """Notebook 06's knobs for one profile. Batch sizes are sequences per device."""

    size: str
    dtype: str
    lr: float
    corpus: str | None = None   # shakespeare | stdlib | auto; None: $LAB_CORPUS, else auto
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

    def validate(self) -> Settings:
        """Reject settings that cannot run, with one sentence naming the fix."""
        check_batch_sizes(self.scaling_batch_sizes, "scaling batch sizes")
        check_batch_sizes(self.scaling_devices, "scaling device counts")
        check_batch_sizes(self.micro_batches, "micro-batches")
        check_positive_int(self.effective_batch, "effective batch")
        bad = [m for m in self.micro_batches if self.effective_batch % m]
        if bad:
            raise LabError(f"Micro-batches {bad} do not divide the effective batch {self.effective_batch}; "
                           "use divisors of it (e.g. powers of two).")
        gpt_config(self.size)  # an unknown size: one sentence naming the sizes
        TrainConfig(size=self.size, dtype=self.dtype, lr=self.lr, corpus=self.corpus,
                    max_chars=self.max_chars, stride=self.stride, batch_size=self.train_batch_size,
                    epochs=self.train_epochs, max_steps=self.train_max_steps).validate()
        return self


profiles.register(Settings, profiles.GPT, "GPT")


def _train_config(s: Settings, **kw: Any) -> TrainConfig:
    # the corpus resolved here ($LAB_CORPUS read, a missing one refused) so that a stored run is
    # reused only for the corpus it was trained on
    base = {"size": s.size, "dtype": s.dtype, "lr": s.lr, "corpus": resolve_corpus(s.corpus),
            "max_chars": s.max_chars,
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


def available_devices(settings: Settings) -> Devices:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus:
        return Devices("cuda", gpus, gpus)
    procs = max(1, min(settings.cpu_processes, cpu_cores()))
    return Devices("cpu", procs, 0, threads_per_process=max(1, cpu_cores() // procs))


def _execute(cfg: TrainConfig, nproc: int, devices: Devices, log_dir,
            timeout_s: float) -> tuple[Record, float]:
    """Run ``cfg`` on ``nproc`` ranks; returns the worker's record and the wall seconds.

    On GPUs every run, the one-device run too, is a launch of the worker under ``torchrun``
    (:func:`lab_utils.launcher.launch`): this process (the notebook's kernel) never opens a CUDA
    context, which on a node in EXCLUSIVE_PROCESS compute mode would keep rank 0 from creating
    its own and elsewhere takes memory from GPU 0, and T(1) and T(N) go through the same code.
    Without a GPU, one rank runs in this process (no start-up; the same code path without DDP)
    and more go through ``torchrun``; every process, the in-process one included, gets the same
    number of threads (cores / the most processes used), so a "device" is the same compute
    whatever the device count. Wall seconds include start-up for launched runs.
    """
    threads = None
    if devices.kind == "cpu":
        cfg = replace(cfg, device="cpu")
        threads = devices.threads_per_process
    t0 = time.perf_counter()
    if devices.kind == "cuda" or nproc > 1:
        res = launcher.launch("lab_utils.workers.gpt_train", cfg.to_argv(), nproc=nproc, timeout_s=timeout_s,
                              log_dir=log_dir, threads_per_rank=threads)
        return res.records[-1], res.wall_seconds
    with pinned_threads(threads):
        records = run_training(cfg)
    free_device_memory()  # not in the finally: after a failure, _measure frees once the traceback is gone
    return records[-1], time.perf_counter() - t0


def _measure(experiment: str, cfg_key: dict, cfg: TrainConfig, nproc: int, devices: Devices,
             store: ResultStore, settings: Settings) -> Record:
    log_dir = store.root / "logs" / f"{experiment}_{nproc}x{cfg.batch_size}x{cfg.accumulation_steps}"
    # Out of memory outside the worker's training loop (building the model, counting its
    # FLOPs) in this process: a row, and the memory is freed after the with statement.
    # Under DDP a rank that runs out of memory ends itself (core.dist.failure_ends_rank) and the
    # launch fails with that rank's log: a LaunchError that says out of memory is a row too,
    # as in scaling._run_ddp; any other failure propagates.
    launch_oom: str | None = None
    with catch_oom() as oom:
        try:
            rec, wall = _execute(cfg, nproc, devices, log_dir, settings.timeout_s)
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


def _say(rec: Record, what: str) -> None:
    if rec.status != "ok":
        print(f"{what}: {rec.status} ({rec.reason})")
        return
    m = rec.metrics
    print(f"{what}: epoch {m['reported_epoch']} {m['epoch_seconds']:.2f} s "
          f"(slowest rank {m['slowest_rank']}), {m['tokens_per_s']:.0f} tokens/s, "
          f"val loss {m['val_loss']:.3f}")


def measure(lab: Any, settings: Settings, force: bool = False, verbose: bool = True) -> list[Record]:
    """Per-device batch x device count: one record each in ``gpt_scaling`` (resumable), in the
    order batch size, then device count. ``lab``: the notebook's session (profile, store)."""
    lab = session_for(lab)
    profile, store = lab.profile.name, lab.store
    s = settings.validate()
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
    return out


def measure_accumulation(lab: Any, settings: Settings, force: bool = False,
                         verbose: bool = True) -> list[Record]:
    """Constant effective batch, micro-batch x accumulation steps (``gpt_accumulation``), one record
    per micro-batch; after the first OOM the larger micro-batches are ``skipped`` rows."""
    lab = session_for(lab)
    profile, store = lab.profile.name, lab.store
    s = settings.validate()
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
    return out


def measure_final(lab: Any, settings: Settings, force: bool = False, verbose: bool = True) -> list[Record]:
    """Train the model notebook 07 uses, on every available device, and save the checkpoint
    (``gpt_train``): its one record, in a list. Trained again when the checkpoint is missing."""
    lab = session_for(lab)
    profile, store = lab.profile.name, lab.store
    s = settings.validate()
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
    return [rec]


# --------------------------------------------------------------------------- text samples


# --------------------------------------------------------------------------- tables
