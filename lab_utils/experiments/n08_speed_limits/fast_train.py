"""The fast path's training machinery (notebook 08): the switchable options of a waterfall row
(:class:`TrainOptions`: loader, channels_last, bf16, fused SGD, torch.compile), the cumulative
waterfall of steps (:func:`waterfall_steps`), and the :class:`Trainer` whose epoch is the lab's
one epoch driver (:func:`lab_utils.learn.loop.run_epoch`). The worker that measures with them:
:mod:`lab_utils.experiments.n08_speed_limits.worker`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lab_utils.engine import onednn
from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.hardware import fp32_training_precision
from lab_utils.experiments.shared.data import check_num_workers
from lab_utils.learn.epoch_record import EpochRecord
from lab_utils.learn.errors import LabError, check_choice
from lab_utils.learn.loop import StepOptions, make_optimizer, run_epoch, train_steps
from lab_utils.learn.models import ResNet18
from lab_utils.learn.timing import synchronize

#: SGD implementations and the optimizer arguments that choose them ("default": torch's choice).
_SGD_KWARGS: dict[str, dict[str, bool]] = {"default": {}, "for-loop": {"foreach": False},
                                           "foreach": {"foreach": True}, "fused": {"fused": True}}
SGD_IMPLS = tuple(_SGD_KWARGS)
LOADERS = ("spec", "device")


@dataclass(frozen=True)
class TrainOptions:
    """One training configuration of the waterfall; every field is recorded."""

    loader: str = "spec"           # "spec": DataLoader + PIL transforms; "device": DeviceLoader
    channels_last: bool = False
    bf16: bool = False             # torch.autocast(dtype=bfloat16) around forward and loss
    compile: bool = False          # torch.compile(model), compiled during warm-up
    sgd: str = "default"           # "default" (torch's choice), "for-loop", "foreach", "fused"
    num_workers: int = 2           # spec loader's worker processes (unused by the device loader)

    def __post_init__(self):
        check_choice(self.loader, LOADERS, "loader")
        check_choice(self.sgd, SGD_IMPLS, "SGD implementation")
        check_num_workers(self.num_workers)

    def as_config(self) -> dict[str, Any]:
        d = asdict(self)
        if self.loader == "device":
            d["num_workers"] = 0
        return d

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> TrainOptions:
        """Back from a record's config (the keys of :meth:`as_config`)."""
        return cls(**{f: cfg[f] for f in cls.__dataclass_fields__})

    def describe(self) -> str:
        parts = [f"DataLoader (PIL, {self.num_workers} workers)" if self.loader == "spec"
                 else "device-resident loader"]
        parts.append("channels_last" if self.channels_last else "NCHW")
        parts.append("bf16 autocast" if self.bf16 else "fp32")
        parts.append(f"SGD {self.sgd}")
        if self.compile:
            parts.append("torch.compile")
        return ", ".join(parts)


# (step name, what it adds, change applied to the previous step's options)
WATERFALL: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("spec", "the assignment: DataLoader with PIL transforms, fp32, eager", {}),
    ("device_loader", "+ data resident on the device, augmentation batched there", {"loader": "device"}),
    ("channels_last", "+ channels_last (NHWC) layout", {"channels_last": True}),
    ("bf16", "+ bf16 autocast", {"bf16": True}),
    ("fused_sgd", "+ fused SGD", {"sgd": "fused"}),
    ("compile", "+ torch.compile", {"compile": True}),
)


STEP_NAMES = tuple(s[0] for s in WATERFALL)


def waterfall_steps(num_workers: int = 2, steps: Sequence[str] | None = None,
                    skip: Callable[[str, TrainOptions], str | None] | None = None
                    ) -> list[tuple[str, str, TrainOptions, str | None]]:
    """The cumulative waterfall: (step, what it adds, its options, why it cannot run here or None).

    A step's options are those of the last step before it that runs, plus its one change; ``skip`` says why a
    step cannot run here (None: it runs). The spec step is always first (every ratio is relative to it).
    """
    chosen = list(STEP_NAMES if steps is None else steps)
    unknown = [s for s in chosen if s not in STEP_NAMES]
    if unknown:
        raise LabError(f"Unknown waterfall step(s) {unknown}; choose from: {', '.join(STEP_NAMES)}.")
    opts = TrainOptions(num_workers=num_workers)
    out = []
    for name, what, change in WATERFALL:
        if name in chosen or name == "spec":
            candidate = replace(opts, **change)
            reason = skip(name, candidate) if skip is not None else None
            out.append((name, what, candidate, reason))
            opts = candidate if reason is None else opts
    return out


def resolved_sgd(impl: str, device: torch.device) -> str:
    """What ``impl`` runs as: torch's default is foreach on CUDA and the for-loop on CPU."""
    if impl != "default":
        return impl
    return "foreach" if device.type == "cuda" else "for-loop"


@dataclass
class Trainer:
    """A model, its optimizer and a training step built from :class:`TrainOptions`."""

    model: nn.Module            # the parameters (eager module)
    forward: Any                # the callable used in training (compiled or not)
    optimizer: torch.optim.SGD
    options: TrainOptions
    device: torch.device
    # Set when the model was rewritten to avoid a oneDNN defect on this CPU: the row stores
    # the sentence (see lab_utils.engine.onednn).
    onednn_workaround: str | None = None

    def step_options(self, schedule=None, first_step: int = 0, max_steps: int | None = None) -> StepOptions:
        """The lab's one loop with these options: bf16 autocast, channels_last batches, the lr of
        ``schedule`` (a :class:`lab_utils.learn.schedules.LRSchedule`) from ``first_step`` on."""
        return StepOptions(autocast_dtype=torch.bfloat16 if self.options.bf16 else None,
                           channels_last=self.options.channels_last, first_step=first_step,
                           max_steps=max_steps, lr_at=schedule.lr_at if schedule is not None else None)

    def epoch(self, loader, max_steps: int | None = None, schedule=None, first_step: int = 0,
              timed: bool = False) -> EpochRecord:
        """One pass over ``loader`` (or its first ``max_steps`` batches) through THE epoch driver,
        :func:`lab_utils.learn.loop.run_epoch`. ``timed=False`` (the waterfall): no phase boundaries,
        so the device is synchronized only at the pass's ends and the host queues work ahead, as
        in real training: ``epoch_seconds`` includes the loader waits, which is the point."""
        return run_epoch(self.forward, loader, self.optimizer, self.device, loss_fn=F.cross_entropy,
                         options=self.step_options(schedule, first_step, max_steps), timed=timed)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns (summed loss, correct count) as device tensors (no sync)."""
        sums = train_steps(self.forward, [(x, y)], 1, self.optimizer, F.cross_entropy, None, self.device,
                           self.step_options())
        return sums.loss_sum, sums.correct


def build_trainer(options: TrainOptions, width: int, device: torch.device | str, seed: int = 0,
                  lr: float = 0.1) -> Trainer:
    """ResNet-18 of ``width`` on ``device`` (seeded, so every option starts from the same weights).

    Applies the lab's training backend settings (:func:`lab_utils.engine.backends.apply_training_backends`:
    autotuned cuDNN convolutions), as every training path does.
    """
    apply_training_backends()
    device = torch.device(device)
    torch.manual_seed(seed)
    model = ResNet18(width=width).to(device)
    if options.channels_last:
        model = model.to(memory_format=torch.channels_last)
    workaround = onednn.apply_workaround(model, device, options.channels_last or options.compile)
    # dynamic=False: one static graph per batch shape. Without it the warm-up's second shape (the
    # last, partial batch) makes dynamo recompile with a symbolic batch size, and every batch of
    # the timed epoch would then run that dynamic-shape graph instead of the full batch's own.
    forward = torch.compile(model, dynamic=False) if options.compile else model
    optimizer = make_optimizer(model, lr=lr, **_SGD_KWARGS[options.sgd])  # the spec's SGD
    return Trainer(model=model, forward=forward, optimizer=optimizer,
                   options=options, device=device, onednn_workaround=workaround)


def to_device(x: torch.Tensor, y: torch.Tensor, device: torch.device,
              channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Host batch to the device (non-blocking from pinned memory), in the model's layout."""
    if x.device != device:
        nb = device.type == "cuda"
        x, y = x.to(device, non_blocking=nb), y.to(device, non_blocking=nb)
    if channels_last and not x.is_contiguous(memory_format=torch.channels_last):
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y


def warm_up(trainer: Trainer, loader, steps: int, remainder: int = 0) -> float:
    """Run ``steps`` training steps (plus one at batch size ``remainder`` if > 0, then a full one
    again); return seconds.

    This is where ``torch.compile`` compiles (both the full and the last, smaller batch
    shape, each its own static graph: :func:`build_trainer` compiles with ``dynamic=False``),
    where cuDNN's benchmark picks algorithms for each shape, dtype and layout, and the allocator
    grows, so none of it lands in a timed epoch: pass the epoch's last batch size as ``remainder``
    whether or not the model is compiled.
    """
    synchronize(trainer.device)
    t0 = time.perf_counter()
    if steps > 0:
        trainer.epoch(loader, max_steps=steps)
    if remainder > 0:
        x, y = to_device(*next(iter(loader)), trainer.device, trainer.options.channels_last)
        trainer.step(x[:remainder], y[:remainder])
        trainer.step(x, y)  # the full shape again: its first call after the switch is slow too
    synchronize(trainer.device)
    return time.perf_counter() - t0


def compiled_graphs() -> int | None:
    """How many graphs torch.compile (dynamo) has compiled in this process; None if unknown.

    Read before and after a timed epoch to show that no compilation happened inside it.
    """
    try:
        from torch._dynamo.utils import counters
    except Exception:  # an internal API: absent or moved in some torch version
        return None
    return int(counters["stats"].get("unique_graphs", 0))


def peak_precision(options: TrainOptions, device_name: str) -> str:
    """The precision whose peak a run is compared with: bf16, else fp32 (tf32 where cuDNN uses it)."""
    return "bf16" if options.bf16 else fp32_training_precision(device_name)
