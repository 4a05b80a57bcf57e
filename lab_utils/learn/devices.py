"""The devices a step runs on: the default device, DataParallel's GPUs, and their memory high-water marks
(bytes), as :func:`lab_utils.learn.loop.run_epoch` records them."""

from __future__ import annotations

import torch
from torch import nn


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def wrap_data_parallel(model: nn.Module, device_ids: list[int] | None = None) -> nn.Module:
    """``nn.DataParallel`` over ``device_ids`` (default: all visible GPUs): one process scatters the
    batch from GPU 0, replicates the model, runs the replicas in threads and gathers outputs and
    gradients back onto GPU 0. It is not a ring all-reduce."""
    return nn.DataParallel(model, device_ids=device_ids)


def peak_memory(device: torch.device) -> int | None:
    """Device memory high-water mark since the last reset; None where not tracked (CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def model_devices(model: nn.Module, device: torch.device) -> list[torch.device]:
    """The devices a model's step allocates on: every GPU of an ``nn.DataParallel`` (its
    ``device_ids``), else ``device`` alone."""
    if isinstance(model, nn.DataParallel) and device.type == "cuda" and model.device_ids:
        return [torch.device("cuda", i) for i in model.device_ids]  # DataParallel keeps them as ints
    return [device]
