"""Q4.1-Q7: large-batch training, what it costs in accuracy, and how to win it back.

Question map (notebook 05, :mod:`lab_utils.questions`): Q4.1 loss and accuracy after 5 epochs at
4 x 512 vs 1 x 128 (:func:`measure`; table ``large_batch``); Q4.2 why the large batch falls behind and
how to improve it (linear learning-rate scaling, warm-up, decay); Q5 ``DistributedSampler.set_epoch``
(:func:`sampler_epoch_orders`); Q6 what DDP communicates besides the gradients
(:func:`measure_comm_accounting`); Q7 whether, at 4 x 512, communicating only the gradients is
enough (from the same ledger). The tables and figures of Q4-Q5 are in
:mod:`lab_utils.experiments.large_batch_tables`, those of Q6-Q7 in
:mod:`lab_utils.experiments.accounting_tables`: this module measures.

The experiment (:func:`measure`) trains ResNet-18 for the same number of epochs
in several configurations, each a DDP run of :mod:`lab_utils.workers.ddp` under ``torchrun``
(through :func:`lab_utils.launcher.launch`), evaluated on the test split after every epoch:

1. **small batch (reference)**: ``small_batch`` on 1 device, lr 0.1 (the spec's recipe);
2. **large batch, same lr**: ``large_batch_per_device`` on each of ``devices`` devices
   (the assignment: 512 x 4 GPUs = 2048), lr 0.1;
3. **+ linear scaling**: peak lr = 0.1 x global batch / ``small_batch`` (Goyal et al. 2017);
4. **+ warm-up**: the same peak, reached by a linear ramp from 0.1 over the first
   ``warmup_epochs`` epochs (per optimizer step);
5. **+ decay**: warm-up, then cosine (or step) decay to the end of the run.

Every run has the same budget: the same epochs, i.e. the same number of images seen. A
large batch therefore takes *fewer optimizer steps* (global batch / small batch times
fewer): at a fixed lr the model moves less far and reaches a worse loss. The remedies
change only the learning-rate rule.

Where the machine has fewer devices than asked (fewer than 4 GPUs), the large runs keep
the asked global batch (``devices`` x ``large_batch_per_device``, 4 x 512 = 2048) by
**gradient accumulation**: d devices (the largest divisor of ``devices`` the machine
has) x k = ``devices`` / d accumulation steps of ``large_batch_per_device`` each (the DDP
worker's ``--accumulation-steps``: the first k - 1 micro-steps under ``no_sync()``, each
loss divided by k, so the gradient is the mean over the global batch). Every table and
figure says so (``devices``, ``accumulation steps`` and ``global batch`` columns, and a
note such as "4 x 512 emulated with 2 devices x 2 accumulation steps"). BatchNorm: each
micro-batch of 512 is normalized with its own statistics, as each GPU's 512 are in the
4-GPU run (DDP's BatchNorm is per GPU), so the gradients are those of 4 x 512; the
running statistics used for evaluation differ (k updates per step instead of one). On a
CPU the ranks are gloo processes, at most ``cpu_processes`` of them, with accumulation for
the rest.

Records go to the store under ``large_batch`` (the worker's schema: one aggregate record
per run, plus one per rank; see :mod:`lab_utils.workers.ddp`). A run already stored with status
``ok`` is not trained again unless ``force=True``.

Also here: the ``set_epoch`` demonstration (:func:`sampler_epoch_orders`) and the
communication accounting of :mod:`lab_utils.workers.comm_accounting` (:func:`measure_comm_accounting`):
what DDP communicates besides gradients, in bytes.
Times are seconds; bytes are bytes; accuracy is a fraction in records and a percentage
in tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lab_utils import launcher
from lab_utils.core import profiles
from lab_utils.core.config import check_positive_int
from lab_utils.core.dist import choose_backend
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import gpu_count, hardware_summary
from lab_utils.core.schedules import DECAYS, scaled_lr
from lab_utils.session import session_for
from lab_utils.store import Record, ResultStore
from lab_utils.workers.args import AccountingArgs, WorkerArgs

__all__ = ["COMM_EXPERIMENT", "EXPERIMENT", "SPEC_LR", "DevicePlan", "RunSpec", "Settings", "measure",
           "measure_comm_accounting", "plan_devices", "plan_runs", "run_of", "sampler_epoch_orders",
           "worker_args"]

EXPERIMENT = "large_batch"
COMM_EXPERIMENT = "comm_accounting"
SPEC_LR = 0.1


@dataclass(frozen=True)
class Settings:
    """Knobs of the large-batch experiment for one profile.

    ``train_images`` / ``test_images`` of ``None`` mean the profile's (``full``: all).
    ``devices`` is how many devices the large runs want (global batch = ``devices`` x
    ``large_batch_per_device`` in every profile); fewer GPUs (or, without GPUs, more than
    ``cpu_processes``) -> fewer devices x gradient accumulation steps, same global batch
    (labelled). ``warmup_epochs`` may be fractional. ``decay`` is the last remedy's
    schedule after warm-up (``cosine`` or ``step``).
    """

    epochs: int = 5
    small_batch: int = 128
    large_batch_per_device: int = 512
    devices: int = 4
    width: int = 64
    train_images: int | None = None
    test_images: int | None = None
    warmup_epochs: float = 2.0
    decay: str = "cosine"
    lr: float = SPEC_LR
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto
    num_workers: int | None = None
    seed: int = 0
    timeout_s: float = 3600.0
    threads_per_rank: int | None = 1  # CPU (gloo) runs only: one core per rank, the CPU's "device"
    cpu_processes: int = 2  # without GPUs: at most this many gloo processes, accumulation for the rest
    label: str = ""
    # communication accounting (a few DDP steps; bytes do not depend on batch or data)
    comm_width: int = 64
    comm_batch: int = 8
    comm_steps: int = 3
    comm_timeout_s: float = 900.0

    def validate(self) -> Settings:
        return _check(self)


def _check(s: Settings) -> Settings:
    """Reject settings that cannot run, with one sentence naming the fix."""
    for what, v in (("epochs", s.epochs), ("small batch", s.small_batch),
                    ("large batch per device", s.large_batch_per_device), ("devices", s.devices),
                    ("model width", s.width), ("comm width", s.comm_width), ("comm batch", s.comm_batch),
                    ("comm steps", s.comm_steps), ("CPU processes", s.cpu_processes)):
        check_positive_int(v, what)
    for what, v in (("train images", s.train_images), ("test images", s.test_images)):
        if v is not None:
            check_positive_int(v, what)
    if s.decay not in DECAYS or s.decay == "constant":
        raise LabError(f"The last remedy's decay must be 'cosine' or 'step', got {s.decay!r}.")
    if not 0 <= s.warmup_epochs <= s.epochs:
        raise LabError(f"warmup_epochs must be between 0 and epochs ({s.epochs}), got {s.warmup_epochs}.")
    if not s.lr > 0:
        raise LabError(f"lr must be positive, got {s.lr}.")
    if s.large_batch_per_device * s.devices <= s.small_batch:
        raise LabError(f"The large global batch ({s.large_batch_per_device} x {s.devices}) must exceed the "
                       f"small batch ({s.small_batch}); raise large_batch_per_device or devices.")
    if s.train_images is not None and s.train_images < s.large_batch_per_device * s.devices:
        raise LabError(f"train_images ({s.train_images}) is less than one large global batch "
                       f"({s.large_batch_per_device * s.devices}); use more images or a smaller batch.")
    return s


profiles.register(Settings, profiles.LARGE_BATCH, "large-batch")


# --------------------------------------------------------------------------- the runs


@dataclass(frozen=True)
class RunSpec:
    """One training configuration of the experiment."""

    name: str
    devices: int
    batch_per_device: int
    lr_rule: str          # "fixed" | "linear"
    warmup_epochs: float
    decay: str            # "constant" | "cosine" | "step"
    accumulation_steps: int = 1  # micro-steps per optimizer step (no_sync on all but the last)

    @property
    def global_batch(self) -> int:
        return self.devices * self.batch_per_device * self.accumulation_steps

    @property
    def shape_text(self) -> str:
        """``2x512`` or, with accumulation, ``2x512 x 2 acc``."""
        acc = f" x {self.accumulation_steps} acc" if self.accumulation_steps > 1 else ""
        return f"{self.devices}x{self.batch_per_device}{acc}"

    def rule_text(self, base_lr: float, base_batch: int) -> str:
        """The learning-rate rule in words, e.g. ``linear 0.1 x 2048/128, warm-up 2 ep, cosine``."""
        if self.lr_rule == "fixed":
            parts = [f"fixed {base_lr:g}"]
        else:
            parts = [f"linear {base_lr:g} x {self.global_batch}/{base_batch}"]
        if self.warmup_epochs:
            parts.append(f"warm-up {self.warmup_epochs:g} ep from {base_lr:g}")
        if self.decay != "constant":
            parts.append(f"{self.decay} decay")
        return ", ".join(parts)

    def peak_lr(self, base_lr: float, base_batch: int) -> float:
        return base_lr if self.lr_rule == "fixed" else scaled_lr(base_lr, self.global_batch, base_batch)


@dataclass(frozen=True)
class DevicePlan:
    """How many ranks the large runs use here, on what, with how many accumulation steps,
    and a note when it is not the ask."""

    large_devices: int
    backend: str          # "nccl" | "gloo"
    device_kind: str      # "GPU" | "gloo CPU process"
    note: str | None
    accumulation_steps: int = 1  # large_devices x accumulation_steps = settings.devices


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


def plan_devices(settings: Settings, gpus: int | None = None) -> DevicePlan:
    """Ranks for the large runs: the settings' count, or fewer ranks x accumulation steps.

    With d < ``devices`` usable ranks (GPUs, or ``cpu_processes`` gloo processes without
    GPUs) the runs use the largest divisor d' of ``devices`` with d' <= d, and
    ``devices`` / d' accumulation steps: the same global batch (e.g. 3 GPUs: 2 x 2 steps).
    """
    if gpus is None:
        gpus = gpu_count()
    want, b = settings.devices, settings.large_batch_per_device
    if gpus >= 1:
        use, backend, kind, word = _largest_divisor(want, gpus), "nccl", "GPU", "device"
        notes = [f"this machine has {gpus} GPU(s)"] if gpus < want else []
    else:
        use = _largest_divisor(want, settings.cpu_processes)
        backend, kind, word = "gloo", "gloo CPU process", "process"
        notes = [f"no GPU: every rank is a gloo process on the CPU ({use} for the large runs, "
                 f"1 for the reference)"]
    accum = want // use
    if accum > 1:
        notes.append(_accumulation_text(want, b, use, accum, word))
    return DevicePlan(use, backend, kind, "; ".join(notes) or None, accum)


def _accumulation_text(want: int, batch: int, devices: int, accum: int, word: str = "device") -> str:
    """E.g. ``4 x 512 emulated with 2 devices x 2 accumulation steps (global batch 2048; ...)``."""
    plural = (word + ("es" if word.endswith("s") else "s")) if devices > 1 else word
    return (f"{want} x {batch} emulated with {devices} {plural} x {accum} "
            f"accumulation steps (global batch {want * batch}; BatchNorm normalizes each micro-batch of "
            f"{batch} on its own, as each of {want} devices would, but its running statistics get {accum} "
            "updates per step)")


def plan_runs(settings: Settings, large_devices: int,
              accumulation_steps: int = 1) -> list[RunSpec]:
    """The reference, the large batch at the same lr, and the three remedies (same epochs)."""
    b = settings.large_batch_per_device
    w = settings.warmup_epochs
    k = accumulation_steps
    return [
        RunSpec("small batch (reference)", 1, settings.small_batch, "fixed", 0.0, "constant"),
        RunSpec("large batch, same lr", large_devices, b, "fixed", 0.0, "constant", k),
        RunSpec("+ linear lr scaling", large_devices, b, "linear", 0.0, "constant", k),
        RunSpec("+ warm-up", large_devices, b, "linear", w, "constant", k),
        RunSpec(f"+ warm-up + {settings.decay} decay", large_devices, b, "linear", w, settings.decay, k),
    ]


def worker_args(settings: Settings, run: RunSpec, profile: str) -> WorkerArgs:
    """The :class:`lab_utils.workers.args.WorkerArgs` of one run (before ``resolved()``)."""
    return WorkerArgs(
        experiment=EXPERIMENT, profile=profile, batch_size=run.batch_per_device, epochs=settings.epochs,
        width=settings.width, train_images=settings.train_images, test_images=settings.test_images,
        dataset=settings.dataset, num_workers=settings.num_workers, lr=settings.lr, lr_rule=run.lr_rule,
        base_batch=settings.small_batch, warmup_epochs=run.warmup_epochs, decay=run.decay, eval=True,
        accumulation_steps=run.accumulation_steps, seed=settings.seed, tag=run.name).validate()


def run_of(rec: Record) -> RunSpec:
    """The :class:`RunSpec` a ``large_batch`` record was trained with, read back from its config
    (the run's name is the worker's ``tag``): what the tables need of a run besides its record."""
    c = rec.config
    return RunSpec(c.get("tag") or "", int(c["devices"]), int(c["batch_size"]), c.get("lr_rule") or "fixed",
                   float(c.get("warmup_epochs") or 0.0), c.get("decay") or "constant",
                   int(c.get("accumulation_steps", 1)))


def measure(lab: Any, settings: Settings, force: bool = False, verbose: bool = True) -> list[Record]:
    """Train every configuration of :func:`plan_runs` (unless stored); one aggregate record per run,
    in :func:`plan_runs` order.

    ``lab``: the notebook's :class:`~lab_utils.session.LabSession` (profile, store, GPU count).
    Each run goes through the store's one door (:meth:`~lab_utils.store.ResultStore.run_many`),
    which writes the records the DDP worker hands back (:func:`lab_utils.launcher.stream`) into
    ``lab.store``, whatever folder it was built on. A failed run (a dead rank, a timeout) is an
    ``error`` record with the reason and the other runs go on; it is tried again next time.
    """
    lab = session_for(lab)
    store: ResultStore = lab.store
    profile = lab.profile.name
    s = settings.validate()
    plan = plan_devices(s, int(lab.gpu_count))
    records: list[Record] = []
    for run in plan_runs(s, plan.large_devices, plan.accumulation_steps):
        args = worker_args(s, run, profile).resolved()
        backend = choose_backend("auto", run.devices)
        cfg = args.record_config(run.devices, backend)
        measured = []

        def launch(todo, run=run, args=args, backend=backend, cfg=cfg, measured=measured):
            if verbose:
                print(f"{run.name}: training {run.shape_text} on {backend} ...", flush=True)
            measured.append(run.name)
            threads = s.threads_per_rank if backend == "gloo" else None
            try:
                yield from launcher.stream("lab_utils.workers.ddp", args.to_argv(), nproc=run.devices,
                                           timeout_s=s.timeout_s, threads_per_rank=threads)
            except LaunchError as e:  # the run is a row that says why; the next call tries it again
                yield Record(EXPERIMENT, cfg, status="error", reason=str(e).splitlines()[0][:300],
                             synthetic=args.dataset == "synthetic", dataset=args.dataset)

        # the store's one door: reused when stored on these devices (same GPUs only), else measured
        hw = _hardware(backend, run.devices)
        rec = store.run_many(EXPERIMENT, [cfg], launch, force=force, hardware=hw)[0]
        if rec is None:
            rec = Record(EXPERIMENT, cfg, status="error", profile=profile,
                         reason=f"the run of {run.name} finished but returned no record")
        records.append(rec)
        if verbose:
            text = _summary(rec) if measured else f"from the store ({_summary(rec)})"
            print(f"{run.name}: {text}", flush=True)
    return records


def _hardware(backend: str, devices: int) -> dict[str, Any]:
    """What a run on ``devices`` ranks of ``backend`` records as its hardware (GPUs for NCCL,
    else CPU processes): the store reuses a record only when it matches."""
    return hardware_summary("cuda" if backend == "nccl" else "cpu", devices)


def _summary(rec: Record) -> str:
    if rec.status != "ok":
        return f"{rec.status}: {rec.reason}"
    m = rec.metrics
    return (f"epoch {m.get('reported_epoch')}: train loss {m.get('train_loss', math.nan):.3f}, "
            f"test accuracy {100 * m.get('test_accuracy', math.nan):.1f}%")


# --------------------------------------------------------------------------- set_epoch


def sampler_epoch_orders(dataset_size: int = 16, num_replicas: int = 2, rank: int = 0, epochs: int = 2,
                         call_set_epoch: bool = True, seed: int = 0) -> list[list[int]]:
    """The indices ``DistributedSampler`` gives ``rank`` in each of ``epochs`` epochs.

    Exactly what a training loop does: one sampler, iterated once per epoch, with
    ``sampler.set_epoch(epoch)`` before each pass when ``call_set_epoch``. The sampler
    shuffles with a generator seeded by ``seed + epoch``; without ``set_epoch`` the
    epoch stays 0 and every epoch repeats the first one's order.
    """
    from torch.utils.data.distributed import DistributedSampler

    check_positive_int(dataset_size, "dataset size")
    check_positive_int(num_replicas, "number of replicas")
    check_positive_int(epochs, "epochs")
    if not 0 <= rank < num_replicas:
        raise LabError(f"rank must be in 0..{num_replicas - 1}, got {rank}.")
    sampler = DistributedSampler(range(dataset_size), num_replicas=num_replicas, rank=rank, shuffle=True,
                                 seed=seed)
    orders = []
    for epoch in range(epochs):
        if call_set_epoch:
            sampler.set_epoch(epoch)
        orders.append([int(i) for i in sampler])
    return orders


# --------------------------------------------------------------------------- communication accounting


def _comm_plan(settings: Settings, gpus: int) -> tuple[int, str]:
    """Ranks and backend of the accounting run: NCCL on 2+ GPUs (up to ``devices``), else 2 gloo processes."""
    if gpus >= 2:
        return min(settings.devices, gpus), "nccl"
    return 2, "gloo"


def measure_comm_accounting(lab: Any, settings: Settings, force: bool = False, broadcast_buffers: bool = True,
                            zero: bool = True, verbose: bool = True) -> list[Record]:
    """Run :mod:`lab_utils.workers.comm_accounting` (a few DDP steps) unless stored: its one record
    (experiment ``comm_accounting``), in a list. Tables: :mod:`lab_utils.experiments.accounting_tables`."""
    lab = session_for(lab)
    store: ResultStore = lab.store
    s = settings.validate()
    nproc, backend = _comm_plan(s, int(lab.gpu_count))
    args = AccountingArgs(width=s.comm_width, batch_size=s.comm_batch, steps=s.comm_steps,
                          broadcast_buffers=broadcast_buffers, zero=zero, backend=backend,
                          profile=lab.profile.name, experiment=COMM_EXPERIMENT, seed=s.seed).validate()
    cfg = args.record_config(nproc, backend)

    def launch(todo):
        if verbose:
            print(f"communication accounting: {nproc} x {backend}, width {s.comm_width}, "
                  f"{s.comm_steps} steps ...", flush=True)
        yield from launcher.stream("lab_utils.workers.comm_accounting", args.to_argv(), nproc=nproc,
                                   timeout_s=s.comm_timeout_s)

    rec = store.run_many(COMM_EXPERIMENT, [cfg], launch, force=force, hardware=_hardware(backend, nproc))[0]
    if rec is None:
        raise LaunchError(f"The accounting run finished but returned no record for {COMM_EXPERIMENT}.")
    return [rec]
