"""Notebook 08, the fast path: CIFAR-10 resident on the device, and switchable training options.

Notebooks 01-03 train with the assignment's pipeline: a ``DataLoader`` whose worker processes turn every image
into PIL, pad, crop, flip, convert and normalize it one at a time. The fast path keeps the uint8 data set on
the device (moved once, :class:`~lab_utils.experiments.shared.data.DeviceLoader`) and does the same
augmentation for a whole batch there (the same crop offsets, uniform over 0..8, and flips, probability 1/2;
for a given offset and flip torchvision's result to float rounding: tested), then adds the usual speed-ups one
at a time, each recorded (:class:`~lab_utils.experiments.n08_speed_limits.fast_train.TrainOptions`): device
loader, ``channels_last``, bf16 autocast, fused SGD, ``torch.compile`` (compiled in the warm-up, never inside
an epoch).

Four experiments of :mod:`lab_utils.experiments.n08_speed_limits.worker` (what each measures is said there),
each group one side-by-side comparison in one launch, reused only whole: the loaders alone, the waterfall, a
trace and the accuracy check of ``fast_step`` (the notebook's fastest waterfall row; None: the last that
runs). Tables and ``python -m lab_utils bench data|train``:
:mod:`lab_utils.experiments.n08_speed_limits.tables`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, ClassVar

from lab_utils.engine import config, profiles
from lab_utils.engine.config import (
    CIFAR10_TEST_SIZE,
    CIFAR10_TRAIN_SIZE,
    check_batch_size,
    resolve_dataset,
    resolved_images,
)
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n08_speed_limits import worker
from lab_utils.experiments.n08_speed_limits.fast_train import STEP_NAMES, TrainOptions, waterfall_steps
from lab_utils.experiments.shared import estimates
from lab_utils.experiments.shared.data import check_num_workers
from lab_utils.learn.errors import LabError, check_positive_int

__all__ = ["ACCURACY_EXPERIMENT", "EXPERIMENTS", "LOADER_EXPERIMENT",
           "Settings", "TRACE_EXPERIMENT", "WATERFALL_EXPERIMENT", "cost", "doctor_settings", "fast_options",
           "plan_accuracy", "plan_loader", "plan_trace", "plan_waterfall", "waterfall"]

@dataclass(frozen=True)
class Settings:
    """Per-profile knobs of notebook 08 and the two benchmarks (values:
    :attr:`QUICK` and :attr:`FULL` below).

    ``train_images`` / ``data_images`` of None mean the whole training split.
    """

    width: int                      # ResNet-18 width (64: the spec model)
    train_images: int | None        # images per timed epoch in bench train
    data_images: int | None         # images per pass in bench data
    batch_size: int = 128
    num_workers: int = 2            # the spec pipeline's DataLoader workers
    warmup_steps: int = 2           # untimed steps before each timed epoch (compilation happens here)
    data_min_seconds: float = 1.0   # the device loader repeats passes until at least this long
    compile: bool = True            # run the torch.compile step (else a row "skipped in quick profile")
    trace_steps: int = 3            # profiler: steps traced
    top_ops: int = 12               # rows of the top-operator table
    accuracy_epochs: int = 0        # short-schedule accuracy check (0: not run)
    test_images: int | None = None
    steps: tuple[str, ...] = STEP_NAMES
    dataset: str | None = None      # "auto" | "cifar10" | "synthetic" (None: $LAB_DATASET or auto)
    seed: int = 0
    # The longest one waterfall row (warm-up, compilation, timed epoch) may take, in seconds;
    # past it the row is an error and its process stops (lab_utils.engine.watchdog).
    row_timeout_s: float | None = 1800.0
    fast_step: str | None = None    # the step the trace and the accuracy check use (None: the last that runs)

    # CPU/CI: a width-8 ResNet-18 on 512 images (4 timed steps of 128 per row); compile skipped
    # (minutes on a CPU). The one-epoch accuracy check is at chance level at this size either way
    # (1,024 images gave 14% and 7%): in quick it runs the path, it does not compare accuracies.
    QUICK: ClassVar[dict[str, Any]] = dict(
        width=8, train_images=512, data_images=2048, warmup_steps=1,
        data_min_seconds=0.5, compile=False, trace_steps=2, accuracy_epochs=1,
        test_images=500, row_timeout_s=900.0)
    # The assignment's model on all 50,000 images, every step, and an 8-epoch accuracy check.
    FULL: ClassVar[dict[str, Any]] = dict(
        width=64, train_images=None, data_images=None, warmup_steps=3,
        data_min_seconds=2.0, compile=True, trace_steps=5, accuracy_epochs=8,
        test_images=None)

    def validate(self) -> Settings:
        check_positive_int(self.width, "width")
        check_batch_size(self.batch_size)
        for name in ("train_images", "data_images", "test_images"):
            v = getattr(self, name)
            if v is not None:
                check_positive_int(v, name)
        check_num_workers(self.num_workers)
        for name in ("warmup_steps", "accuracy_epochs"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise LabError(f"{name} must be a whole number >= 0, got {v!r}.")
        check_positive_int(self.trace_steps, "trace_steps")
        check_positive_int(self.top_ops, "top_ops")
        if not self.data_min_seconds >= 0:
            raise LabError(f"data_min_seconds must be >= 0, got {self.data_min_seconds!r}.")
        if self.row_timeout_s is not None and not self.row_timeout_s > 0:
            raise LabError(f"row_timeout_s must be a positive number of seconds (or None), "
                           f"got {self.row_timeout_s!r}.")
        waterfall_steps(self.num_workers, self.steps)  # validates step names
        return self


profiles.register(Settings, "fast-path")


def waterfall(settings: Settings, machine: Machine, profile: str
              ) -> list[tuple[str, str, TrainOptions, str | None]]:
    """(step, what it adds, options, why it cannot run here or None) for each row, cumulative: a step
    that cannot run here is a row with its reason, and later steps build on the last one that runs."""
    def skip(step: str, opts: TrainOptions) -> str | None:
        if opts.bf16 and machine.gpus and not machine.bf16:
            return "this GPU has no bf16 (needs Ampere or newer)"
        if step == "compile" and not settings.compile:
            return f"skipped in {profile} profile (torch.compile of ResNet-18 takes minutes on a CPU)"
        return None

    return waterfall_steps(settings.num_workers, settings.steps, skip)


def fast_options(settings: Settings, machine: Machine, profile: str) -> tuple[str, TrainOptions]:
    """The step the trace and the accuracy check run, and its options: ``settings.fast_step``, else the
    last waterfall step that runs here."""
    runs = [(name, opts) for name, _, opts, why in waterfall(settings, machine, profile) if why is None]
    if settings.fast_step is None:
        return runs[-1]
    for name, opts in runs:
        if name == settings.fast_step:
            return name, opts
    raise LabError(f"fast_step {settings.fast_step!r} is not a waterfall step that runs here; use one of: "
                   f"{', '.join(n for n, _ in runs)}.")


def _run(experiment: str, cfg: dict[str, Any], s: Settings, machine: Machine, label: str,
         options: dict[str, Any] | None = None, **run: Any) -> Run:
    """A run of the fast-path worker: one process, this machine's device; in this process on a CPU."""
    opts = {"process_group": False, "dataset": resolve_dataset(s.dataset), "seed": s.seed, **(options or {})}
    return Run(experiment, cfg, worker, device=machine.device, label=label, options=opts,
               **{"group": experiment, "together": True, "in_process": not machine.gpus, **run})


def plan_loader(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """The spec ``DataLoader`` and the device-resident loader, the same images and batch size."""
    s = settings
    common = {"images": resolved_images(s.data_images, CIFAR10_TRAIN_SIZE), "batch_size": s.batch_size,
              "device": machine.device}
    cfgs = [{"pipeline": "spec", "num_workers": s.num_workers, **common},
            {"pipeline": "device", "num_workers": 0, "cpu_threads": None if machine.gpus else 1, **common}]
    return [_run("bench_data", c, s, machine, f"{c['pipeline']} loader",
                 {"data_min_seconds": s.data_min_seconds}) for c in cfgs]


def plan_waterfall(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """One row per step: the same model, initial weights and images; each keeps the steps above it."""
    s, rows = settings, waterfall(settings, machine, profile)
    # A torch.compile row can hang in native code: on a CPU it, too, runs in a process of its own, which
    # the row's time limit ends (the row says why) instead of the notebook's kernel.
    launched = bool(machine.gpus) or any(name == "compile" and why is None for name, _, _, why in rows)
    return [_run("bench_train", {"step": name, "position": i, **opts.as_config(), "width": s.width,
                                 "images": resolved_images(s.train_images, CIFAR10_TRAIN_SIZE),
                                 "batch_size": s.batch_size, "warmup_steps": s.warmup_steps,
                                 "device": machine.device},
                 s, machine, f"{name} row", {"row_timeout_s": s.row_timeout_s}, skip=why,
                 in_process=not launched, timeout_s=(s.row_timeout_s or 1800.0) * len(rows) + 600)
            for i, (name, _, opts, why) in enumerate(rows)]


def plan_trace(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """``trace_steps`` steps of ``fast_step`` under the profiler; the trace goes to
    ``results/<profile>/traces/fastpath_<step>.json``."""
    s = settings
    step, opts = fast_options(s, machine, profile)
    cfg = {"step": step, **opts.as_config(), "width": s.width, "batch_size": s.batch_size,
           "images": resolved_images(s.train_images, CIFAR10_TRAIN_SIZE), "trace_steps": s.trace_steps,
           "device": machine.device}
    path = config.results_dir(profile) / "traces" / f"fastpath_{step}.json"
    return [_run("fastpath_trace", cfg, s, machine, f"trace of {step}",
                 {"trace_path": str(path), "warmup_steps": s.warmup_steps, "top_ops": s.top_ops},
                 group=None, together=False)]


def plan_accuracy(settings: Settings, machine: Machine, profile: str) -> list[Run]:
    """The spec configuration and ``fast_step``, the same weights, images and short schedule; one row
    that says why when ``accuracy_epochs`` is 0 or the fast step is the spec one."""
    s = settings
    step, fast = fast_options(s, machine, profile)
    spec = TrainOptions(num_workers=s.num_workers)
    base = {"width": s.width, "images": resolved_images(s.train_images, CIFAR10_TRAIN_SIZE),
            "test_images": resolved_images(s.test_images, CIFAR10_TEST_SIZE), "batch_size": s.batch_size,
            "epochs": s.accuracy_epochs, "device": machine.device,
            "schedule": "warm-up 1 epoch 0.01->0.1, cosine to 0"}
    if s.accuracy_epochs == 0 or fast == spec:
        why = ("accuracy_epochs is 0 in this profile" if s.accuracy_epochs == 0
               else "the fastest configuration here is the spec one: nothing to compare")
        return [Run("fastpath_accuracy", {"run": "both", **base}, device=machine.device, skip=why)]
    return [_run("fastpath_accuracy", {"run": name, **opts.as_config(), **base}, s, machine,
                 f"{name} accuracy") for name, opts in (("spec", spec), (step, fast))]


def cost(run: Run) -> float:
    """Seconds of one run on the budget's node, start-up excluded: a spec-path or fast-path epoch
    (:mod:`lab_utils.experiments.shared.estimates`) per trained epoch, ``COMPILE_S`` per compiled run; the
    device loader's ``data_min_seconds``; the accuracy check's epochs with a test pass (spec) or 1.2x
    (phase-timed fast path)."""
    c = run.config
    if run.skip is not None:
        return 0.0
    if run.experiment == "bench_data":
        return run.options["data_min_seconds"]
    compile_s = estimates.COMPILE_S if c.get("compile") else 0.0
    if run.experiment == "fastpath_trace":
        return compile_s
    epoch = c["images"] / CIFAR10_TRAIN_SIZE * (
        estimates.spec_epoch_seconds(1, c["batch_size"]) if c["loader"] == "spec"
        else estimates.fast_epoch_seconds("bf16" if c["bf16"] else "tf32"))
    if run.experiment == "bench_train":
        return compile_s + epoch
    if c["loader"] == "spec":
        return c["epochs"] * (epoch + estimates.test_pass_seconds(1))
    return compile_s + c["epochs"] * 1.2 * epoch


def doctor_settings(full: Settings) -> Settings:
    """Seconds on a GPU node: two batches of the full profile's batch size, one warm-up and one traced
    step, one accuracy epoch; torch.compile left to doctor's own compile check."""
    b = full.batch_size
    return replace(full, train_images=2 * b, data_images=2 * b, test_images=b, warmup_steps=1,
                   data_min_seconds=0.0, compile=False, trace_steps=1, accuracy_epochs=1, dataset="synthetic")


LOADER_EXPERIMENT = Experiment("bench_data", "08", Settings, plan_loader, cost, doctor_settings,
                               "the data loader alone: spec DataLoader vs device-resident loader")
WATERFALL_EXPERIMENT = Experiment("bench_train", "08", Settings, plan_waterfall, cost, doctor_settings,
                                  "the waterfall: the spec configuration, then one fast-path step at a time")
TRACE_EXPERIMENT = Experiment("fastpath_trace", "08", Settings, plan_trace, cost, doctor_settings,
                              "a profiler trace of the fastest configuration")
ACCURACY_EXPERIMENT = Experiment("fastpath_accuracy", "08", Settings, plan_accuracy, cost, doctor_settings,
                                 "test accuracy: the spec configuration vs the fastest")


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (LOADER_EXPERIMENT, WATERFALL_EXPERIMENT, TRACE_EXPERIMENT,
                                       ACCURACY_EXPERIMENT)
