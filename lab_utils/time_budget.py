"""How long each notebook takes in the ``full`` profile on a GPU node: an estimate to book GPU hours by.

No full-profile run of the lab on a GPU exists yet, so every number here is an
**estimate (no GPU run yet)**, built from what the lab knows without one:

- *what the full profile runs*: batch sizes, epochs, device counts and runs, read from the
  full-profile settings of the experiment modules (``profiles.settings(sweep.Settings, "full")``, ...),
  so the estimate follows the settings when they change;
- *how long one spec-path ResNet-18 epoch takes*: the larger of a FLOP estimate
  (training FLOPs / an assumed fraction of the GPU's peak, :mod:`lab_utils.core.hardware`) and
  the epoch times earlier cohorts published (V100 / RTX 8000 class, SPEC.md). The spec
  path feeds the GPU from a 2-worker PIL ``DataLoader``; a faster GPU does not make that
  loader faster, so the published times are kept as a floor: an H100 is not assumed to
  beat them on the spec path;
- *fixed costs*: notebook start-up, one ``torchrun`` launch per DDP run, ``torch.compile``.

The node assumed is 4 x H100 SXM (bf16 989, TF32 495 TFLOP/s dense). Notebooks are
assumed to run in order (01 ... 08), so a later notebook reuses what an earlier one stored
(notebook 03 takes T(1) from notebook 02; notebook 07 the GPT checkpoint of notebook 06).

>>> budget_table()            # doctest: +SKIP  (one row per notebook, and a total)
>>> budget_line("01")         # doctest: +SKIP  (the one-line Markdown a notebook shows)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lab_utils import questions
from lab_utils.core import anchors, profiles
from lab_utils.core.data import CIFAR10_TRAIN_SIZE
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import peak_flops_per_s
from lab_utils.experiments import comm, fastpath, gpt, large_batch, quantize, scaling, sweep
from lab_utils.models.gpt import gpt_config, train_flops_per_token

#: The label every estimate carries until a full-profile GPU run replaces it.
LABEL = "estimate (no GPU run yet)"
#: The node the estimate is for.
GPU_NAME = "NVIDIA H100 80GB HBM3"  # the torch name of the H100 SXM
NODE = "4 x H100 SXM"

# --- assumptions (each one stated in ASSUMPTIONS below)
#: Training FLOPs per image of the spec ResNet-18 (width 64), 3.329 GFLOP (1.111 forward)
#: (torch.utils.flop_counter; ``sweep.flops_per_image(64).train_flops``, checked by a test).
RESNET_TRAIN_FLOPS_PER_IMAGE = 3.329e9
#: Achieved fraction of the dense peak: ResNet-18 on 32x32 images (TF32 for the fp32 spec
#: path, bf16 for the fast path). 30 % is optimistic for so small an image.
RESNET_PEAK_FRACTION = 0.30
#: A 10M-parameter character GPT is kernel-launch bound: a small fraction of the bf16 peak.
GPT_PEAK_FRACTION = 0.05
# The earlier cohorts' published epoch-2 seconds are read from lab_utils.core.anchors: the first
# cohort's Table 1 by (GPUs, per-GPU batch), the other cohort's DataParallel by (GPUs, GLOBAL batch).
_TOKENS = anchors.ACCUMULATION_TOKENS_PER_S
_MB_SMALL, _MB_LARGE = min(_TOKENS), max(_TOKENS)
#: Earlier GPT study: tokens/s grew ~7.6x from micro-batch 16 to 1024 (2.1k -> 16k): as mb^0.49.
GPT_MICRO_BATCH_EXPONENT = math.log(_TOKENS[_MB_LARGE] / _TOKENS[_MB_SMALL]) / math.log(_MB_LARGE / _MB_SMALL)
GPT_REFERENCE_MICRO_BATCH = _MB_LARGE
TINY_SHAKESPEARE_CHARS = 1_115_394
TEST_PASS_FRACTION = 0.2  # a test pass reads 10,000 images, 1/5 of a training epoch, at the same rate

NOTEBOOK_START_S = 60.0   # kernel, imports, session checks, CIFAR-10 into memory
IN_PROCESS_RUN_S = 15.0   # model build, loader workers, cuDNN autotuning, warm-up
LAUNCH_S = 40.0           # one torchrun: process start, NCCL init, data per rank
COMPILE_S = 90.0          # torch.compile of ResNet-18 (mode default), once per compiled run

_FIRST = anchors.FIRST_COHORT_TABLE1_SECONDS
_FIRST_ONE_GPU = " / ".join(f"{_FIRST[(1, b)]:g}" for b in (32, 128, 512))
_FIRST_FOUR_GPUS = " / ".join(f"{_FIRST[(4, b)]:g}" for b in (32, 128, 512))
_OTHER = anchors.OTHER_COHORT_SECONDS
_OTHER_ROWS = "; ".join(f"{n} GPU{'s' if n > 1 else ''}: " + " / ".join(f"{_OTHER[(n, g)]:g}" for g in
                                                                     sorted({g for k, g in _OTHER if k == n}))
                        for n in sorted({n for n, _ in _OTHER})) + " s at global batch " + " / ".join(
    str(g) for g in sorted({g for _, g in _OTHER}))

ASSUMPTIONS: tuple[str, ...] = (
    f"Node: {NODE} (dense peaks from lab_utils.core.hardware: bf16 989, TF32 495 TFLOP/s). "
    "Notebooks run in order, so a later notebook reuses what an earlier one stored.",
    "Spec-path ResNet-18 epoch = the larger of (a) 50,000 images x 3.33 GFLOP "
    f"/ ({RESNET_PEAK_FRACTION:.0%} of the TF32 peak x GPUs), about 1 s, and (b) the epoch times "
    f"the earlier cohort published ({_FIRST_ONE_GPU} s on 1 GPU, {_FIRST_FOUR_GPUS} s on 4 at 32 / 128 / "
    "512 per GPU; V100 class). (b) wins: the spec path's 2-worker loader, not the GPU, sets the pace, so "
    "an H100 is not assumed faster. Batches above 512 take the 512 time.",
    "DataParallel N x b (global batch N x b): the larger of the 1-GPU spec-path epoch at the global batch "
    "(one process feeds every GPU through one loader) and the other cohort's DataParallel epoch on N GPUs "
    "(it measured a FIXED GLOBAL batch: epoch wall-clock, loader included) at the nearest global batch "
    f"at or below N x b (its times fall as the batch grows, so this errs long): {_OTHER_ROWS}.",
    f"GPT (notebook 06): 6N + 12LCT FLOPs per token at {GPT_PEAK_FRACTION:.0%} of the bf16 peak "
    f"at micro-batch {_MB_LARGE}, falling as micro-batch^{GPT_MICRO_BATCH_EXPONENT:.2f} below it (the "
    f"earlier study's {_TOKENS[_MB_SMALL] / 1e3:g}k -> {_TOKENS[_MB_LARGE] / 1e3:g}k tokens/s from "
    f"{_MB_SMALL} to {_MB_LARGE}).",
    f"Fixed costs: {NOTEBOOK_START_S:.0f} s per notebook, {LAUNCH_S:.0f} s per torchrun launch, "
    f"{IN_PROCESS_RUN_S:.0f} s per in-process run, {COMPILE_S:.0f} s per torch.compile; "
    "a test pass = 1/5 of a training epoch.",
    "Every batch size of the sweep is counted as if it fits (the out-of-memory ones end sooner): "
    "an upper estimate, which is what booking needs.",
)

#: The notebooks and their topics; what each answers comes from :mod:`lab_utils.questions`.
NOTEBOOKS: dict[str, str] = {
    "00": "environment", "01": "batch-size sweep", "02": "multi-GPU scaling",
    "03": "compute vs communication", "04": "all-reduce bandwidth", "05": "large-batch training",
    "06": "GPT with DDP", "07": "int8 quantization", "08": "speed limits",
}


def answers(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: what a notebook answers (the README's question map)."""
    return questions.labels_for(_check(notebook)).replace(questions.PART2, "Part 2 project")


@dataclass(frozen=True)
class Part:
    """One piece of a notebook's estimated time."""

    what: str
    seconds: float
    gpus: int = 1


def spec_epoch_seconds(devices: int, batch: int) -> float:
    """Estimated seconds of one spec-path ResNet-18 epoch: ``devices`` GPUs, ``batch`` per GPU."""
    known = sorted(b for d, b in _FIRST if d == devices)
    flop_s = CIFAR10_TRAIN_SIZE * RESNET_TRAIN_FLOPS_PER_IMAGE / (
        devices * RESNET_PEAK_FRACTION * peak_flops_per_s(GPU_NAME, "tf32"))
    if known:
        nearest = max([b for b in known if b <= batch] or [known[0]])
        anchor = _FIRST[(devices, nearest)]
    else:  # more GPUs than the cohorts had: the 1-GPU time split evenly
        anchor = spec_epoch_seconds(1, batch) / devices
    return max(anchor, flop_s)


def dp_epoch_seconds(devices: int, batch: int) -> float:
    """Estimated seconds of one DataParallel epoch on ``devices`` GPUs at ``batch`` per GPU (global
    batch ``devices x batch``): the larger of

    - the 1-GPU spec-path epoch at the global batch: one process feeds every GPU through one loader,
      so DataParallel is not assumed faster than one GPU fed the same batches;
    - the other cohort's DataParallel epoch on this many GPUs (:data:`anchors.OTHER_COHORT_SECONDS`,
      a fixed GLOBAL batch, wall-clock with the loader) at the nearest global batch it measured at or
      below this one: its times fall as the global batch grows, so the nearest smaller one errs long.
      Absent for a GPU count it did not run.
    """
    global_batch = devices * batch
    floor = spec_epoch_seconds(1, global_batch)
    measured = sorted(g for n, g in _OTHER if n == devices and g <= global_batch)
    return max(floor, _OTHER[(devices, measured[-1])]) if measured else floor


def fast_epoch_seconds(precision: str) -> float:
    """A fast-path epoch (data on the GPU): FLOP-bound at the assumed fraction of the peak."""
    return CIFAR10_TRAIN_SIZE * RESNET_TRAIN_FLOPS_PER_IMAGE / (
        RESNET_PEAK_FRACTION * peak_flops_per_s(GPU_NAME, precision))


def gpt_epoch_seconds(size: str, stride: int | None, devices: int, micro_batch: int) -> float:
    """A GPT epoch over tiny-Shakespeare's training split on ``devices`` GPUs."""
    cfg = gpt_config(size)
    train_tokens = int(0.9 * TINY_SHAKESPEARE_CHARS)
    windows = (train_tokens - cfg.block_size) // (stride or cfg.block_size)
    flops = windows * cfg.block_size * train_flops_per_token(cfg)
    efficiency = min(1.0, micro_batch / GPT_REFERENCE_MICRO_BATCH) ** GPT_MICRO_BATCH_EXPONENT
    return flops / (devices * GPT_PEAK_FRACTION * efficiency * peak_flops_per_s(GPU_NAME, "bf16"))


def _test_pass(devices: int) -> float:
    return TEST_PASS_FRACTION * spec_epoch_seconds(devices, 128)


def notebook_parts(notebook: str) -> list[Part]:
    """The pieces of one notebook's estimated full-profile time."""
    nb = _check(notebook)
    parts = [Part("start-up", NOTEBOOK_START_S, 0)]
    if nb == "01":
        s = profiles.settings(sweep.Settings, "full")
        for b in s.batch_sizes:
            parts.append(Part(f"batch {b}: {s.epochs} epochs",
                              IN_PROCESS_RUN_S + s.epochs * spec_epoch_seconds(1, b)))
    elif nb == "02":
        s = profiles.settings(scaling.Settings, "full")
        for n in s.devices:
            for b in s.batch_sizes:
                parts.append(Part(f"DDP {n} x {b}", LAUNCH_S + s.epochs * spec_epoch_seconds(n, b), n))
                parts.append(Part(f"DataParallel {n} x {b}",
                                  IN_PROCESS_RUN_S + s.epochs * dp_epoch_seconds(n, b), n))
    elif nb == "03":  # T(1) and DataParallel from notebook 02's store; DDP with comm probes runs again
        s = profiles.settings(scaling.Settings, "full")
        for n in s.comm_devices:
            for b in s.batch_sizes:
                parts.append(Part(f"DDP {n} x {b} with comm probes",
                                  LAUNCH_S + (s.epochs + 0.1) * spec_epoch_seconds(n, b), n))
    elif nb == "04":
        s = profiles.settings(comm.Settings, "full")
        for p in s.bench_ranks:
            parts.append(Part(f"all-reduce benchmark, {p} ranks, 8 B ... 1 GiB", LAUNCH_S + 30.0, p))
    elif nb == "05":
        s = profiles.settings(large_batch.Settings, "full")
        for run in large_batch.plan_runs(s, s.devices):
            n = run.devices
            parts.append(Part(f"{run.name}: {n} x {run.batch_per_device}, {s.epochs} epochs + tests",
                              LAUNCH_S + s.epochs * (spec_epoch_seconds(n, run.batch_per_device)
                                                     + _test_pass(n)), n))
        parts.append(Part("communication accounting (a few steps on 2 and 4 ranks)", 2 * LAUNCH_S, s.devices))
    elif nb == "06":
        s = profiles.settings(gpt.Settings, "full")
        for n in s.scaling_devices:
            for b in s.scaling_batch_sizes:
                parts.append(Part(f"scaling {n} x {b}", LAUNCH_S + s.scaling_epochs * 1.1
                                  * gpt_epoch_seconds(s.size, s.stride, n, b), n))
        acc_devices = s.accumulation_devices or 4
        for mb in s.micro_batches:
            parts.append(Part(f"accumulation micro-batch {mb}", LAUNCH_S + s.accumulation_epochs * 1.1
                              * gpt_epoch_seconds(s.size, s.stride, acc_devices, mb), acc_devices))
        parts.append(Part("final model for notebook 07", LAUNCH_S + s.train_epochs * 1.1
                          * gpt_epoch_seconds(s.size, s.stride, 4, s.train_batch_size), 4))
    elif nb == "07":
        s = profiles.settings(quantize.Settings, "full")
        for device in ("cpu", "cuda"):
            per = 45.0 if device == "cpu" else 10.0  # evaluation tokens + timed generation, per variant
            parts.append(Part(f"{len(s.variants)} variants on {device}", len(s.variants) * per))
    elif nb == "08":
        s = profiles.settings(fastpath.Settings, "full")
        spec = spec_epoch_seconds(1, s.batch_size)
        fast = fast_epoch_seconds("bf16")
        parts.append(Part("loader alone (2 pipelines)", 2 * (IN_PROCESS_RUN_S + s.data_min_seconds)))
        for step in s.steps:
            fp32 = step in ("device_loader", "channels_last")  # before the bf16 step
            one = spec if step == "spec" else fast_epoch_seconds("tf32" if fp32 else "bf16")
            parts.append(Part(f"waterfall: {step}", IN_PROCESS_RUN_S + one
                              + (COMPILE_S if step == "compile" else 0.0)))
        parts.append(Part("profiler trace", IN_PROCESS_RUN_S + COMPILE_S))
        if s.accuracy_epochs:
            parts.append(Part(f"accuracy: spec, {s.accuracy_epochs} epochs + tests",
                              IN_PROCESS_RUN_S + s.accuracy_epochs * (spec + _test_pass(1))))
            parts.append(Part(f"accuracy: fastest, {s.accuracy_epochs} epochs + tests",
                              IN_PROCESS_RUN_S + COMPILE_S + s.accuracy_epochs * 1.2 * fast))
    return parts


def _check(notebook: str) -> str:
    nb = str(notebook).strip()
    nb = nb.zfill(2) if nb.isdigit() else nb
    if nb not in NOTEBOOKS:
        raise LabError(f"No notebook {notebook!r}; use one of: {', '.join(NOTEBOOKS)}.")
    return nb


def estimate_minutes(notebook: str) -> int:
    """Estimated full-profile wall time of one notebook, whole minutes rounded up."""
    return math.ceil(sum(p.seconds for p in notebook_parts(notebook)) / 60)


def _gpus(notebook: str) -> str:
    counts = sorted({p.gpus for p in notebook_parts(notebook) if p.gpus})
    if not counts:
        return "any"
    return str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"


def _largest(notebook: str) -> str:
    parts = [p for p in notebook_parts(notebook) if p.what != "start-up"]
    if not parts:
        return "start-up"
    top = max(parts, key=lambda p: p.seconds)
    return f"{len(parts)} runs; longest: {top.what} (~{math.ceil(top.seconds / 60)} min)"


def budget_table():
    """One row per notebook (and a total): estimated full-profile minutes on a 4 x H100 SXM node."""
    import pandas as pd

    rows = [{"notebook": nb, "topic": topic, "answers": answers(nb), "GPUs": _gpus(nb),
             "estimated minutes": estimate_minutes(nb), "what takes the time": _largest(nb)}
            for nb, topic in NOTEBOOKS.items()]
    total = sum(r["estimated minutes"] for r in rows)
    rows.append({"notebook": "all", "topic": "the whole lab, in order", "answers": "",
                 "GPUs": "1-4", "estimated minutes": total,
                 "what takes the time": f"~{total / 60:.1f} GPU-node hours"})
    return pd.DataFrame(rows)


def budget_markdown() -> str:
    """:func:`budget_table` as the Markdown table the README carries (a test keeps them equal)."""
    return budget_table().to_markdown(index=False)


def budget_line(notebook_number: str) -> str:
    """One line of Markdown for a notebook's first cell: its estimated full-profile wall time."""
    nb = _check(notebook_number)
    return (f"**Time budget (full profile, {NODE} node): ~{estimate_minutes(nb)} min** for notebook {nb} "
            f"({NOTEBOOKS[nb]}, GPUs: {_gpus(nb)}), {LABEL}; the quick profile on a CPU takes a few "
            "minutes. How it is estimated: README, *Time budget*.")
