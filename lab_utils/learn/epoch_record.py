"""The loop's counts (:class:`EpochSums`) and one epoch's measurements (:class:`EpochRecord`); every name
is defined in :mod:`lab_utils.learn.metrics`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class EpochRecord:
    """What one training epoch of one process measured. Times are seconds, memory bytes."""

    epoch: int
    images: int                     # samples this process trained on (images, or sequences for a GPT)
    steps: int                      # optimizer steps
    epoch_seconds: float            # wall time of the whole pass, loader waits included, device synced
    train_seconds: float | None     # movement + compute + communication (no loader wait); None untimed
    data_loading_seconds: float
    data_movement_seconds: float
    compute_seconds: float
    communication_seconds: float
    images_per_s: float | None      # images / train_seconds (None untimed)
    loss: float                     # mean training loss over this process's samples
    accuracy: float                 # training accuracy over this process's samples (nan: not counted)
    peak_memory_bytes: int | None   # device memory high-water mark (the fullest GPU); None on CPU
    lr: float
    # DataParallel: each GPU's peak, in device_ids order (GPU 0 also holds the gathered outputs)
    peak_memory_bytes_per_device: list[int] | None = None
    micro_steps: int = 0            # forward/backward passes (= batches); = steps without accumulation
    skew_wait_seconds: float = 0.0  # DDP: waiting in the barrier for the other ranks' loaders
    allreduce_seconds: float | None = None     # with a comm timer: all-reduce in flight, summed over steps
    exposed_tail_seconds: float | None = None  # with a comm timer: exposed all-reduce wait, summed
    # with global_sums: loss, accuracy and samples over ALL ranks (an all-reduce at the epoch's end)
    global_loss: float | None = None
    global_accuracy: float | None = None
    global_images: int | None = None
    # the spread of the epoch's per-step training time (seconds; None untimed): see train_steps
    step_train_seconds_p10: float | None = None
    step_train_seconds_p50: float | None = None
    step_train_seconds_p90: float | None = None
    step_train_seconds_sd: float | None = None  # their standard deviation: the total's standard error

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class EpochSums:
    """What :func:`lab_utils.learn.loop.train_steps` counted in one pass; the loss and correct sums are
    float64 tensors on the device, ``step_train_seconds`` each optimizer step's training time when timed."""

    images: int
    steps: int
    micro_steps: int
    loss_sum: Any
    correct: Any
    allreduce_seconds: float = 0.0
    exposed_tail_seconds: float = 0.0
    step_train_seconds: list[float] = field(default_factory=list)
