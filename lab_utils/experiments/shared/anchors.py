"""Every number the lab quotes from an earlier report, in one place.

The lab compares its measurements with what earlier cohorts reported and shows where those
reports went wrong. Each number such a comparison needs is defined here once, as the report
printed it, and every notebook, table, exercise comment and the time budget reads it from here
(``tests/test_anchors.py`` pins each value with the SPEC.md line it quotes, compares every number
here with ``shared/SPEC.md`` when that file is found beside the checkout, and redoes the arithmetic
of every derived statement by hand).

Sources: SPEC.md ("Numbers earlier cohorts reported", "Known mistakes in those reports",
"Part 2"), unless a comment names an issue (a few numbers come from the reports as quoted in
an issue, not in SPEC.md: :data:`NOT_IN_SPEC` lists them). Hardware of every report: unknown
(V100 / RTX 8000 class). What a report does NOT say is not claimed here either: the first
cohort's report does not name the parallel module of its Q2-Q3 runs, and its Q4.1 says
"Accuracy" without saying train or test. The first cohort printed two single-GPU sets for the
same configurations (its Q1 answer and its Table 1): both are quoted, never one as "the" time.

This module imports nothing: every layer may read it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "ACCUMULATION_BEST_WALL", "ACCUMULATION_EFFECTIVE_BATCH", "ACCUMULATION_FORWARD_MEAN_MS",
    "ACCUMULATION_GPUS",
    "ACCUMULATION_LOSS_MEAN_MS", "ACCUMULATION_MICRO_BATCHES", "ACCUMULATION_TOKENS_PER_S",
    "CIFAR10_TRAIN_IMAGES", "FIRST_COHORT_LABEL", "FIRST_COHORT_LARGE_BATCH", "FIRST_COHORT_MEASURED",
    "FIRST_COHORT_PRINTED_SPEEDUPS", "FIRST_COHORT_Q1_CONCLUSION", "FIRST_COHORT_Q1_SECONDS",
    "FIRST_COHORT_TABLE1_SECONDS", "GPT_COMPUTE_COMM_2GPU_SECONDS", "GPT_ONE_GPU_COMMUNICATION_SECONDS",
    "GPT_RANK_SECONDS", "GPT_REPORTED_MEAN_SECONDS", "GPT_REPORTED_SPEEDUPS", "LargeBatchAnchor",
    "NOT_IN_SPEC", "OTHER_COHORT_8192_4GPU_SECONDS", "OTHER_COHORT_8192_LEFT_OUT", "OTHER_COHORT_8192_RAN_ON",
    "OTHER_COHORT_DID_NOT_FIT", "OTHER_COHORT_LABEL", "OTHER_COHORT_LOGGED_STEPS",
    "OTHER_COHORT_MEASURED", "OTHER_COHORT_SECONDS", "SPEC_GRADIENT_BYTES",
    "TABLE2_COMPUTE_IS_TN", "TABLE3_COMM_SECONDS", "TABLE3_GRADIENT_BYTES", "TABLE3_ONE_GRADIENT_MB_PER_S",
    "TABLE3_PRINTED_MB_PER_S", "TABLE3_REPORTED_MB_PER_S", "first_cohort_q1_over_q2",
    "global_batch_steps", "other_cohort_per_gpu_batch",
]

#: CIFAR-10's training images: what every report's epoch went through.
CIFAR10_TRAIN_IMAGES = 50_000
#: The spec ResNet-18's fp32 gradient (11,173,962 parameters x 4 bytes), the S of Table 3.
SPEC_GRADIENT_BYTES = 44_695_848


def global_batch_steps(global_batch: int, images: int = CIFAR10_TRAIN_IMAGES) -> int:
    """Optimizer steps of one epoch at ``global_batch`` images per step, the last partial batch
    included: ``ceil(images / global_batch)`` (1,563 at 32, 391 at 128 on CIFAR-10)."""
    return math.ceil(images / global_batch)


# --------------------------------------------------------------------------- the first cohort (Q1-Q7)

#: Label of the first cohort's rows in the lab's tables. Its report does not say which parallel
#: module (DataParallel or DDP) ran its Q2-Q3 timings, so the label does not either.
FIRST_COHORT_LABEL = "earlier cohort (parallel module not stated)"
#: What its Table 1 times are (the assignment's definition, as the report answers Q1-Q2).
FIRST_COHORT_MEASURED = "epoch-2 training seconds, data I/O excluded"

#: Its Table 1 (Q2): epoch-2 training seconds by (GPUs, per-GPU batch), as printed (the 1-GPU row is
#: 41.30 / 33.64 / 33.95 s).
FIRST_COHORT_TABLE1_SECONDS: dict[tuple[int, int], float] = {
    (1, 32): 41.3, (1, 128): 33.64, (1, 512): 33.95,
    (2, 32): 23.15, (2, 128): 17.87, (2, 512): 17.50,
    (4, 32): 11.65, (4, 128): 9.23, (4, 512): 9.01,
}
#: The speedups T(1)/T(N) its Table 1 printed, by (GPUs, per-GPU batch). Recomputed from the times above
#: they are 1.78 / 1.88 / 1.94 and 3.55 / 3.64 / 3.77: its 1.86 is an arithmetic slip (41.30 / 23.15 =
#: 1.784), the others differ in the last digit (cut, not rounded).
FIRST_COHORT_PRINTED_SPEEDUPS: dict[tuple[int, int], float] = {
    (2, 32): 1.86, (2, 128): 1.88, (2, 512): 1.94, (4, 32): 3.54, (4, 128): 3.64, (4, 512): 3.76,
}
#: Its Q1 answer, the same single-GPU configurations timed again: (epoch 1, epoch 2) training seconds
#: by batch size, as printed. Epoch 2 is 5-19% above the 1-GPU row of its Table 1
#: (:func:`first_cohort_q1_over_q2`): the report printed two different sets, and neither is "the"
#: single-GPU time. Its epoch-1 lines are the reports' best evidence for the warm-up epoch.
FIRST_COHORT_Q1_SECONDS: dict[int, tuple[float, float]] = {
    32: (59.82, 43.42), 128: (39.07, 36.85), 512: (41.69, 40.25),
}
#: What its Q1 answer concludes from those epoch-2 times (36.85 -> 40.25 s is +9.2%), in its words.
FIRST_COHORT_Q1_CONCLUSION = "plateaued or higher"


def first_cohort_q1_over_q2(batch: int) -> float:
    """The first cohort's Q1 epoch-2 time over the 1-GPU time of its Table 1 at ``batch``, minus 1, in %:
    how far its two single-GPU sets of the same configuration differ (+5.1 / +9.5 / +18.6 %)."""
    return 100.0 * (FIRST_COHORT_Q1_SECONDS[batch][1] / FIRST_COHORT_TABLE1_SECONDS[(1, batch)] - 1.0)


@dataclass(frozen=True)
class LargeBatchAnchor:
    """One row of the first cohort's Q4.1: loss and "Accuracy" after 5 epochs, as printed. The report
    does not say whether either is measured on the training or the test set."""

    gpus: int
    per_gpu_batch: int
    lr: float
    epochs: int
    loss: float
    accuracy_pct: float

    @property
    def global_batch(self) -> int:
        return self.gpus * self.per_gpu_batch


#: Q4.1: the reference (128 on 1 GPU) and the large batch (512 per GPU on 4 GPUs, same lr 0.1).
FIRST_COHORT_LARGE_BATCH: dict[str, LargeBatchAnchor] = {
    "small": LargeBatchAnchor(gpus=1, per_gpu_batch=128, lr=0.1, epochs=5, loss=0.514, accuracy_pct=82.2),
    "large": LargeBatchAnchor(gpus=4, per_gpu_batch=512, lr=0.1, epochs=5, loss=1.016, accuracy_pct=63.4),
}

#: Its Table 2 mistake: the "compute" column is T(N) itself (here the 2 GPUs x 32 time of its Table 1,
#: 23.15 s), printed beside a separately measured communication time, instead of T(1)/N and
#: T(N) - T(1)/N. The key of the Table 1 entry it repeats.
TABLE2_COMPUTE_IS_TN: tuple[int, int] = (2, 32)

#: Its bandwidth mistake: ONE gradient's bytes divided by an epoch's communication time.
TABLE3_GRADIENT_BYTES = SPEC_GRADIENT_BYTES
#: The epoch communication times (s) its Q4.1 output prints, 4 x 512 then 1 x 128; one gradient over
#: each gives its printed bandwidths, to the rounding of its times.
TABLE3_COMM_SECONDS: tuple[float, ...] = (0.1787, 1.4798)
#: The bandwidths its Q4.1 output printed (MB/s), in the order of :data:`TABLE3_COMM_SECONDS`: the second
#: is for 1 GPU, where nothing is communicated. Its Table 3 (2 and 4 GPUs, no 1-GPU row) has the first as
#: its 4 x 512 entry; its other five entries are consistent with one gradient over times not shown.
TABLE3_REPORTED_MB_PER_S: tuple[float, ...] = (250.10, 30.20)
#: Table 3's entries (MB/s) that SPEC.md quotes, by (GPUs, per-GPU batch), as printed.
TABLE3_PRINTED_MB_PER_S: dict[tuple[int, int], float] = {
    (4, 512): 250.10, (2, 32): 14.61, (2, 512): 129.64, (4, 128): 116.35,
}
#: One gradient over its Table 2 communication time (MB/s), as SPEC.md computes it from that table
#: (whose times SPEC.md does not quote): not the printed entries above, so those entries are
#: "consistent with one gradient per epoch over times not shown", not reproduced.
TABLE3_ONE_GRADIENT_MB_PER_S: dict[tuple[int, int], float] = {
    (2, 32): 15.17, (2, 512): 152.2, (4, 128): 111.5,
}


# --------------------------------------------------------------------------- the other cohort

#: Label of the other cohort's rows: it ran DataParallel through a framework whose ``dp`` strategy
#: splits each batch over the GPUs, so its "batch" is the GLOBAL batch (strong scaling).
OTHER_COHORT_LABEL = "other cohort (DataParallel, fixed global batch)"
#: What its times are: not the assignment's training time.
OTHER_COHORT_MEASURED = "epoch-2 wall-clock seconds to the second, data loader included"

#: Epoch-2 seconds by (GPUs, GLOBAL batch), as printed.
OTHER_COHORT_SECONDS: dict[tuple[int, int], float] = {
    (1, 32): 38.0, (1, 128): 16.0, (1, 512): 13.0, (1, 2048): 13.0,
    (2, 32): 67.0, (2, 128): 18.0, (2, 512): 9.0, (2, 2048): 10.0,
    (4, 32): 121.0, (4, 128): 30.0, (4, 512): 11.0, (4, 2048): 11.0,
}
#: Optimizer steps per epoch its logs count, by global batch, on 1, 2 and 4 GPUs alike: the proof
#: that its batch is global (a per-GPU batch of 32 would give 782 steps on 2 GPUs, 391 on 4).
OTHER_COHORT_LOGGED_STEPS: dict[int, int] = {32: 1563, 128: 391}
#: (GPUs, global batch) that did not fit on one GPU (its log is empty).
OTHER_COHORT_DID_NOT_FIT: tuple[int, int] = (1, 8192)
#: The GPU counts on which global batch 8192 did run (4,096 and 2,048 per GPU).
OTHER_COHORT_8192_RAN_ON: tuple[int, ...] = (2, 4)
#: The 4-GPU epoch at global batch 8192 (s), as its notebook computes it; its table leaves 8192 out.
OTHER_COHORT_8192_4GPU_SECONDS = 12.0
#: Why its table leaves global batch 8192 out, in its words.
OTHER_COHORT_8192_LEFT_OUT = "can not work in my gpu"

def other_cohort_per_gpu_batch(devices: int, global_batch: int) -> int | float:
    """Images per GPU per step in the other cohort's runs: its global batch split over its ``devices``
    GPUs (8 per GPU at global batch 32 on 4 GPUs); a whole number where the split is even."""
    return global_batch // devices if global_batch % devices == 0 else global_batch / devices


# --------------------------------------------------------------------------- the GPT DDP report (Part 2)

#: Every rank's total epoch time (seconds, rank 0 first) by (per-GPU batch, GPUs), as published.
GPT_RANK_SECONDS: dict[tuple[int, int], tuple[float, ...]] = {
    (64, 1): (2233.50,), (128, 1): (2082.29,),
    (64, 2): (1384.64, 806.75), (128, 2): (1188.86, 693.97),
    (64, 4): (833.37, 819.76, 827.95, 816.87), (128, 4): (706.41, 418.27, 415.71, 418.10),
}
#: Its "average" rows: the mean over ranks, from which it took its speedups.
GPT_REPORTED_MEAN_SECONDS: dict[tuple[int, int], float] = {
    (64, 1): 2233.50, (64, 2): 1095.70, (64, 4): 824.49,
    (128, 1): 2082.29, (128, 2): 941.42, (128, 4): 489.62,
}
#: The speedups it printed (T(1) / mean over ranks), by (per-GPU batch, GPUs).
GPT_REPORTED_SPEEDUPS: dict[tuple[int, int], float] = {
    (64, 2): 2.04, (64, 4): 2.71, (128, 2): 2.21, (128, 4): 4.25,
}
#: Its compute vs communication on 2 GPUs (seconds), by per-GPU batch.
GPT_COMPUTE_COMM_2GPU_SECONDS: dict[int, tuple[float, float]] = {64: (1047.6, 40.0), 128: (907.3, 25.7)}
#: The "communication" time it gives for its two 1-GPU runs, where no peer exists to communicate
#: with (issue 32; not in SPEC.md).
GPT_ONE_GPU_COMMUNICATION_SECONDS: tuple[float, ...] = (50.93, 25.31)


# --------------------------------------------------------------------------- the accumulation study

#: The effective batch it kept (micro-batch x accumulation steps), on 4 GPUs.
ACCUMULATION_EFFECTIVE_BATCH = 1024
ACCUMULATION_GPUS = 4
#: Its micro-batches (accumulation steps = 1024 / micro-batch).
ACCUMULATION_MICRO_BATCHES: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024)
#: Tokens/s it measured, "about", at the smallest and the largest micro-batch.
ACCUMULATION_TOKENS_PER_S: dict[int, float] = {16: 2_100.0, 1024: 16_000.0}
#: (micro-batch, accumulation steps) of its best wall time: start-up dominated the largest run.
ACCUMULATION_BEST_WALL: tuple[int, int] = (512, 2)
#: The forward-pass mean per micro-step it printed (ms): flat from micro-batch 16 to 1024 (issue 32).
ACCUMULATION_FORWARD_MEAN_MS: tuple[float, float] = (18.0, 26.0)
#: The loss-computation mean per micro-step it printed (ms), at micro-batch 16 and 1024 (issue 32).
ACCUMULATION_LOSS_MEAN_MS: dict[int, float] = {16: 0.5, 1024: 127.0}


#: The quotes above that are not in SPEC.md, and where they come from (the SPEC test skips them).
NOT_IN_SPEC: dict[str, str] = {
    "GPT_ONE_GPU_COMMUNICATION_SECONDS": "issue 32 (the GPT report's 1-GPU 'communication')",
    "ACCUMULATION_FORWARD_MEAN_MS": "issue 32 (the accumulation report's forward mean)",
    "ACCUMULATION_LOSS_MEAN_MS": "issue 32 (the accumulation report's loss mean)",
}
