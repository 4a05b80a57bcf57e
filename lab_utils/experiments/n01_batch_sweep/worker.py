"""The batch-size sweep's worker (notebook 01): one configuration = one batch size, trained and evaluated.

Launched like every GPU run (one process, no process group); on a CPU the plan runs it in the notebook's
process. Each configuration is its record's config (written by
:func:`lab_utils.experiments.n01_batch_sweep.experiment.plan`): a fresh ResNet-18 of ``width`` (the same
initial weights at every batch size) with the spec's SGD trains ``epochs`` epochs at ``batch_size`` through
:func:`lab_utils.learn.loop.run_epoch` (epoch 1 warms up, epoch ``reported_epoch`` is reported), then one
evaluation pass on the test split. The reported time is that epoch's ``train_seconds``: host-to-device copies,
forward, loss, backward, optimizer step, each synchronized; the loader waits (``data_loading_seconds``) and
the evaluation are not in it. Peak memory is ``torch.cuda.max_memory_allocated`` of the reported epoch (None
on a CPU; there the memory cap counts ``cpu_cap_peak_step_bytes``), ``memory_limit_bytes`` what the run may
hold. The FLOP rate is ``train_flops_per_image`` x ``images_per_s`` against the device's peak (none when
unknown).

Out of memory is a result: the harness turns it into the ``oom`` record and ends the job, and the
plan's rule marks the larger batch sizes "not tried". To reach it on purpose:

- GPU: ``memory_fraction`` (or ``memory_cap_bytes`` as a fraction of the device's memory) goes to
  ``torch.cuda.set_per_process_memory_fraction``: the caching allocator raises the real
  ``torch.OutOfMemoryError`` once the process would hold more than that share.
- CPU: ``memory_cap_bytes`` is enforced by :class:`CpuMemoryCap` on the real bytes of the model
  state and of the activations autograd saves (only the limit is a policy, as on the GPU).
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.config import get_profile, loader_worker_options
from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import fp32_training_precision, peak_flops_per_s
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.memory import set_memory_fraction
from lab_utils.engine.records import Record
from lab_utils.experiments.shared.data import CifarLoaders, make_loaders
from lab_utils.learn.errors import LabError
from lab_utils.learn.evaluation import evaluate
from lab_utils.learn.flops import mfu
from lab_utils.learn.loop import make_optimizer, run_epoch
from lab_utils.learn.models import ResNet18, flops_per_image

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1

#: What an epoch of one process without a process group never has (not copied into the record).
_ONE_PROCESS_ABSENT = ("lr", "skew_wait_seconds", "allreduce_seconds", "exposed_tail_seconds", "global_loss",
                      "global_accuracy", "global_images")


def prepare(job: Job, ctx: DistContext) -> CifarLoaders:
    """The data sets (and the test loader), built once for every batch size of the job."""
    c = job.configs[0]
    return make_loaders(batch_size=c["batch_size"], test_batch_size=get_profile(job.profile).test_batch_size,
                        num_workers=c["num_workers"], train_images=c["train_images"],
                        test_images=c["test_images"], dataset=c["dataset"], seed=job.options.get("seed", 0))


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, base: CifarLoaders) -> list[Record]:
    """Train ``epochs`` epochs at ``batch_size``, then evaluate; the record of the reported epoch."""
    c, dev, bs, seed = config, ctx.device, config["batch_size"], job.options.get("seed", 0)
    limit = c["memory_cap_bytes"] or None   # CPU: the cap CpuMemoryCap enforces (None: no cap)
    if dev.type == "cuda":
        _cap_gpu_memory(c, dev)
        limit = _gpu_limit_bytes(c, dev)
    apply_training_backends(cudnn_benchmark=c["cudnn_benchmark"])
    g = torch.Generator()
    g.manual_seed(seed)
    train = DataLoader(base.train.dataset, batch_size=bs, shuffle=True, generator=g,
                       **loader_worker_options(c["num_workers"], base.train.pin_memory))
    torch.manual_seed(seed)  # every batch size starts from the same weights
    model = ResNet18(width=c["width"]).to(dev)
    optimizer = make_optimizer(model, lr=c["lr"])
    capped = bool(c["memory_cap_bytes"]) and dev.type == "cpu"
    epochs, caps = [], []
    for epoch in range(1, c["epochs"] + 1):
        caps.append(CpuMemoryCap(model, c["memory_cap_bytes"], bs) if capped else None)
        with caps[-1] or nullcontext():
            epochs.append(run_epoch(model, train, optimizer, dev, epoch=epoch,
                                    desc=f"batch {bs}, epoch {epoch}"))
    ev = evaluate(model, base.test, dev)
    rep, warm, cap = epochs[c["reported_epoch"] - 1], epochs[0], caps[c["reported_epoch"] - 1]
    hardware = ctx.hardware()
    flops = flops_per_image(c["width"]).train_flops
    precision = fp32_training_precision(hardware["device_name"])
    rate = mfu(flops, rep.images_per_s, peak_flops_per_s(hardware["device_name"], precision), 1)
    metrics = {k: v for k, v in rep.as_dict().items() if k not in _ONE_PROCESS_ABSENT}
    metrics.update(
        batch_size=bs, reported_epoch=c["reported_epoch"], steps_per_epoch=rep.steps,
        ms_per_step=1e3 * rep.train_seconds / max(rep.steps, 1), warmup_train_seconds=warm.train_seconds,
        warmup_data_loading_seconds=warm.data_loading_seconds, warmup_epoch_seconds=warm.epoch_seconds,
        train_flops_per_image=flops, train_tflops_per_s=flops * rep.images_per_s / 1e12,
        peak_precision=precision, percent_of_peak=None if rate is None else 100 * rate,
        memory_limit_bytes=limit, **ev.as_dict())
    if cap is not None:
        metrics["cpu_cap_peak_step_bytes"] = cap.peak_step_bytes
    return [Record(job.experiment, dict(config), metrics, profile=job.profile, synthetic=base.synthetic,
                   dataset=base.dataset_name, hardware=hardware)]


def _gpu_fractions(c: dict[str, Any], total_bytes: int) -> list[float]:
    """The shares of the GPU that ``memory_fraction`` and ``memory_cap_bytes`` ask for (none: no cap)."""
    fractions = [] if c["memory_fraction"] is None else [c["memory_fraction"]]
    if c["memory_cap_bytes"]:
        fractions.append(min(1.0, c["memory_cap_bytes"] / total_bytes))
    return fractions


def _cap_gpu_memory(c: dict[str, Any], device: torch.device) -> None:
    """The per-process share of the GPU from ``memory_fraction`` / ``memory_cap_bytes`` (the smaller)."""
    fractions = _gpu_fractions(c, torch.cuda.get_device_properties(device).total_memory)
    if fractions:
        set_memory_fraction(min(fractions), device)


def _gpu_limit_bytes(c: dict[str, Any], device: torch.device) -> int:
    """The bytes the run may hold on the GPU: its total memory times the share :func:`_cap_gpu_memory` set
    (all of it without a cap)."""
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total * min(_gpu_fractions(c, total), default=1.0))


def model_state_bytes(model: nn.Module) -> int:
    """Bytes of parameters + gradients + SGD's momentum (one state tensor per parameter) + buffers."""
    p = sum(t.numel() * t.element_size() for t in model.parameters())
    b = sum(t.numel() * t.element_size() for t in model.buffers())
    return 3 * p + b


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

    def _check(self, *_args) -> None:
        if self.step_bytes > self.cap_bytes:
            what = f"batch {self.batch_size}" if self.batch_size else "this batch"
            # what the bytes are is left out on purpose: notebook 01 asks it (Q1, Exercise 01-c)
            raise torch.OutOfMemoryError(
                f"{what} needs more than the CPU memory cap of {self.cap_bytes / 1e6:.0f} MB "
                f"(memory_cap_bytes, a stand-in for a GPU's memory): {self.step_bytes / 1e6:.1f} MB counted "
                "part-way through the forward pass")

    def __enter__(self) -> CpuMemoryCap:
        if self.model is None:
            raise LabError("A CpuMemoryCap is used once; make a new one for the next epoch.")
        if self.base_bytes > self.cap_bytes:
            raise torch.OutOfMemoryError(
                f"the model state alone ({self.base_bytes / 1e6:.1f} MB) exceeds the CPU memory cap of "
                f"{self.cap_bytes / 1e6:.0f} MB (memory_cap_bytes)")
        self._handles = [self.model.register_forward_pre_hook(self._reset)]
        self._handles += [m.register_forward_hook(self._check) for m in self.model.modules()]
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
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


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
