"""How long one run takes on the time budget's node: the cost model every experiment's ``cost`` uses.

No full-profile run of the lab on a GPU exists yet, so every number here is an **estimate (no GPU run yet)**:
a spec-path ResNet-18 epoch is the larger of a FLOP estimate (training FLOPs / an assumed fraction of the
GPU's peak, :mod:`lab_utils.engine.hardware`) and the epoch times earlier cohorts published
(:mod:`lab_utils.experiments.shared.anchors`); the fast path and the GPT are FLOP-bound at an assumed fraction
of the peak; fixed costs are per notebook, per launch, per compilation. :mod:`lab_utils.app.time_budget` sums
them over each experiment's plan for :data:`BUDGET_NODE` (:data:`ASSUMPTIONS` says every assumption in words).
"""

from __future__ import annotations

import math

from lab_utils.engine.config import CIFAR10_TRAIN_SIZE
from lab_utils.engine.hardware import peak_flops_per_s
from lab_utils.engine.machine import BUDGET_NODE
from lab_utils.experiments.shared import anchors

#: The label every estimate carries until a full-profile GPU run replaces it.
LABEL = "estimate (no GPU run yet)"
#: The node the estimate is for.
GPU_NAME = BUDGET_NODE.gpu_name  # the torch name of the H100 SXM
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
    f"Node: {NODE} (dense peaks from lab_utils.engine.hardware: bf16 989, TF32 495 TFLOP/s). "
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
    """Estimated seconds of one DataParallel epoch on ``devices`` GPUs at ``batch`` per GPU: the larger
    of the 1-GPU spec-path epoch at the global batch and the other cohort's epoch on this many GPUs at
    the nearest global batch at or below it (see :data:`ASSUMPTIONS`)."""
    global_batch = devices * batch
    floor = spec_epoch_seconds(1, global_batch)
    measured = sorted(g for n, g in _OTHER if n == devices and g <= global_batch)
    return max(floor, _OTHER[(devices, measured[-1])]) if measured else floor


def fast_epoch_seconds(precision: str) -> float:
    """A fast-path epoch (data on the GPU): FLOP-bound at the assumed fraction of the peak."""
    return CIFAR10_TRAIN_SIZE * RESNET_TRAIN_FLOPS_PER_IMAGE / (
        RESNET_PEAK_FRACTION * peak_flops_per_s(GPU_NAME, precision))


def gpt_epoch_seconds(flops: float, devices: int, micro_batch: int) -> float:
    """A GPT epoch of ``flops`` training FLOPs (tiny-Shakespeare's training split: the GPT experiment
    counts them) on ``devices`` GPUs at ``micro_batch`` sequences per micro-step."""
    efficiency = min(1.0, micro_batch / GPT_REFERENCE_MICRO_BATCH) ** GPT_MICRO_BATCH_EXPONENT
    return flops / (devices * GPT_PEAK_FRACTION * efficiency * peak_flops_per_s(GPU_NAME, "bf16"))


def test_pass_seconds(devices: int) -> float:
    """A test pass over 10,000 images on ``devices`` GPUs: a fifth of a training epoch at 128 per GPU."""
    return TEST_PASS_FRACTION * spec_epoch_seconds(devices, 128)


