"""Q4.1-Q7: large-batch training, what it costs in accuracy, and how to win it back.

Question map (notebook 05, :mod:`lab_utils.questions`): Q4.1 loss and accuracy after 5 epochs at
4 x 512 vs 1 x 128 (:func:`large_batch_table`); Q4.2 why the large batch falls behind and how to
improve it (linear learning-rate scaling, warm-up, decay); Q5 ``DistributedSampler.set_epoch``
(:func:`set_epoch_table`); Q6 what DDP communicates besides the gradients
(:func:`run_comm_accounting`, :func:`comm_table`); Q7 whether, at 4 x 512, communicating only the
gradients is enough (:func:`gradients_only_table`, from the same ledger).

The experiment (:func:`run_large_batch`) trains ResNet-18 for the same number of epochs
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
communication accounting of :mod:`lab_utils.workers.comm_accounting` (:func:`run_comm_accounting`,
:func:`comm_table`, :func:`wire_table`): what DDP communicates besides gradients, in bytes.
Times are seconds; bytes are bytes; accuracy is a fraction in records and a percentage
in tables.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from lab_utils import launcher
from lab_utils.core import config, profiles
from lab_utils.core.config import check_positive_int
from lab_utils.core.data import CIFAR10_TRAIN_SIZE
from lab_utils.core.dist import choose_backend
from lab_utils.core.errors import LabError, LaunchError
from lab_utils.core.hardware import gpu_count, hardware_summary
from lab_utils.core.schedules import DECAYS, LRSchedule, make_schedule, scaled_lr
from lab_utils.models import ResNet18
from lab_utils.store import Record, ResultStore
from lab_utils.workers import comm_accounting as ca
from lab_utils.workers.args import AccountingArgs, WorkerArgs

EXPERIMENT = "large_batch"
COMM_EXPERIMENT = "comm_accounting"
SPEC_LR = 0.1

# Earlier cohort's numbers (SPEC.md), for the notes: hardware unknown, real CIFAR-10. Their
# accuracies (and losses) are TRAINING figures printed during training, not test accuracy.
ANCHORS = ("earlier cohort (V100/RTX8000 class, real CIFAR-10), TRAINING loss and accuracy printed during "
           "training (no test accuracy reported): 128 x 1 GPU: loss 0.514, train accuracy 82.2%; "
           "512 x 4 GPUs, lr 0.1: loss 1.016, train accuracy 63.4% after 5 epochs")
ANCHOR_ROWS = (
    {"configuration": "earlier cohort: small batch (reference)", "devices": "1 x GPU",
     "batch per device": 128, "global batch": 128, "loss (printed during training)": 0.514,
     "train accuracy %": 82.2},
    {"configuration": "earlier cohort: large batch, same lr", "devices": "4 x GPU",
     "batch per device": 512, "global batch": 2048, "loss (printed during training)": 1.016,
     "train accuracy %": 63.4},
)
# The assignment's layouts: the reference 128 on 1 GPU, the large runs 512 per GPU on 4 GPUs.
ASKED_SMALL = (1, 128)
ASKED_LARGE = (4, 512)


@dataclass(frozen=True)
class LargeBatchSettings:
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
    dataset: str = "auto"
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


# Per-profile values: lab_utils.core.profiles (one table for every notebook).
LARGE_BATCH_SETTINGS: dict[str, LargeBatchSettings] = profiles.table(LargeBatchSettings)


def resolve_settings(profile: str, settings: LargeBatchSettings | None = None,
                     **overrides: Any) -> LargeBatchSettings:
    """The profile's settings with the non-``None`` overrides applied, checked."""
    s = profiles.override(settings or LARGE_BATCH_SETTINGS[profile], "large-batch", **overrides)
    check_settings(s)
    return s


def check_settings(s: LargeBatchSettings) -> None:
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


def plan_devices(settings: LargeBatchSettings, gpus: int | None = None) -> DevicePlan:
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
        notes.append(accumulation_text(want, b, use, accum, word))
    return DevicePlan(use, backend, kind, "; ".join(notes) or None, accum)


def accumulation_text(want: int, batch: int, devices: int, accum: int, word: str = "device") -> str:
    """E.g. ``4 x 512 emulated with 2 devices x 2 accumulation steps (global batch 2048; ...)``."""
    plural = (word + ("es" if word.endswith("s") else "s")) if devices > 1 else word
    return (f"{want} x {batch} emulated with {devices} {plural} x {accum} "
            f"accumulation steps (global batch {want * batch}; BatchNorm normalizes each micro-batch of "
            f"{batch} on its own, as each of {want} devices would, but its running statistics get {accum} "
            "updates per step)")


def plan_runs(settings: LargeBatchSettings, large_devices: int,
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


def worker_args(settings: LargeBatchSettings, run: RunSpec, profile: str) -> WorkerArgs:
    """The :class:`lab_utils.workers.args.WorkerArgs` of one run (before ``resolved()``)."""
    return WorkerArgs(
        experiment=EXPERIMENT, profile=profile, batch_size=run.batch_per_device, epochs=settings.epochs,
        width=settings.width, train_images=settings.train_images, test_images=settings.test_images,
        dataset=settings.dataset, num_workers=settings.num_workers, lr=settings.lr, lr_rule=run.lr_rule,
        base_batch=settings.small_batch, warmup_epochs=run.warmup_epochs, decay=run.decay, eval=True,
        accumulation_steps=run.accumulation_steps, seed=settings.seed, tag=run.name).validate()


@dataclass
class LargeBatchResult:
    """One aggregate record per run (in :func:`plan_runs` order), the plan, and what was measured now."""

    records: list[Record]
    runs: list[RunSpec]
    settings: LargeBatchSettings
    plan: DevicePlan
    profile: str
    measured: list[str]

    @property
    def ok(self) -> list[tuple[RunSpec, Record]]:
        return [(s, r) for s, r in zip(self.runs, self.records) if r.status == "ok"]


def _store_of(lab_or_profile: Any) -> tuple[str, ResultStore]:
    if lab_or_profile is None or isinstance(lab_or_profile, str):
        name = config.resolve_profile_name(lab_or_profile)[0]
        return name, ResultStore(name)
    return lab_or_profile.profile.name, lab_or_profile.store


def run_large_batch(lab_or_profile: Any = None, settings: LargeBatchSettings | None = None, *,
                    force: bool = False, gpus: int | None = None, verbose: bool = True,
                    **overrides: Any) -> LargeBatchResult:
    """Train every configuration of :func:`plan_runs` (unless stored) and return their records.

    ``lab_or_profile``: a :class:`lab_utils.session.LabSession`, a profile name or None.
    ``overrides``: fields of :class:`LargeBatchSettings` (None keeps the profile's value).
    A failed run (a dead rank, a timeout) is stored as an ``error`` record with the reason
    and the other runs go on; it is tried again next time.
    """
    profile, store = _store_of(lab_or_profile)
    s = resolve_settings(profile, settings, **overrides)
    plan = plan_devices(s, gpus)
    runs = plan_runs(s, plan.large_devices, plan.accumulation_steps)
    records: list[Record] = []
    measured: list[str] = []
    for run in runs:
        args = worker_args(s, run, profile).resolved()
        backend = choose_backend("auto", run.devices)
        cfg = args.record_config(run.devices, backend)

        def measure(todo, run=run, args=args, backend=backend, cfg=cfg):
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
        rec = store.run_many(EXPERIMENT, [cfg], measure, force=force, hardware=hw)[0]
        if rec is None:
            rec = Record(EXPERIMENT, cfg, status="error", profile=profile,
                         reason=f"the run of {run.name} finished but returned no record")
        records.append(rec)
        if verbose:
            text = _summary(rec) if run.name in measured else f"from the store ({_summary(rec)})"
            print(f"{run.name}: {text}", flush=True)
    return LargeBatchResult(records, runs, s, plan, profile, measured)


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


# --------------------------------------------------------------------------- tables and figures


def history(rec: Record) -> list[dict[str, Any]]:
    """The per-epoch history of an aggregate record (empty for a failed run)."""
    return list(rec.metrics.get("epochs") or [])


def mean_epoch_seconds(rec: Record) -> float | None:
    """Mean epoch wall time (slowest rank, seconds) over epochs 2..E (epoch 1 includes warm-up)."""
    eps = history(rec)
    later = eps[1:] if len(eps) > 1 else eps
    vals = [e["epoch_seconds"] for e in later if e.get("epoch_seconds") is not None]
    return statistics.fmean(vals) if vals else None


def large_batch_table(result: LargeBatchResult):
    """The ``large_batch`` table: one row per run (failed runs say why)."""
    import pandas as pd

    s = result.settings
    rows = []
    for run, rec in zip(result.runs, result.records):
        m = rec.metrics
        row: dict[str, Any] = {
            "configuration": run.name,
            "devices": f"{run.devices} x {'GPU' if rec.config.get('backend') == 'nccl' else 'CPU process'}",
            "batch per device": run.batch_per_device,
            "global batch": run.global_batch,
            "accumulation steps": run.accumulation_steps,
            "lr rule": run.rule_text(s.lr, s.small_batch),
            "peak lr": run.peak_lr(s.lr, s.small_batch),
        }
        if rec.status == "ok":
            steps = m.get("steps_per_epoch")
            row.update({
                "optimizer steps": steps * s.epochs if steps else None,
                f"epoch-{s.epochs} train loss": m.get("train_loss"),
                f"epoch-{s.epochs} test loss": m.get("test_loss"),
                f"epoch-{s.epochs} test accuracy %": (100 * m["test_accuracy"]
                                                      if "test_accuracy" in m else None),
                f"epoch-{s.epochs} train accuracy %": (100 * m["train_accuracy"]
                                                       if m.get("train_accuracy") is not None else None),
                "epoch time s": mean_epoch_seconds(rec),
                "wall time s": history(rec)[-1].get("elapsed_seconds") if history(rec) else None,
                "status": "ok",
            })
        else:
            row["status"] = f"{rec.status}: {rec.reason}"
        on_gpus = rec.config.get("backend", result.plan.backend) == "nccl"
        row["vs assignment"] = layout_flag(run, on_gpus) or "as asked"
        rows.append(row)
    return pd.DataFrame(rows)


def layout_flag(run: RunSpec, on_gpus: bool, asked: tuple[int, int] | None = None) -> str:
    """How a run's layout differs from the assignment's (4 GPUs x 512, or 1 GPU x 128 for the
    reference): "" when it is the asked one, else every difference, so that no number from
    another global batch or an accumulation emulation passes for the assignment's."""
    want_n, want_b = asked or (ASKED_SMALL if run.name.startswith("small batch") else ASKED_LARGE)
    diffs = []
    if run.global_batch != want_n * want_b:
        diffs.append(f"global batch {run.global_batch}, not {want_n * want_b}")
    if run.batch_per_device != want_b:
        diffs.append(f"{run.batch_per_device} per device, not {want_b}")
    if run.accumulation_steps > 1:
        diffs.append(f"{run.devices} device(s) x {run.accumulation_steps} accumulation steps EMULATE "
                     f"{run.devices * run.accumulation_steps} devices")
    elif run.devices != want_n:
        diffs.append(f"{run.devices} device(s), not {want_n}")
    if not on_gpus:
        diffs.append("CPU processes, not GPUs")
    return ("NOT " + f"{want_n} x {want_b}: " + "; ".join(diffs)) if diffs else ""


def anchor_frame():
    """The earlier cohort's Q4.1 numbers as reported: training loss and TRAINING accuracy printed
    during training (no test accuracy), so they compare with this table's train columns."""
    import pandas as pd

    return pd.DataFrame([{**r, "test accuracy %": None,
                          "which accuracy": "train (printed during training); no test accuracy reported"}
                         for r in ANCHOR_ROWS])


def table_notes(result: LargeBatchResult) -> list[str]:
    s = result.settings
    notes = [f"{s.label}." if s.label else f"profile {result.profile}.",
             f"Every run: {s.epochs} epochs (the same images seen), SGD momentum 0.9, weight decay 5e-4; "
             f"test loss/accuracy after epoch {s.epochs} on the test split; train loss and train "
             f"accuracy = mean over epoch {s.epochs}'s training images as they were trained on (the figures "
             "an earlier cohort printed during training: compare their 63.4% / 82.2% with the TRAIN "
             "accuracy column, not the test one).",
             "vs assignment: every run that is not the assignment's layout (4 GPUs x 512 = 2048, reference "
             "1 GPU x 128) says how it differs: another global batch, gradient-accumulation emulation of "
             "missing devices, CPU processes instead of GPUs.",
             "lr rule: linear = lr x global batch / reference batch (Goyal et al. 2017); warm-up ramps the "
             "lr linearly per step from the reference lr to that peak; decay starts after warm-up.",
             "epoch time: mean wall time of epochs 2..E (slowest rank; loader waits included, evaluation "
             "excluded); wall time: from the start of epoch 1 to the end of the last, evaluations included.",
             ANCHORS + "."]
    if any(r.accumulation_steps > 1 for r in result.runs):
        notes.insert(1, "accumulation steps: micro-batches per optimizer step on each device (the first ones "
                        "under DDP's no_sync, each loss divided by their number): global batch = devices x "
                        "batch per device x accumulation steps, the same gradient as that many devices "
                        "(BatchNorm running statistics aside).")
    if result.plan.note:
        notes.insert(1, result.plan.note + ".")
    return notes


def save_large_batch_table(store: ResultStore, result: LargeBatchResult):
    """Save ``tables/large_batch.md`` and ``.csv``; return the DataFrame."""
    table = large_batch_table(result)
    store.save_table(table, EXPERIMENT, result.records,
                     title=f"Large-batch training: {result.settings.epochs} epochs, same budget",
                     notes=table_notes(result))
    return table


def plot_accuracy(result: LargeBatchResult, against: str = "epoch"):
    """Test accuracy (left) and training loss (right) of every run, against ``epoch`` or wall-clock ``time``.

    The training loss is shown next to the accuracy because it is the cleaner signal of
    how far optimization got (test accuracy after few steps also depends on how well the
    BatchNorm running statistics have caught up with the weights).
    """
    import matplotlib.pyplot as plt

    if against not in ("epoch", "time"):
        raise LabError(f"against must be 'epoch' or 'time', got {against!r}.")
    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4.0))
    for run, rec in result.ok:
        eps = [e for e in history(rec) if e.get("test_accuracy") is not None]
        if not eps:
            continue
        xs = [e["epoch"] for e in eps] if against == "epoch" else [e["elapsed_seconds"] for e in eps]
        style = "o--" if run.devices == 1 else "o-"
        label = f"{run.name} ({run.shape_text})"
        ax_acc.plot(xs, [100 * e["test_accuracy"] for e in eps], style, label=label)
        ax_loss.plot(xs, [e.get("train_loss") for e in eps], style, label=label)
    xlabel = "epoch" if against == "epoch" else "wall-clock time since the start of training (s)"
    for ax in (ax_acc, ax_loss):
        ax.set_xlabel(xlabel)
        if against == "epoch":
            ax.set_xticks(range(1, result.settings.epochs + 1))
        ax.grid(True, alpha=0.3)
    ax_acc.set_ylabel("test accuracy (%)")
    ax_loss.set_ylabel("training loss (mean over the epoch)")
    ax_loss.set_yscale("log")
    ax_acc.legend(fontsize=8)
    title = "per epoch" if against == "epoch" else "against wall-clock time"
    note = f" ({result.plan.note.split(':')[0]})" if result.plan.note else ""
    fig.suptitle(f"Large-batch runs, {title}{note}", fontsize=11)
    fig.tight_layout()
    return fig


def lr_curves(result: LargeBatchResult) -> dict[str, list[float]]:
    """The lr of every optimizer step of every run (from the same LRSchedule the worker uses)."""
    s = result.settings
    out = {}
    for run, rec in zip(result.runs, result.records):
        steps = rec.metrics.get("steps_per_epoch") if rec.status == "ok" else None
        if not steps:
            images = rec.config.get("train_images") or s.train_images
            if not images:
                continue
            steps = math.ceil(math.ceil(math.ceil(images / run.devices) / run.batch_per_device)
                              / run.accumulation_steps)
        sched = run_schedule(run, s, steps)
        out[run.name] = [sched.lr_at(i) for i in range(sched.total_steps)]
    return out


def run_schedule(run: RunSpec, s: LargeBatchSettings, steps_per_epoch: int) -> LRSchedule:
    """The run's schedule, built exactly as the worker builds it."""
    return make_schedule(s.lr, run.lr_rule, run.global_batch, s.small_batch, steps_per_epoch, s.epochs,
                         run.warmup_epochs, run.decay)


def plot_lr(result: LargeBatchResult):
    """The learning rate against the fraction of the run, for every configuration."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    curves = lr_curves(result)
    styles = ["-", "--", "-", "--", "-"]
    for k, (name, lrs) in enumerate(curves.items()):
        n = len(lrs)
        # identical stretches overlap: thinner lines drawn on top keep each one visible
        ax.plot([(i + 1) * result.settings.epochs / n for i in range(n)], lrs, styles[k % len(styles)],
                drawstyle="steps-pre", lw=1.5 + 1.2 * (len(curves) - 1 - k), alpha=0.85,
                label=f"{name} ({n} steps)")
    ax.set_xlabel("epoch")
    ax.set_ylabel("learning rate")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("Learning rate per optimizer step", fontsize=10)
    fig.tight_layout()
    return fig


def save_figures(store: ResultStore, result: LargeBatchResult) -> list:
    """Save the accuracy-vs-epoch, accuracy-vs-time and lr figures as PNG; return their paths.

    The figures are closed after saving; a notebook shows the PNGs (``IPython.display.Image``),
    which works the same interactively and headless (where matplotlib runs on Agg).
    """
    import matplotlib.pyplot as plt

    paths = []
    for name, make in (("large_batch_accuracy_epoch", lambda: plot_accuracy(result, "epoch")),
                       ("large_batch_accuracy_time", lambda: plot_accuracy(result, "time")),
                       ("large_batch_lr", lambda: plot_lr(result))):
        fig = make()
        paths.append(store.save_figure(fig, name, result.records))
        plt.close(fig)
    return paths


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


def set_epoch_table(dataset_size: int = 16, num_replicas: int = 2, epochs: int = 2, seed: int = 0):
    """Each rank's index order per epoch, with and without ``set_epoch`` (a DataFrame)."""
    import pandas as pd

    rows = []
    for call in (True, False):
        for epoch in range(epochs):
            row: dict[str, Any] = {"set_epoch called": "yes" if call else "no", "epoch": epoch}
            for r in range(num_replicas):
                order = sampler_epoch_orders(dataset_size, num_replicas, r, epochs, call, seed)[epoch]
                row[f"rank {r} indices"] = " ".join(str(i) for i in order)
            rows.append(row)
    return pd.DataFrame(rows)


def worker_sample_orders(store: ResultStore, rec: Record) -> list[dict[str, Any]]:
    """The first sampler indices each rank drew per epoch in a stored run (the worker calls set_epoch)."""
    rows = []
    for r in store.latest(EXPERIMENT):
        same_run = all(r.config.get(k) == v for k, v in rec.config.items() if k not in ("record", "rank"))
        if r.config.get("record") != "rank" or not same_run:
            continue
        for e in r.metrics.get("epochs", []):
            rows.append({"rank": r.config.get("rank"), "epoch": e.get("epoch"),
                         "first indices": " ".join(str(i) for i in e.get("sample_order_head", []))})
    return rows


# --------------------------------------------------------------------------- communication accounting


def comm_plan(settings: LargeBatchSettings, gpus: int | None = None) -> tuple[int, str]:
    """Ranks and backend of the accounting run: NCCL on 2+ GPUs (up to ``devices``), else 2 gloo processes."""
    if gpus is None:
        gpus = gpu_count()
    if gpus >= 2:
        return min(settings.devices, gpus), "nccl"
    return 2, "gloo"


def run_comm_accounting(lab_or_profile: Any = None, settings: LargeBatchSettings | None = None, *,
                        force: bool = False, gpus: int | None = None, broadcast_buffers: bool = True,
                        zero: bool = True, verbose: bool = True, **overrides: Any) -> Record:
    """Run :mod:`lab_utils.workers.comm_accounting` (a few DDP steps) unless stored; return its record."""
    profile, store = _store_of(lab_or_profile)
    s = resolve_settings(profile, settings, **overrides)
    nproc, backend = comm_plan(s, gpus)
    args = AccountingArgs(width=s.comm_width, batch_size=s.comm_batch, steps=s.comm_steps,
                          broadcast_buffers=broadcast_buffers, zero=zero, backend=backend, profile=profile,
                          experiment=COMM_EXPERIMENT, seed=s.seed).validate()
    cfg = args.record_config(nproc, backend)

    def measure(todo):
        if verbose:
            print(f"communication accounting: {nproc} x {backend}, width {s.comm_width}, "
                  f"{s.comm_steps} steps ...", flush=True)
        yield from launcher.stream("lab_utils.workers.comm_accounting", args.to_argv(), nproc=nproc,
                                   timeout_s=s.comm_timeout_s)

    rec = store.run_many(COMM_EXPERIMENT, [cfg], measure, force=force, hardware=_hardware(backend, nproc))[0]
    if rec is None:
        raise LaunchError(f"The accounting run finished but returned no record for {COMM_EXPERIMENT}.")
    return rec


@dataclass(frozen=True)
class CommItem:
    """One row of the accounting: what, when, how, bytes per occurrence, and what it should equal."""

    what: str
    when: str
    collective: str
    calls_per_occurrence: float | None
    payload_bytes: float | None       # per occurrence, what each rank hands to the collective
    expected_bytes: int | None        # from the model's parameter/buffer sizes
    expected_from: str

    @property
    def matches(self) -> bool | None:
        if self.payload_bytes is None or self.expected_bytes is None:
            return None
        return self.payload_bytes == self.expected_bytes


def _ledger(rank_entry: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["phase"], row["kind"]): row for row in rank_entry["ledger"]}


def comm_items(rec: Record) -> list[CommItem]:
    """The accounting of rank 0 (payloads are the same on every rank), item by item."""
    m = rec.metrics
    mb = m["model_bytes"]
    steps = rec.config["steps"]
    world = m["world_size"]
    led = _ledger(m["ranks"][0])

    def per(phase: str, kind: str, n: int = 1) -> tuple[float | None, float | None]:
        row = led.get((phase, kind))
        if row is None:
            return None, None
        return row["calls"] / n, row["bytes"] / n

    params, bufs = mb["parameter_bytes"], mb["buffer_bytes"]
    items = []
    c, b = per("construction", ca.SHAPE_CHECK)
    items.append(CommItem("parameter shape check", "once, DDP construction",
                          "all-gather of shape metadata (C++; bytes seen on the wire only)",
                          c, None, None, ""))
    c, b = per("construction", ca.BROADCAST_COALESCED)
    items.append(CommItem("initial parameter + buffer broadcast", "once, DDP construction",
                          "broadcast from rank 0, coalesced into buckets", c, b, params + bufs,
                          "parameter bytes + buffer bytes"))
    c, b = per("step", ca.BROADCAST_COALESCED, steps)
    on = rec.config.get("broadcast_buffers", True)
    items.append(CommItem(f"BatchNorm buffers (broadcast_buffers={on})", "every training step (forward)",
                          "broadcast from rank 0, coalesced", c if on else 0,
                          b if b is not None else (None if on else 0.0),
                          bufs if on else 0, "buffer bytes" if on else "nothing"))
    c, b = per("step", ca.GRAD_BUCKET, steps)
    items.append(CommItem("gradients", "every training step (backward)", "all-reduce per bucket (comm hook)",
                          c, b, mb["trainable_parameter_bytes"], "trainable parameter bytes"))
    c, b = per("loss_logging", ca.ALL_REDUCE, steps)
    items.append(CommItem("global loss for logging", "every step, if logged", "all-reduce of one float32",
                          c, b, 4, "one float32"))
    c, b = per("evaluation", ca.BROADCAST)
    items.append(CommItem("rank 0's BatchNorm statistics before evaluating", "every evaluation",
                          "broadcast per buffer", c, b, bufs, "buffer bytes"))
    c, b = per("evaluation", ca.ALL_REDUCE)
    items.append(CommItem("test metric sums (loss, correct, count)", "every evaluation",
                          "all-reduce of three float64", c, b, 24, "three float64"))
    if rec.config.get("zero"):
        c, b = per("zero_step", ca.GRAD_BUCKET, steps)
        items.append(CommItem("ZeRO-1: gradients (still all of them)", "every step",
                              "all-reduce per bucket (DDP)", c, b, mb["trainable_parameter_bytes"],
                              "trainable parameter bytes"))
        c, b = per("zero_step", ca.BROADCAST, steps)
        items.append(CommItem(f"ZeRO-1: updated parameter shards, each owner to the other {world - 1}",
                              "every step (after optimizer.step)", "broadcast per parameter from its owner",
                              c, b, params, "parameter bytes (sum over owners)"))
        c, b = per("zero_checkpoint", ca.BROADCAST)
        items.append(CommItem("ZeRO-1: optimizer state gathered on rank 0 (consolidate_state_dict)",
                              "each checkpoint", "broadcast of pickled state from each owner", c, b, None,
                              "pickled momentum of the other ranks' shards (+ header)"))
    return items


def _whole(v: Any) -> Any:
    """Whole numbers as int, missing as None (so tables print 705608, not 7.056e+05)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return int(round(v)) if float(v).is_integer() or abs(v) >= 100 else v


def _object_columns(df, columns):
    import pandas as pd

    for c in columns:
        df[c] = pd.Series([_whole(v) for v in df[c]], index=df.index, dtype=object)
    return df


def comm_table(rec: Record):
    """The accounting as a DataFrame: what, when, collective, calls, bytes, expected, equal."""
    import pandas as pd

    rows = []
    for it in comm_items(rec):
        rows.append({"what": it.what, "when": it.when, "collective": it.collective,
                     "calls": it.calls_per_occurrence, "payload bytes": it.payload_bytes,
                     "expected bytes": it.expected_bytes, "expected from": it.expected_from,
                     "equal": {True: "yes", False: "NO", None: ""}[it.matches]})
    return _object_columns(pd.DataFrame(rows), ["calls", "payload bytes", "expected bytes"])


def optimizer_state_rows(rec: Record) -> list[dict[str, Any]]:
    """Optimizer state (SGD momentum) each rank holds: plain DDP vs ZeRO-1 (bytes)."""
    rows = []
    for g in rec.metrics["ranks"]:
        rows.append({"rank": g["rank"], "DDP + SGD: momentum bytes held": g.get("sgd_state_bytes"),
                     "ZeRO-1: momentum bytes held": g.get("zero_state_bytes")})
    return rows


PHASE_LABELS = {
    "construction": "DDP construction (shape check + initial broadcast)",
    "step": "one training step (buffers + gradients + logged loss)",
    "evaluation": "one evaluation (buffers + metric sums)",
    "zero_step": "one ZeRO-1 step (buffers + gradients + parameter shards)",
    "zero_checkpoint": "ZeRO-1 checkpoint (consolidate_state_dict)",
}
LEDGER_PHASES = {"step": ("step", "loss_logging"), "zero_step": ("zero_step",)}


def _expected_written(rows: list[dict[str, Any]], rank: int, world: int) -> float:
    """Bytes ``rank`` should write for these ledger rows with 2 ranks: ring all-reduce 2(P-1)/P x S,
    broadcast S from the root (to its P-1 = 1 peer)."""
    total = 0.0
    for row in rows:
        if row["kind"] in (ca.ALL_REDUCE, ca.GRAD_BUCKET):
            total += row["bytes"] * 2 * (world - 1) / world
        elif row["kind"] in (ca.BROADCAST, ca.BROADCAST_COALESCED):
            sent = {int(k): v for k, v in (row.get("bytes_by_src") or {}).items()}
            total += sent.get(rank, 0) * (world - 1)
    return total


def wire_table(rec: Record):
    """Cross-check (gloo only): payload counted vs bytes each rank wrote to its sockets, per phase.

    ``wrote`` is the mean over the phase's occurrences of the change in ``wchar`` of
    ``/proc/self/io``. With 2 ranks, ``expected`` is what the algorithms imply: a ring
    all-reduce of S bytes writes 2(P-1)/P x S = S per rank, a broadcast writes S on the
    root and nothing elsewhere. The excess is gloo's per-message headers and the control
    messages the payload count cannot see (shape check, bucket-order sync). Returns None
    when not measured (NCCL).
    """
    import pandas as pd

    ranks = rec.metrics["ranks"]
    world = rec.metrics["world_size"]
    if not all(g.get("wire_measured") for g in ranks):
        return None
    rows = []
    for phase, label in PHASE_LABELS.items():
        occurrences = [k for k in ranks[0]["wire_bytes"] if k.split(":")[0] == phase]
        if not occurrences:
            continue
        n = len(occurrences)
        phases = LEDGER_PHASES.get(phase, (phase,))
        row: dict[str, Any] = {"phase": label}
        for g in ranks:
            vals = [v for k, vs in g["wire_bytes"].items() if k.split(":")[0] == phase for v in vs]
            ledger_rows = [r for r in g["ledger"] if r["phase"] in phases]
            if g["rank"] == 0:
                row["payload counted (bytes)"] = sum(r["bytes"] for r in ledger_rows) / n
            if world == 2:
                expected = _expected_written(ledger_rows, g["rank"], world) / n
                row[f"rank {g['rank']} expected (bytes)"] = expected
            row[f"rank {g['rank']} wrote (bytes)"] = statistics.fmean(vals) if vals else None
        rows.append(row)
    df = pd.DataFrame(rows)
    return _object_columns(df, [c for c in df.columns if c != "phase"])


def accounting_checks(rec: Record) -> dict[str, bool]:
    """Each accounted item with an expected size: does the payload equal it (on every rank)?"""
    out = {}
    for g in rec.metrics["ranks"]:
        one = Record(experiment=rec.experiment, config=rec.config,
                     metrics={**rec.metrics, "ranks": [g]})
        for it in comm_items(one):
            if it.matches is not None:
                out[f"rank {g['rank']}: {it.what}"] = it.matches
    return out


def save_comm_tables(store: ResultStore, rec: Record):
    """Save ``comm_accounting`` (and ``comm_accounting_wire`` when measured); return the main table."""
    table = comm_table(rec)
    mb = rec.metrics["model_bytes"]
    cfg = rec.config
    notes = [f"Measured on a real DDP run: {cfg['devices']} x {cfg['backend']}, "
             f"ResNet-18 width {cfg['width']} "
             f"({mb['parameters']:,} parameters = {mb['parameter_bytes']:,} bytes fp32; buffers "
             f"{mb['buffer_bytes']:,} bytes), batch {cfg['batch_size']} per rank, {cfg['steps']} steps; "
             "random inputs (bytes do not depend on the data).",
             "payload bytes: numel x element size of what each rank hands to the collective, per "
             "occurrence (per step: total / steps), counted by wrapping torch.distributed's entry points "
             "(_broadcast_coalesced, broadcast, all_reduce) and a gradient comm hook.",
             "Bytes on the wire depend on the algorithm: ring all-reduce sends 2(P-1)/P x payload per rank; "
             "a broadcast sends the payload from the root.",
             "ZeRO-1 = torch.distributed.optim.ZeroRedundancyOptimizer over SGD with momentum."]
    store.save_table(table, COMM_EXPERIMENT, [rec], title="What DDP communicates besides gradients",
                     notes=notes)
    wire = wire_table(rec)
    if wire is not None:
        store.save_table(wire, f"{COMM_EXPERIMENT}_wire", [rec],
                         title="Cross-check: payload counted vs bytes written to the sockets (gloo)",
                         notes=["wrote: change of wchar in /proc/self/io over the phase (mean over "
                                "occurrences); includes gloo's headers and C++ control messages.",
                                "expected (2 ranks): ring all-reduce 2(P-1)/P x payload = payload per rank; "
                                "broadcast: the payload, written by its root only."])
    return table


# --------------------------------------------------------------------------- Q7: are the gradients enough?

GRADIENTS_ONLY_TABLE = "comm_gradients_only"


@dataclass(frozen=True)
class Need:
    """One thing the replicas must agree on, how the ledger calls it, and what it costs in a run."""

    what: str
    when: str
    ledger_item: str | None    # prefix of the :func:`comm_items` row that carries it; None: no message
    spec_bytes: str            # "gradients" | "parameters+buffers" | "buffers" | a number of bytes
    per: str                   # "run" | "step" | "epoch" | "evaluation"
    why: str


# What a DDP run at 4 x 512 needs, besides and including the gradients (notebook 05, Q7).
NEEDS: tuple[Need, ...] = (
    Need("gradients", "every step (backward)", "gradients", "gradients", "step",
         "the same averaged gradient on every rank, so every rank makes the same update"),
    Need("initial parameter + buffer broadcast", "once, DDP construction", "initial parameter + buffer",
         "parameters+buffers", "run",
         "replicas start identical; without it the same update moves different weights forever"),
    Need("BatchNorm buffers (rank 0's running mean/var)", "every step (forward)", "BatchNorm buffers",
         "buffers", "step",
         "running statistics are not gradients: each rank's come from its own 512 images; without the "
         "broadcast the 4 replicas evaluate (and save) 4 different models"),
    Need("global loss for logging", "every step, if logged", "global loss", "4", "step",
         "the loss of the whole 2,048-image batch; without it each rank logs its own 512"),
    Need("rank 0's BatchNorm statistics before evaluating", "every evaluation", "rank 0's BatchNorm",
         "buffers", "evaluation", "every rank evaluates the same model"),
    Need("test metric sums (loss, correct, count)", "every evaluation", "test metric sums", "24",
         "evaluation", "accuracy over the whole test set; without it each rank reports its own shard"),
    Need("learning rate (linear scaling, warm-up, decay)", "every step", None, "0", "step",
         "no message: every rank computes the same lr from the step number (lab_utils.core.schedules)"),
    Need("data order (DistributedSampler + set_epoch)", "every epoch", None, "0", "epoch",
         "no message: every rank draws the same permutation from seed + epoch (Q5) and keeps its shard"),
    Need("optimizer state (SGD momentum)", "every step", None, "0", "step",
         "no message: replicated, identical because every update is (ZeRO shards it and then broadcasts "
         "parameters, Q6)"),
)


def gradients_only_table(rec: Record, epochs: int = 5, devices: int = ASKED_LARGE[0],
                         per_device_batch: int = ASKED_LARGE[1], dataset_size: int | None = None):
    """Q7 from the communication ledger: what a ``devices`` x ``per_device_batch`` run of ``epochs``
    epochs (one evaluation each) hands to collectives, item by item, for the spec ResNet-18.

    Each ledger item's payload was measured in ``rec`` (the accounting run, its own model) and
    compared with the model's sizes; the spec column applies those sizes to the spec ResNet-18
    (width 64). Bytes per item do not depend on the batch; only the number of steps does:
    epochs x ceil(ceil(N / devices) / per_device_batch). Payload bytes (what each rank hands to the
    collective; a ring all-reduce sends 2(P-1)/P of it per rank). Returns (DataFrame, verdict).
    """
    import pandas as pd


    n = dataset_size or CIFAR10_TRAIN_SIZE
    steps = epochs * math.ceil(math.ceil(n / devices) / per_device_batch)
    times = {"run": 1, "step": steps, "epoch": epochs, "evaluation": epochs}
    spec = ca.model_bytes(ResNet18())
    buffers_on = rec.config.get("broadcast_buffers", True)
    sizes = {"gradients": spec.trainable_parameter_bytes, "buffers": spec.buffer_bytes,
             "parameters+buffers": spec.parameter_bytes + spec.buffer_bytes}
    items = comm_items(rec)
    equal = {True: "yes", False: "NO", None: "not measured"}
    measured_col = "payload per time, measured here (bytes)"
    spec_col = "payload per time, spec ResNet-18 (bytes)"
    rows = []
    for need in NEEDS:
        item = next((it for it in items if need.ledger_item and it.what.startswith(need.ledger_item)), None)
        per_time = sizes[need.spec_bytes] if need.spec_bytes in sizes else int(need.spec_bytes)
        if need.ledger_item == "BatchNorm buffers" and not buffers_on:
            per_time = 0
        rows.append({"what": need.what, "when": need.when,
                     f"times in the run ({devices} x {per_device_batch})": times[need.per],
                     measured_col: None if item is None else item.payload_bytes,
                     "measured = model's sizes": "" if item is None else equal[item.matches],
                     spec_col: per_time, "spec payload in the run (bytes)": per_time * times[need.per],
                     "why": need.why})
    df = pd.DataFrame(rows)
    total = float(df["spec payload in the run (bytes)"].sum())
    df["share of the run's bytes %"] = 100 * df["spec payload in the run (bytes)"] / total if total else None
    df = df[[c for c in df.columns if c != "why"] + ["why"]]
    grads = float(df.loc[df["what"] == "gradients", "spec payload in the run (bytes)"].iloc[0])
    other = total - grads
    checked = [r for r in rows if r["measured = model's sizes"] in ("yes", "NO")]
    wrong = [r["what"] for r in checked if r["measured = model's sizes"] == "NO"]
    c = rec.config
    if wrong:
        measured = ("The ledger of this run found payloads that differ from the model's sizes: "
                    + ", ".join(wrong))
    else:
        measured = (f"The ledger of this run ({c['devices']} x {c['backend']}, ResNet-18 width "
                    f"{c['width']}) found every payload equal to the model's sizes ({len(checked)} of "
                    f"{len(checked)} items)")
    verdict = (f"**No: gradients alone are not enough.** At {devices} x {per_device_batch} for {epochs} "
               f"epochs ({steps} steps, spec ResNet-18), the gradient all-reduces carry {grads / 1e9:.3f} GB "
               f"({grads / total:.1%} of the run's payload); the other {other / 1e6:.1f} MB "
               f"({other / total:.2%}) are what keeps the replicas one model: the initial broadcast, rank "
               "0's BatchNorm buffers before every forward, and the loss and metric reductions. Few bytes, "
               "but without them the replicas start apart, evaluate different BatchNorm statistics, and "
               "report their own shard's numbers. The large-batch remedies (linear scaling, warm-up) and the "
               "data order need no message: every rank computes them from the step and the epoch. "
               f"{measured}; the spec column applies those sizes to the spec ResNet-18.")
    return _object_columns(df, [measured_col, spec_col, "spec payload in the run (bytes)"]), verdict


def save_gradients_only_table(store: ResultStore, rec: Record, epochs: int = 5):
    """Save ``comm_gradients_only`` (md + csv), Q7's table; return (table, verdict)."""
    table, verdict = gradients_only_table(rec, epochs)
    n, b = ASKED_LARGE
    store.save_table(table, GRADIENTS_ONLY_TABLE, [rec],
                     title=f"Q7: at {n} GPUs x {b} per GPU, are the gradients enough?",
                     notes=["payload: bytes each rank hands to the collective (a ring all-reduce sends "
                            "2(P-1)/P x payload per rank, a broadcast sends it from rank 0).",
                            "measured here: the accounting run's own model (the ledger of notebook 05, Q6); "
                            "spec ResNet-18: the same items sized from the spec model (11,173,962 "
                            "parameters, 20 BatchNorm layers), times the occurrences in the assignment's "
                            "run (one evaluation per epoch).",
                            verdict.replace("**", "")])
    return table, verdict

