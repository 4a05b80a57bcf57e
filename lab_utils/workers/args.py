"""The workers' argument types, torch-free: what a parent sends a worker and what keys its records.

Each worker (``python -m lab_utils.workers.<name>``, one process per rank under torchrun)
takes a command line; the parent (an experiment, a SLURM job's plan, the doctor) builds it
from one of these dataclasses (``to_argv``) and the worker parses it back (``from_argv``),
so both sides agree on every option and on the record's ``config`` (the store's resume
key: ``record_config``). Nothing here imports torch or the store, so planning a launch
costs no ``import torch``.

- :class:`WorkerArgs`: the ResNet-18 DDP worker (:mod:`lab_utils.workers.ddp`; notebooks 02, 03, 05);
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from lab_utils.core import config
from lab_utils.core.config import (
    CIFAR10_TEST_SIZE,
    CIFAR10_TRAIN_SIZE,
    DATASET_CHOICES,
    check_batch_size,
    check_choice,
    check_positive_int,
    resolve_dataset,
)
from lab_utils.core.errors import LabError
from lab_utils.core.schedules import DECAYS

__all__ = ["WorkerArgs"]

LR_RULES = ("fixed", "linear")
BACKENDS = ("auto", "nccl", "gloo")


def _flags(obj, skip: tuple[str, ...] = ("out",)) -> list[str]:
    """``--name value`` for every field that is not None (True booleans as a bare flag, False
    left out; tuples comma-separated)."""
    argv: list[str] = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip or value is None:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                argv.append(flag)
        elif isinstance(value, tuple | list):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


# --------------------------------------------------------------------------- the DDP ResNet worker


@dataclass
class WorkerArgs:
    """The DDP worker's command line (``python -m lab_utils.workers.ddp --help``).

    ``batch_size`` is per device (per rank), one value or several (run one after another in
    the same process group, each with a fresh model). ``train_images`` / ``test_images`` of
    None mean the profile's (0 or less: the whole split). ``debug_slow_rank`` /
    ``debug_slow_loader_seconds`` are a TEST KNOB: that rank's loader sleeps so long per batch.
    """

    experiment: str | None = None
    profile: str | None = None
    batch_size: int | tuple[int, ...] = 128
    epochs: int = 2
    width: int = 64
    train_images: int | None = None
    test_images: int | None = None
    dataset: str | None = None   # auto | cifar10 | synthetic; None: $LAB_DATASET, else auto
    num_workers: int | None = None
    lr: float = 0.1
    lr_rule: str = "fixed"
    base_batch: int = 128
    warmup_epochs: float = 0.0
    decay: str = "constant"
    eval: bool = False
    measure_comm: bool = False
    comm_steps: int = 8
    backend: str = "auto"
    bucket_cap_mb: float | None = None
    accumulation_steps: int = 1
    seed: int = 0
    tag: str = ""
    debug_slow_rank: int | None = None
    debug_slow_loader_seconds: float | None = None
    out: str | None = None

    def validate(self) -> WorkerArgs:
        """Raise :class:`LabError` on bad values (before any process group or data)."""
        for b in self.batch_sizes:
            check_batch_size(b, "--batch-size")
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise LabError(f"--bucket-cap-mb must be positive, got {self.bucket_cap_mb}.")
        for what in ("epochs", "width", "base_batch", "comm_steps", "accumulation_steps"):
            check_positive_int(getattr(self, what), "--" + what.replace("_", "-"))
        if (self.debug_slow_rank is None) != (self.debug_slow_loader_seconds is None):
            raise LabError("--debug-slow-rank and --debug-slow-loader-seconds go together; give both or "
                           "neither.")
        if self.debug_slow_rank is not None and self.debug_slow_rank < 0:
            raise LabError(f"--debug-slow-rank must be a rank (0 or more), got {self.debug_slow_rank}.")
        if self.debug_slow_loader_seconds is not None and not self.debug_slow_loader_seconds > 0:
            raise LabError("--debug-slow-loader-seconds must be positive, got "
                           f"{self.debug_slow_loader_seconds}.")
        if self.dataset is not None:
            check_choice(self.dataset, DATASET_CHOICES, "--dataset")
        check_choice(self.lr_rule, LR_RULES, "--lr-rule")
        check_choice(self.decay, DECAYS, "--decay")
        check_choice(self.backend, BACKENDS, "--backend")
        if not self.lr > 0:
            raise LabError(f"--lr must be positive, got {self.lr}.")
        if not 0 <= self.warmup_epochs <= self.epochs:
            raise LabError(f"--warmup-epochs must be between 0 and --epochs ({self.epochs}), "
                           f"got {self.warmup_epochs}.")
        if self.num_workers is not None and self.num_workers < 0:
            raise LabError(f"--num-workers must be 0 or more, got {self.num_workers}.")
        return self

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The per-device batch sizes to run (one or several)."""
        b = self.batch_size
        return tuple(b) if isinstance(b, tuple | list) else (b,)

    def for_batch(self, batch_size: int) -> WorkerArgs:
        """A copy with a single per-device batch size."""
        return replace(self, batch_size=int(batch_size))

    def to_argv(self) -> list[str]:
        """The command-line arguments that reproduce these settings (``--out`` left to the launcher)."""
        return _flags(self)

    def resolved(self) -> WorkerArgs:
        """A copy with profile, image counts, workers and dataset filled in from the profile."""
        prof = config.get_profile(self.profile)
        train = self.train_images if self.train_images is not None else prof.train_images
        test = self.test_images if self.test_images is not None else prof.test_images
        return replace(
            self, profile=prof.name,
            train_images=CIFAR10_TRAIN_SIZE if not train or train <= 0 else min(train, CIFAR10_TRAIN_SIZE),
            test_images=CIFAR10_TEST_SIZE if not test or test <= 0 else min(test, CIFAR10_TEST_SIZE),
            num_workers=self.num_workers if self.num_workers is not None else prof.num_workers,
            dataset=resolve_dataset(self.dataset))

    def record_config(self, world_size: int, backend: str, record: str = "aggregate",
                      rank: int | None = None) -> dict[str, Any]:
        """The record's ``config`` (call on :meth:`resolved` single-batch args). Stable: used for resume."""
        if not isinstance(self.batch_size, int):
            raise ValueError("record_config needs a single batch size: use for_batch(b) first")
        device_type = "cuda" if backend == "nccl" else "cpu"
        cfg = {
            "method": "DDP", "record": record, "rank": rank, "devices": world_size,
            "backend": backend, "device_type": device_type,
            "batch_size": self.batch_size,
            "global_batch": self.batch_size * world_size * self.accumulation_steps,
            "epochs": self.epochs, "width": self.width, "train_images": self.train_images,
            "test_images": self.test_images, "dataset": self.dataset, "num_workers": self.num_workers,
            "lr": self.lr, "lr_rule": self.lr_rule, "base_batch": self.base_batch,
            "warmup_epochs": self.warmup_epochs, "decay": self.decay, "eval": self.eval,
            "measure_comm": self.measure_comm, "comm_steps": self.comm_steps if self.measure_comm else None,
            "bucket_cap_mb": self.bucket_cap_mb,
            "seed": self.seed, "tag": self.tag,
        }
        # Present only when used, so that the configs (and store keys) of ordinary runs, and
        # of records written before these options existed, stay what they were.
        if self.accumulation_steps != 1:
            cfg["accumulation_steps"] = self.accumulation_steps
        if self.debug_slow_rank is not None:
            cfg["debug_slow_rank"] = self.debug_slow_rank
            cfg["debug_slow_loader_seconds"] = self.debug_slow_loader_seconds
        return cfg

    @staticmethod
    def parser() -> argparse.ArgumentParser:
        d = WorkerArgs()
        p = argparse.ArgumentParser(prog="python -m lab_utils.workers.ddp",
                                    description="DDP training worker: ResNet-18 on CIFAR-10, under torchrun.")
        p.add_argument("--experiment", default=None, help="the records' experiment name")
        p.add_argument("--profile", default=None)
        p.add_argument("--batch-size", type=_int_list, default=d.batch_size,
                       help="per device; several comma-separated values run one after another")
        p.add_argument("--epochs", type=int, default=d.epochs)
        p.add_argument("--width", type=int, default=d.width, help="ResNet-18 width (64: the spec model)")
        p.add_argument("--train-images", type=int, default=None, help="default: the profile's; 0 = all")
        p.add_argument("--test-images", type=int, default=None)
        p.add_argument("--dataset", default=d.dataset,
                       help=", ".join(DATASET_CHOICES) + " (default: $LAB_DATASET, else auto)")
        p.add_argument("--num-workers", type=int, default=None)
        p.add_argument("--lr", type=float, default=d.lr)
        p.add_argument("--lr-rule", default=d.lr_rule, help="fixed | linear (lr x global batch / base batch)")
        p.add_argument("--base-batch", type=int, default=d.base_batch)
        p.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs)
        p.add_argument("--decay", default=d.decay, help=", ".join(DECAYS))
        p.add_argument("--eval", action="store_true", help="test loss/accuracy after every epoch")
        p.add_argument("--measure-comm", action="store_true",
                       help="time the all-reduces with a comm hook and run the no_sync probe")
        p.add_argument("--comm-steps", type=int, default=d.comm_steps)
        p.add_argument("--backend", default=d.backend, help=", ".join(BACKENDS))
        p.add_argument("--bucket-cap-mb", type=float, default=None)
        p.add_argument("--accumulation-steps", type=int, default=d.accumulation_steps)
        p.add_argument("--seed", type=int, default=d.seed)
        p.add_argument("--tag", default=d.tag)
        p.add_argument("--debug-slow-rank", type=int, default=None, help="TEST KNOB")
        p.add_argument("--debug-slow-loader-seconds", type=float, default=None, help="TEST KNOB")
        p.add_argument("--out", default=None, help="rank 0 appends the records here (JSON lines)")
        return p

    @classmethod
    def from_argv(cls, argv: list[str] | None = None) -> WorkerArgs:
        """Parse and check a command line (raises :class:`LabError` on bad values)."""
        return cls(**vars(cls.parser().parse_args(argv))).validate()


def _int_list(text: str) -> int | tuple[int, ...]:
    """``"32"`` -> 32, ``"32,128"`` -> (32, 128)."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected whole numbers separated by commas: {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one batch size")
    return values[0] if len(values) == 1 else values


