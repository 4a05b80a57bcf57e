"""Notebook 06's experiments (the SPEC's *Part 2*: an earlier project's GPT trained with DDP): scaling over
devices, gradient accumulation, and the model notebook 07 quantizes. Each is a plan of runs of
:mod:`lab_utils.experiments.n06_gpt_ddp.worker` carried out by :func:`lab_utils.engine.plan.measure`:

- ``gpt_scaling`` (:func:`plan`): every (per-device batch, devices), one launch per device count, the
  one-device run too (T(1) and T(N) through the same path). Without GPUs the devices are gloo CPU
  processes of ``cores / cpu_processes`` threads each; a device count the machine lacks is a row
  "needs N GPUs". An epoch is one pass over the training windows shared by the ranks (strong scaling
  of the epoch); epoch 1 warms up, the last is reported.
- ``gpt_accumulation`` (:func:`plan_accumulation`): a constant effective batch per device, micro-batch x
  accumulation steps, one group (after an out-of-memory the larger micro-batches are not tried).
- ``gpt_train`` (:func:`plan_final`): the run on every device whose checkpoint
  (:func:`checkpoint_path`, a job option) notebook 07 uses.

Tables: :mod:`~lab_utils.experiments.n06_gpt_ddp.tables`; samples:
:mod:`~lab_utils.experiments.n06_gpt_ddp.samples`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar

from lab_utils.engine import profiles
from lab_utils.engine.config import check_batch_sizes, results_dir
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import Experiment, Run
from lab_utils.experiments.n06_gpt_ddp import worker as gpt_train
from lab_utils.experiments.n06_gpt_ddp.worker import TrainConfig
from lab_utils.experiments.shared import estimates
from lab_utils.experiments.shared.text_data import TRAIN_FRACTION, resolve_corpus
from lab_utils.learn.errors import LabError, check_positive_int
from lab_utils.learn.models.gpt_sizes import gpt_config, train_flops_per_token

# checkpoint_path is also this module's: notebook 06 forces the final run when its file is missing
__all__ = ["ACCUMULATION", "ACCUMULATION_EXPERIMENT", "EXPERIMENTS", "SCALING", "SCALING_EXPERIMENT",
           "Settings", "TRAIN", "TRAIN_EXPERIMENT", "checkpoint_path", "cost", "doctor_settings",
           "place", "plan", "plan_accumulation", "plan_final", "train_run"]

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
    scaling_steps_per_epoch: int | None = None
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

    QUICK: ClassVar[dict[str, Any]] = dict(
        size="tiny", dtype="fp32", lr=3e-3, max_chars=60_000,
        scaling_epochs=2, effective_batch=128, micro_batches=(2, 4, 8, 16, 32, 64, 128),
        accumulation_epochs=2, accumulation_steps_per_epoch=2,
        train_batch_size=16, train_epochs=100, train_max_steps=150, sample_chars=200, timeout_s=600.0)
    FULL: ClassVar[dict[str, Any]] = dict(
        size="small", dtype="bf16", lr=1e-3, stride=32,
        train_batch_size=64, train_epochs=2, sample_chars=500)

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
        self.config(devices=1, batch_size=self.train_batch_size, epochs=self.train_epochs,
                    max_steps=self.train_max_steps)
        return self

    def config(self, **kw: Any) -> TrainConfig:
        """The worker's configuration of one run, checked; the corpus resolved here ($LAB_CORPUS read, a
        missing one refused), so a stored run is reused only for the corpus it was trained on."""
        return TrainConfig(size=self.size, dtype=self.dtype, lr=self.lr, corpus=resolve_corpus(self.corpus),
                           max_chars=self.max_chars, stride=self.stride, val_batches=self.val_batches,
                           **kw).validate()


profiles.register(Settings, "GPT")


def place(devices: int, machine: Machine, cpu_processes: int) -> tuple[str, str | None]:
    """Where ``devices`` ranks run: ``("cuda", None)`` on as many GPUs, ``("cpu", None)`` as gloo CPU
    processes (none with GPUs; at most ``cpu_processes`` and the cores), else (the machine's device, why
    not)."""
    if machine.gpus >= devices:
        return "cuda", None
    procs = min(cpu_processes, machine.cores)
    if machine.gpus == 0 and devices <= procs:
        return "cpu", None
    has = (f"this machine has {machine.gpus}" if machine.gpus
           else f"no GPU here; at most {procs} gloo CPU processes")
    return machine.device, f"needs {devices} GPUs ({has})"


def train_run(experiment: str, s: Settings, machine: Machine, devices: int, label: str,
              group: str | None = None, in_process: bool = False, options: dict[str, Any] | None = None,
              **kw: Any) -> Run:
    """One run of the GPT worker on ``devices`` ranks placed by :func:`place` (CPU processes get the same
    threads whatever their count, so a "device" is the same compute); ``kw``: the configuration's values."""
    device, skip = place(devices, machine, s.cpu_processes)
    cfg = s.config(devices=devices, device_type=device, **kw).config()
    threads = machine.cores // max(1, min(s.cpu_processes, machine.cores)) if device == "cpu" else None
    return Run(experiment, cfg, gpt_train, processes=devices, device=device, group=group, skip=skip,
               in_process=in_process and device == "cpu" and devices == 1, threads=threads,
               timeout_s=s.timeout_s, options=options or {}, label=f"{label} on {devices} x {device}")


def plan(s: Settings, machine: Machine, profile: str) -> list[Run]:
    """Notebook 06, section 2: per-device batch x devices (batch-major, as the table reads), each device
    count one launch; every run launched, the one-device run too."""
    return [train_run(SCALING, s, machine, n, f"batch {b}", f"{SCALING} {n}", batch_size=b,
                      epochs=s.scaling_epochs, steps_per_epoch=s.scaling_steps_per_epoch)
            for b in s.scaling_batch_sizes for n in s.scaling_devices]


def plan_accumulation(s: Settings, machine: Machine, profile: str) -> list[Run]:
    """Section 3: micro-batch x accumulation steps = ``effective_batch`` per device, smallest first, on
    ``accumulation_devices`` (every GPU up to 4; one process on a CPU, in this process)."""
    n = s.accumulation_devices or (min(machine.gpus, 4) or 1)
    return [train_run(ACCUMULATION, s, machine, n, f"micro-batch {mb} x {s.effective_batch // mb}",
                      ACCUMULATION, in_process=True, batch_size=mb,
                      accumulation_steps=s.effective_batch // mb,
                      epochs=s.accumulation_epochs, steps_per_epoch=s.accumulation_steps_per_epoch)
            for mb in s.micro_batches]


def plan_final(s: Settings, machine: Machine, profile: str) -> list[Run]:
    """Section 4: the model notebook 07 quantizes, trained on every device (the CPU: the gloo processes);
    the checkpoint path is a job option, not part of the key; no instrumented pass. The notebook forces the
    run when the checkpoint file is missing (a stored record alone does not bring it back)."""
    n = machine.gpus or min(s.cpu_processes, machine.cores)
    return [train_run(TRAIN, s, machine, n, "final model", options={"save": str(checkpoint_path(profile))},
                      batch_size=s.train_batch_size, epochs=s.train_epochs, max_steps=s.train_max_steps,
                      breakdown_steps=0)]  # its tables are 07's; no breakdown is read


def cost(run: Run) -> float:
    """Seconds of one run on the budget's node, start-up excluded: its training tokens (tiny-Shakespeare's
    training windows x block x epochs, less under a step cap, plus the instrumented pass's steps) x the
    model's FLOPs per token (6N + 12LCT) at :func:`lab_utils.experiments.shared.estimates.gpt_epoch_seconds`'s
    rate, plus 10 % for validation."""
    c = run.config
    mcfg = gpt_config(c["size"])
    block = mcfg.block_size
    windows = (int(TRAIN_FRACTION * estimates.TINY_SHAKESPEARE_CHARS) - block) // (c["stride"] or block)
    per_step = c["devices"] * c["batch_size"] * c["accumulation_steps"] * block
    tokens = c["epochs"] * windows * block
    per_epoch = windows * block // per_step
    if c["steps_per_epoch"]:
        tokens = min(tokens, c["epochs"] * c["steps_per_epoch"] * per_step)
        per_epoch = min(per_epoch, c["steps_per_epoch"])
    if c["max_steps"]:
        tokens = min(tokens, c["max_steps"] * per_step)
    tokens += min(c.get("breakdown_steps", 0), per_epoch) * per_step
    flops = tokens * train_flops_per_token(mcfg)
    return 1.1 * estimates.gpt_epoch_seconds(flops, c["devices"], c["batch_size"])


def doctor_settings(full: Settings) -> Settings:
    """The smallest full-profile configuration: the full model and dtype, the smallest batches, two
    optimizer steps (one of two micro-batches for accumulation), one validation batch, every device count."""
    b, mb = min(full.scaling_batch_sizes), min(full.micro_batches)
    return replace(full, val_batches=1, scaling_batch_sizes=(b,), scaling_epochs=1, scaling_steps_per_epoch=2,
                   micro_batches=(mb,), effective_batch=2 * mb, accumulation_epochs=1,
                   accumulation_steps_per_epoch=1, train_epochs=1, train_max_steps=2)


SCALING_EXPERIMENT = Experiment(SCALING, "06", Settings, plan, cost, doctor_settings,
                                "GPT: DDP scaling at a fixed per-device batch")
ACCUMULATION_EXPERIMENT = Experiment(ACCUMULATION, "06", Settings, plan_accumulation, cost, doctor_settings,
                                     "GPT: gradient accumulation at a constant effective batch")
TRAIN_EXPERIMENT = Experiment(TRAIN, "06", Settings, plan_final, cost, doctor_settings,
                              "GPT: the model notebook 07 quantizes")


def checkpoint_path(profile: str | None = None) -> Path:
    """``results/<profile>/checkpoints/gpt.pt``: where notebook 06 saves the trained GPT."""
    return results_dir(profile) / "checkpoints" / "gpt.pt"


#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (SCALING_EXPERIMENT, ACCUMULATION_EXPERIMENT, TRAIN_EXPERIMENT)
