"""Q1: the single-device batch-size sweep, up to the batch that no longer fits.

The experiment's shape (as every notebook's): :class:`Settings`, :func:`measure` (lab, settings) ->
one record per batch size; the tables and the figure are in :mod:`lab_utils.experiments.sweep_tables`.

For each batch size (32, 128, 512, ... growing x4) :func:`measure` builds a fresh
ResNet-18 with the spec's SGD, trains ``epochs`` epochs with
:func:`lab_utils.core.loop.run_epoch` (epoch 1 is warm-up, epoch ``reported_epoch`` is
reported), evaluates on the test split and stores **one record per batch size** in the
experiment ``batch_sweep`` of the result store. A batch size already in the store is not
measured again (``force=True`` re-measures), so a re-run after a dead kernel measures only
what is missing.

What the reported time includes (``train_seconds`` of the reported epoch, seconds):
host-to-device copies, forward, loss, backward and the optimizer step, each synchronized
with the device. What it excludes: waiting on the data loader (``data_loading_seconds``,
reported next to it) and the evaluation pass.

Out of memory is an expected result, not an error: the sweep catches it with
:func:`lab_utils.core.memory.catch_oom` (``torch.OutOfMemoryError``, the cuDNN/cuBLAS
allocation failures and the CPU allocator's ``can't allocate memory``), then, outside
the handler, drops every reference to the model, optimizer, loaders and batch, runs
:func:`lab_utils.core.memory.free_device_memory` (``gc.collect()``, ``torch.cuda.empty_cache()``),
stores a row with status ``oom`` and the reason, and stops growing: larger batch sizes get a ``skipped`` row
that says why (these are not stored; they are a consequence, not a measurement).

Making the out-of-memory path reachable on purpose:

- GPU: ``memory_fraction`` (or ``memory_cap_bytes``, converted to a fraction of the
  device's memory) is passed to ``torch.cuda.set_per_process_memory_fraction`` (through
  :func:`lab_utils.core.memory.set_memory_fraction`, which gives the device an index); the
  caching allocator then raises the real ``torch.OutOfMemoryError`` once the process
  would hold more than that share of the GPU. The limit is lifted when the sweep ends.
- CPU: ``memory_cap_bytes`` plays the same role. Every training step is run under
  ``torch.autograd.graph.saved_tensors_hooks`` that add up the bytes of the tensors
  autograd keeps for backward (the activations: the part of training memory that grows
  with the batch), on top of the model state (parameters, gradients, momentum). When
  the running total of a forward pass passes the cap, a forward hook on the module that
  just ran raises ``torch.OutOfMemoryError`` at that point of the forward pass, with the
  graph half built, as the GPU allocator does when its per-process limit is hit. The
  bytes are the real sizes of the real tensors; only the limit is a policy, exactly as
  with ``set_per_process_memory_fraction``. The quick profile sets a cap so that its table
  shows an ``oom`` row and every code path runs on two CPU cores.

Peak device memory is ``torch.cuda.max_memory_allocated`` for the reported epoch (bytes);
on the CPU it is not tracked and the table says so.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lab_utils.core import config, profiles
from lab_utils.core.backends import apply_training_backends, pinned_threads
from lab_utils.core.config import DATASET_CHOICES, check_batch_sizes, check_choice, check_positive_int
from lab_utils.core.data import CIFAR10_TEST_SIZE, CIFAR10_TRAIN_SIZE, make_loaders, resolve_dataset
from lab_utils.core.errors import LabError
from lab_utils.core.flops import count_flops
from lab_utils.core.hardware import device_name, hardware_summary
from lab_utils.core.loop import evaluate, make_optimizer, run_epoch
from lab_utils.core.memory import catch_oom, check_memory_fraction, free_device_memory, set_memory_fraction
from lab_utils.models import ResNet18
from lab_utils.store import Record

__all__ = ["EXPERIMENT", "SPEC_LR", "CpuMemoryCap", "FlopsPerImage", "Settings", "flops_per_image",
           "growing_batch_sizes", "measure", "model_state_bytes"]

EXPERIMENT = "batch_sweep"
SPEC_LR = 0.1
_ONE_PROCESS_ABSENT = ("lr", "skew_wait_seconds", "allreduce_seconds", "exposed_tail_seconds", "global_loss",
                      "global_accuracy", "global_images")


@dataclass(frozen=True)
class Settings:
    """The sweep's knobs for one profile (values: :data:`lab_utils.core.profiles.SWEEP`).

    ``batch_sizes`` must grow (the sweep stops at the first one that does not fit).
    ``train_images`` / ``test_images`` of ``None`` mean the whole split. ``width`` is the
    ResNet-18 base width (64 is the spec's model). ``memory_cap_bytes`` (bytes) and
    ``memory_fraction`` (0 < f <= 1, GPU only) limit memory so that the out-of-memory
    path is reached on purpose; ``None`` (or 0) means no limit beyond the device's own.
    ``dataset``: auto | cifar10 | synthetic; None (the default) reads ``$LAB_DATASET`` (else auto),
    so that ``LAB_DATASET=cifar10`` makes a missing CIFAR-10 an error, as the README says.
    """

    batch_sizes: tuple[int, ...]
    width: int
    train_images: int | None
    test_images: int | None
    epochs: int = 2
    reported_epoch: int = 2
    memory_cap_bytes: int | None = None
    memory_fraction: float | None = None
    num_workers: int | None = None  # None: the profile's
    cudnn_benchmark: bool = True
    seed: int = 0
    label: str = ""
    #: torch threads while training on the CPU (set, then restored); None: torch's default
    #: (one per core). Quick pins it to the DDP workers' threads per rank (notebook 02's
    #: ``cpu_threads``), so T(1) here and in notebook 02 compare.
    cpu_threads: int | None = None
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto

    def validate(self) -> Settings:
        """Reject settings the sweep cannot run, with one sentence naming the fix (a cap of 0: none)."""
        s = replace(self, memory_cap_bytes=None) if self.memory_cap_bytes == 0 else self
        sizes = check_batch_sizes(s.batch_sizes, "sweep batch sizes")
        if any(b >= a for a, b in zip(sizes[1:], sizes[:-1])):
            raise LabError(f"sweep batch sizes must grow strictly (the sweep stops at the first that does "
                           f"not fit), got {list(sizes)}; sort them, e.g. [32, 128, 512].")
        check_positive_int(s.width, "model width")
        check_positive_int(s.epochs, "epochs")
        check_positive_int(s.reported_epoch, "reported epoch")
        if s.reported_epoch > s.epochs:
            raise LabError(f"reported epoch {s.reported_epoch} is after the last epoch {s.epochs}; "
                           f"train at least {s.reported_epoch} epochs.")
        for what, v in (("train images", s.train_images), ("test images", s.test_images)):
            if v is not None:
                check_positive_int(v, what)
        if s.memory_cap_bytes is not None:
            check_positive_int(s.memory_cap_bytes, "memory cap (bytes)")
        if s.memory_fraction is not None:
            check_memory_fraction(s.memory_fraction)
        if s.num_workers is not None and (not isinstance(s.num_workers, int) or s.num_workers < 0):
            raise LabError(f"num_workers must be 0 or more, got {s.num_workers!r}.")
        if s.dataset is not None:
            check_choice(s.dataset, DATASET_CHOICES, "dataset")
        return s


def growing_batch_sizes(start: int = 32, factor: int = 4, largest: int = 32768) -> tuple[int, ...]:
    """``start, start*factor, ...`` up to ``largest`` (inclusive): 32, 128, 512, 2048, ..."""
    check_positive_int(start, "the first batch size")
    if not isinstance(factor, int) or factor < 2:
        raise LabError(f"the growth factor must be a whole number of at least 2, got {factor!r}.")
    out = []
    b = start
    while b <= largest:
        out.append(b)
        b *= factor
    return tuple(out)


profiles.register(Settings, profiles.SWEEP, "sweep")


# --------------------------------------------------------------------------- memory


def _free_memory(device: torch.device) -> None:
    """:func:`lab_utils.core.memory.free_device_memory`, then a fresh peak-memory counter on a GPU.

    Call after dropping references, outside any ``except`` block.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def model_state_bytes(model: nn.Module, optimizer_slots: int = 1) -> int:
    """Bytes of parameters + gradients + ``optimizer_slots`` optimizer states + buffers.

    SGD with momentum keeps one state tensor per parameter (``optimizer_slots=1``).
    """
    p = sum(t.numel() * t.element_size() for t in model.parameters())
    b = sum(t.numel() * t.element_size() for t in model.buffers())
    return p * (2 + optimizer_slots) + b


class CpuMemoryCap:
    """Enforce ``cap_bytes`` on the memory one training step holds (CPU stand-in for a GPU limit).

    Counts the model state (:func:`model_state_bytes`) plus the bytes of every distinct
    storage autograd saves for backward during one forward pass (reset at the start of
    each forward by a pre-hook on ``model``). When a module's forward finishes with the
    total past the cap, a forward hook raises ``torch.OutOfMemoryError`` there, part-way
    through the model's forward pass. (The saved-tensor hook only counts: raising from
    inside autograd's saving code leaks the half-saved graph in torch 2.x, so the raise
    happens in plain Python between operations.) ``peak_step_bytes`` is the largest total
    seen (bytes). Use as a context manager around the training loop; it keeps no
    reference to the model after it exits.
    """

    def __init__(self, model: nn.Module, cap_bytes: int, batch_size: int | None = None):
        self.model: nn.Module | None = model
        self.cap_bytes = int(cap_bytes)
        self.batch_size = batch_size
        self.base_bytes = model_state_bytes(model)
        self.step_bytes = self.base_bytes
        self.peak_step_bytes = self.base_bytes
        self._skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
        self._seen: set[int] = set()
        self._handles: list = []
        self._hooks = None

    def _reset(self, *_args) -> None:
        self._seen.clear()
        self.step_bytes = self.base_bytes

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._skip and ptr not in self._seen:
            self._seen.add(ptr)
            self.step_bytes += storage.nbytes()
            self.peak_step_bytes = max(self.peak_step_bytes, self.step_bytes)
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def _check(self, *_args) -> None:
        if self.step_bytes > self.cap_bytes:
            what = f"batch {self.batch_size}" if self.batch_size else "this batch"
            raise torch.OutOfMemoryError(
                f"{what} needs more than the CPU memory cap of {self.cap_bytes / 1e6:.0f} MB "
                f"(memory_cap_bytes, a stand-in for a GPU's memory): model state "
                f"{self.base_bytes / 1e6:.1f} MB + activations saved so far "
                f"{(self.step_bytes - self.base_bytes) / 1e6:.1f} MB, part-way through the forward pass")

    def __enter__(self) -> CpuMemoryCap:
        if self.model is None:
            raise LabError("A CpuMemoryCap is used once; make a new one for the next epoch.")
        if self.base_bytes > self.cap_bytes:
            raise torch.OutOfMemoryError(
                f"the model state alone ({self.base_bytes / 1e6:.1f} MB) exceeds the CPU memory cap of "
                f"{self.cap_bytes / 1e6:.0f} MB (memory_cap_bytes)")
        self._handles = [self.model.register_forward_pre_hook(self._reset)]
        self._handles += [m.register_forward_hook(self._check) for m in self.model.modules()]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
            self._hooks = None
        for h in self._handles:
            h.remove()
        self._handles = []
        self._seen.clear()
        self.model = None


def _gpu_memory_fraction(device: torch.device, settings: Settings) -> float | None:
    """The per-process fraction to set on a GPU from ``memory_fraction`` / ``memory_cap_bytes``."""
    fractions = []
    if settings.memory_fraction is not None:
        fractions.append(check_memory_fraction(settings.memory_fraction))
    if settings.memory_cap_bytes:
        total = torch.cuda.get_device_properties(device).total_memory
        fractions.append(min(1.0, settings.memory_cap_bytes / total))
    return min(fractions) if fractions else None


# --------------------------------------------------------------------------- the sweep


def _config(settings: Settings, batch_size: int, *, train_images: int, test_images: int,
            dataset: str, device: str, num_workers: int) -> dict[str, Any]:
    """The configuration that identifies one measurement in the store (its resume key)."""
    return {"model": "resnet18", "width": settings.width, "batch_size": batch_size, "lr": SPEC_LR,
            "epochs": settings.epochs, "reported_epoch": settings.reported_epoch,
            "train_images": train_images, "test_images": test_images, "dataset": dataset,
            "device": device, "num_workers": num_workers, "memory_cap_bytes": settings.memory_cap_bytes,
            "memory_fraction": settings.memory_fraction, "cudnn_benchmark": settings.cudnn_benchmark,
            # only when pinned (CPU): keys of records stored before the field stay valid
            **({"cpu_threads": settings.cpu_threads} if settings.cpu_threads is not None else {})}


def measure(lab, settings: Settings, force: bool = False, verbose: bool = True) -> list[Record]:
    """Run (or resume) the batch-size sweep on ``lab.device``; one record per batch size, in order.

    Each batch size goes through the store's one door, :meth:`~lab_utils.store.ResultStore.run`:
    a batch size stored on this device is not measured again unless ``force``. Stops growing at
    the first out-of-memory (stored): larger batch sizes get ``skipped`` rows (not stored) that
    say why, as does a batch larger than the training set.
    """
    s = settings.validate()
    profile_name, store, dev = lab.profile.name, lab.store, torch.device(lab.device)
    if dev.type != "cuda" and s.memory_fraction is not None:
        raise LabError("memory_fraction limits a GPU's memory; on the CPU use memory_cap_bytes instead.")
    profile = config.PROFILES[profile_name]
    workers = profile.num_workers if s.num_workers is None else s.num_workers
    dev_name = device_name(str(dev))

    # The resume keys need only the sizes and the kind of data; the datasets themselves
    # are built once, on the first batch size that has to be measured, and each batch size
    # gets its own DataLoader over them.
    ds_kind = resolve_dataset(s.dataset)
    synthetic = ds_kind == "synthetic"
    ds_label = "synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10"
    n_train = min(s.train_images or CIFAR10_TRAIN_SIZE, CIFAR10_TRAIN_SIZE)
    n_test = min(s.test_images or CIFAR10_TEST_SIZE, CIFAR10_TEST_SIZE)
    built: list = []

    def loaders():
        if not built:
            built.append(make_loaders(batch_size=s.batch_sizes[0], test_batch_size=profile.test_batch_size,
                                      num_workers=0, train_images=n_train, test_images=n_test,
                                      dataset=ds_kind, seed=s.seed))
        return built[0]

    records: list[Record] = []
    stop_reason: str | None = None
    fraction = _gpu_memory_fraction(dev, s) if dev.type == "cuda" else None
    capped: torch.device | None = None
    apply_training_backends(cudnn_benchmark=s.cudnn_benchmark)
    threads = s.cpu_threads if dev.type == "cpu" else None
    if threads is None:
        s = replace(s, cpu_threads=None)  # not pinned: no thread count in the resume key
    restore = ExitStack()
    try:
        restore.enter_context(pinned_threads(threads))
        if fraction is not None:
            capped = set_memory_fraction(fraction, dev)[1]
        for bs in s.batch_sizes:
            cfg = _config(s, bs, train_images=n_train, test_images=n_test, dataset=ds_kind, device=dev_name,
                          num_workers=workers)
            if stop_reason is not None:
                records.append(_skipped(cfg, stop_reason, synthetic, ds_label, dev, profile_name))
                continue
            if bs > n_train:
                reason = f"larger than the {n_train} training images: not a batch size of this data"
                records.append(_skipped(cfg, reason, synthetic, ds_label, dev, profile_name))
                stop_reason = reason
                continue
            measured: list[int] = []

            def one(bs=bs, measured=measured) -> Record:
                measured.append(bs)
                return _measure_batch(bs, s, loaders(), dev, workers)

            # the store's one reuse check (same device name and count); the config names the device too
            rec = store.run(EXPERIMENT, cfg, one, force=force, hardware=hardware_summary(str(dev), 1))
            records.append(rec)
            if verbose:
                print(_summary_line(rec, "measured" if measured else "from the store"), flush=True)
            if rec.status == "oom":
                stop_reason = f"not tried: batch {bs} already ran out of memory"
    finally:
        if capped is not None:
            set_memory_fraction(1.0, capped)
        restore.close()  # the torch thread count from before the sweep
    return records


def _skipped(cfg: dict, reason: str, synthetic: bool, dataset: str, dev: torch.device,
             profile: str) -> Record:
    """A row that was deliberately not measured (not stored: it follows from another row)."""
    return Record(experiment=EXPERIMENT, config=cfg, status="skipped", reason=reason, profile=profile,
                  synthetic=synthetic, dataset=dataset, hardware=hardware_summary(str(dev), 1))


def _loader(dataset, batch_size: int, shuffle: bool, workers: int, seed: int) -> DataLoader:
    g = torch.Generator()
    g.manual_seed(seed)
    return DataLoader(dataset, batch_size=batch_size, shuffle=shuffle, generator=g if shuffle else None,
                      num_workers=workers, pin_memory=torch.cuda.is_available(),
                      persistent_workers=workers > 0)


def _measure_batch(bs: int, s: Settings, base, dev: torch.device, workers: int) -> Record:
    """Train ``s.epochs`` epochs at batch ``bs``; an out-of-memory failure becomes an ``oom`` record."""
    common = {"synthetic": base.synthetic, "dataset": base.dataset_name,
              "hardware": hardware_summary(str(dev), 1)}
    held: dict[str, Any] = {}  # everything that holds memory, so that it can be dropped on OOM
    _free_memory(dev)
    # Only out-of-memory is expected (everything else propagates). catch_oom keeps the
    # reason and drops the exception and its traceback, whose frames hold the batch and
    # the half-built autograd graph, so free_memory below can give that memory back.
    with catch_oom() as oom:
        metrics = _train_and_evaluate(bs, s, base, dev, workers, held)
    held.clear()
    _free_memory(dev)
    if oom:
        return Record(experiment=EXPERIMENT, config={}, status="oom", reason=oom.reason,
                      metrics={"batch_size": bs}, **common)
    return Record(experiment=EXPERIMENT, config={}, metrics=metrics, **common)


def _train_and_evaluate(bs: int, s: Settings, base, dev: torch.device, workers: int,
                        held: dict[str, Any]) -> dict[str, Any]:
    torch.manual_seed(s.seed)  # every batch size starts from the same weights
    held["train"] = _loader(base.train.dataset, bs, True, workers, s.seed)
    held["test"] = _loader(base.test.dataset, base.test.batch_size, False, workers, s.seed)
    held["model"] = model = ResNet18(width=s.width).to(dev)
    held["optimizer"] = optimizer = make_optimizer(model, lr=SPEC_LR)
    epochs = []
    for epoch in range(1, s.epochs + 1):
        use_cap = bool(s.memory_cap_bytes) and dev.type == "cpu"
        cap = CpuMemoryCap(model, s.memory_cap_bytes, bs) if use_cap else None
        with cap if cap is not None else nullcontext():
            rec = run_epoch(model, held["train"], optimizer, dev, epoch=epoch,
                            desc=f"batch {bs}, epoch {epoch}")
        epochs.append((rec, cap))
    ev = evaluate(model, held["test"], dev)
    rep, rep_cap = epochs[s.reported_epoch - 1]
    warm = epochs[0][0]
    # the epoch's record, less what one process without a process group never has
    metrics = {k: v for k, v in asdict(rep).items() if k not in _ONE_PROCESS_ABSENT}
    metrics.update({
        "batch_size": bs,
        "reported_epoch": s.reported_epoch,
        "warmup_train_seconds": warm.train_seconds,
        "warmup_data_loading_seconds": warm.data_loading_seconds,
        "warmup_epoch_seconds": warm.epoch_seconds,
        "steps_per_epoch": rep.steps,
        **ev.as_dict(),
    })
    if rep_cap is not None:
        metrics["cpu_cap_peak_step_bytes"] = rep_cap.peak_step_bytes
    return metrics


def _summary_line(rec: Record, where: str) -> str:
    bs = rec.config.get("batch_size")
    if rec.status == "ok":
        m = rec.metrics
        return (f"batch {bs:>6}: {where}; epoch {m.get('reported_epoch', 2)} training "
                f"{m['train_seconds']:.2f} s, {m['images_per_s']:.0f} images/s, "
                f"loader wait {m['data_loading_seconds']:.2f} s")
    return f"batch {bs:>6}: {where}; {rec.status}: {rec.reason}"


# --------------------------------------------------------------------------- FLOPs


@dataclass
class FlopsPerImage:
    """FLOPs of ResNet-18 (this width) per 32x32 image, from ``torch.utils.flop_counter``."""

    width: int
    forward_flops: float
    train_flops: float  # forward + backward (weight and input gradients); optimizer not counted


def flops_per_image(width: int = 64, batch: int = 2) -> FlopsPerImage:
    """Count forward and training FLOPs per image of ResNet-18 at ``width``.

    The model runs on the ``meta`` device: shapes propagate and the counter sees every
    convolution and matmul, but no arithmetic is done, so this is instant at any width.
    """
    check_positive_int(width, "model width")
    check_positive_int(batch, "batch")
    with torch.device("meta"):
        model = ResNet18(width=width)
    fc = count_flops(model, torch.randn(batch, 3, 32, 32, device="meta"))
    return FlopsPerImage(width=width, forward_flops=fc.forward_flops_per_sample,
                         train_flops=fc.train_flops_per_sample)
