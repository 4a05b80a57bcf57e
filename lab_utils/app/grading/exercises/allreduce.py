"""The exercises of notebooks 02 to 04 (scaling, compute vs communication, the all-reduce's
bandwidth): speedups, the predicted epoch and its communication, gradient and ring bytes, bandwidths."""

from __future__ import annotations

import math

from lab_utils.app.grading.exercises.answers import plain
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake
from lab_utils.experiments.shared import anchors

# --------------------------------------------------------------------------- q04: bytes


def _resnet(case: dict):
    """ResNet-18 of ``case``: ``width`` (64 = spec), ``classes``, ``dtype``, ``frozen`` submodules."""
    import torch

    from lab_utils.learn.models import ResNet18

    torch.manual_seed(0)
    model = ResNet18(num_classes=case.get("classes", 10), width=case.get("width", 64))
    model = model.to(getattr(torch, case.get("dtype", "float32")))
    for name in case.get("frozen", ()):
        for p in model.get_submodule(name).parameters():
            p.requires_grad_(False)
    return model


def _grad_bytes_show(case: dict) -> str:
    frozen = f", {' and '.join(case['frozen'])} frozen" if case.get("frozen") else ""
    classes = f", {case['classes']} classes" if case.get("classes", 10) != 10 else ""
    return (f"grad_bytes(ResNet18(width={case.get('width', 64)}{classes}) in "
            f"{case.get('dtype', 'float32')}{frozen})")


BITS_FOR_BYTES = Mistake("bits for bytes", "that is bits; sizes here are in bytes (8 bits each)", factor=8.0)


def epoch_iterations(dataset_size, world_size, per_device_batch):
    """Steps of one rank's epoch: ceil(ceil(N/P)/b) (DistributedSampler pads, the last batch is kept)."""
    return math.ceil(math.ceil(dataset_size / world_size) / per_device_batch)


# "2(P-1)" in any form: the ring's step count, the heart of q04_ring_bytes' answer (phrases are matched on
# lower-cased text: lab_utils.app.grading.giveaways.normalized).
_TWO_P_MINUS_1 = "re:2\\s*\\(\\s*p\\s*-\\s*1\\s*\\)"


def _predicted(buckets, p, alpha, bw_gb_per_s, latency=1.0):
    """q04_predicted_bandwidth with ``latency`` x the ring's 2(P-1) alpha per bucket (1: the right one)."""
    seconds = sum(latency * 2 * (p - 1) * alpha + 2 * (p - 1) / p * b / (bw_gb_per_s * 1e9) for b in buckets)
    return sum(2 * (p - 1) / p * b for b in buckets) / seconds / 1e9


# The earlier cohort's Table 3: one gradient's bytes over an epoch's communication time (SPEC.md).
# The earlier cohort's 4 x 512 bandwidth: one gradient over its Q4.1 output's epoch communication time, the
# 250.10 MB/s of its Q4.1 and of its Table 3 (SPEC.md).
_T3_BYTES, _T3_SECONDS = anchors.TABLE3_GRADIENT_BYTES, anchors.TABLE3_COMM_SECONDS[0]
_TABLE3 = f"{_T3_BYTES:,} B / {_T3_SECONDS} s = {_T3_BYTES / _T3_SECONDS / 1e6:.1f} MB/s"
ONE_ALLREDUCE_PER_EPOCH = "one all-reduce per epoch"
_ONE_PER_EPOCH_WHY = (
    "every step of the epoch ends with its own all-reduce, in which each rank sends 2(P-1)/P x S: an epoch "
    "moves that once per step, not once (the earlier cohort's 4 x 512 bandwidth, in its Q4.1 output and its "
    f"Table 3, is one gradient over the epoch's communication time, {_TABLE3}, leaving out the steps and the "
    "ring's 2(P-1)/P), so the error grows with the steps per epoch")


# --------------------------------------------------------------------------- q02, q03: an all-reduce


def _wait(nbytes, latency, gbps, giga=1e9):
    """One all-reduce of ``nbytes`` on the line: latency + bytes / (GB/s x ``giga``), seconds."""
    return latency + nbytes / (gbps * giga)


def _comm_pair(buckets, latency, gbps, steps, exposed_index=-1):
    """(b) and (c) per epoch with bucket ``exposed_index`` the exposed one (a known mistake's variant)."""
    each = [_wait(b, latency, gbps) for b in buckets]
    return steps * each[exposed_index], steps * sum(each)


# --------------------------------------------------------------------------- the exercises


#: Notebooks 02 to 04's exercises, in the order of :data:`lab_utils.app.grading.exercises.EXERCISES`.
EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "q02_speedup", "speedup_and_efficiency", outputs=("speedup", "efficiency"),
        # The public case's answer is the first cohort's 41.30 / 23.15 = 1.784 (efficiency 0.892): stated
        # ("= 1.784") or shown as the pair. A bare 1.784 is no give-away: a measured time can print as
        # one (notebook 01's quick warm-up epoch once took 1.784 s).
        giveaways=(r"re:=\s*1\.784(?!\d)", r"re:(?<![\d.])1\.784(?!\d).{0,60}(?<![\d.])0\.892(?!\d)",
                   r"re:t\(1\)\s*/\s*t\(n\)"),
        implemented_by=("lab_utils.learn.speedup.speedup",),
        mistakes=(
            Mistake("N x T(1)/T(N)", "on epoch times that counts N twice (each of the N devices already "
                    "does 1/N of the epoch); the speedup is T(1)/T(N)",
                    wrong=lambda t1, tn, n: (n * t1 / tn, t1 / tn)),
            Mistake("upside down", "that is T(N)/T(1); the speedup is T(1)/T(N)",
                    wrong=lambda t1, tn, n: (tn / t1, tn / t1 / n)),
            Mistake("efficiency = speedup", "the efficiency is the speedup divided by N",
                    wrong=lambda t1, tn, n: (t1 / tn, t1 / tn)),
        )),
    Exercise(
        "q02_predict_epoch", "predict_epoch_seconds",
        giveaways=(r"re:steps\s*(x|\*|×)\s*\(\s*t\(1\)\s*\+",
                   r"re:t\(1\)\s*\+\s*(the\s*)?(latency|all-reduce)"),
        implemented_by=("lab_utils.learn.scaling_model.predicted_epoch_seconds",),
        mistakes=(
            Mistake(ONE_ALLREDUCE_PER_EPOCH, "every step of the epoch waits for its own all-reduce of the "
                    "gradient, not the epoch once (the earlier cohort's Table 3 mistake)",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * t1 + _wait(nbytes, lat, gbps)),
            Mistake("the all-reduce left out", "each step computes what one device's step does AND waits "
                    "for the exposed all-reduce", wrong=lambda t1, steps, nbytes, lat, gbps: steps * t1),
            Mistake("the latency left out", "an all-reduce of any size costs at least the line's latency, "
                    "once per all-reduce", wrong=lambda t1, steps, nbytes, lat, gbps: steps * (
                        t1 + _wait(nbytes, 0.0, gbps))),
            Mistake("GiB for GB", "the bandwidth is in decimal GB/s (10^9 bytes per second), not GiB/s",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * (
                        t1 + _wait(nbytes, lat, gbps, 2**30))),
            Mistake("bits for bytes", "exposed_bytes and GB/s both count bytes: no factor 8",
                    wrong=lambda t1, steps, nbytes, lat, gbps: steps * (t1 + _wait(8 * nbytes, lat, gbps))),
        )),
    Exercise(
        "q03_compute_comm", "compute_and_comm", outputs=("compute_seconds", "comm_seconds"),
        find_the_bug=True,
        giveaways=(r"re:compute[^.]{0,30}=\s*t\(1\)\s*/\s*n", r"re:t\(n\)\s*-\s*t\(1\)\s*/\s*n"),
        implemented_by=("lab_utils.learn.comm_probe.derived_comm",),
        mistakes=(
            Mistake("compute = T(N)", "the compute column is T(1)/N, the one-device work split N ways; T(N) "
                    f"is the whole N-device epoch, communication included (the earlier cohort's Table 2 "
                    f"printed T(N) = {anchors.FIRST_COHORT_TABLE1_SECONDS[anchors.TABLE2_COMPUTE_IS_TN]} s, "
                    "its Q2 time, as compute)", wrong=lambda t1, tn, n: (tn, tn - t1 / n)),
            Mistake("compute = T(N)", "the compute column is T(1)/N, the one-device work split N ways, and "
                    "communication is what T(N) takes beyond it, T(N) - T(1)/N: with compute = T(N) nothing "
                    "is left for communication", wrong=lambda t1, tn, n: (tn, 0.0)),
            Mistake("compute from T(N)/N", "the compute time on N devices is T(1)/N (the one-device work "
                    "split N ways), not T(N)/N", wrong=lambda t1, tn, n: (tn / n, tn - tn / n)),
            Mistake("negative communication clipped", "return T(N) - T(1)/N as is when it is negative: "
                    "a negative value says the perfect-split assumption failed, and clipping it hides that",
                    wrong=lambda t1, tn, n: (t1 / n, max(tn - t1 / n, 0.0))),
            Mistake("T(N) - T(1)", "the communication is T(N) - T(1)/N, not T(N) - T(1)",
                    wrong=lambda t1, tn, n: (t1 / n, tn - t1)),
        )),
    Exercise(
        "q03_predict_comm", "predict_comm_seconds", outputs=("exposed_seconds", "allreduce_seconds"),
        giveaways=(r"re:\(c\) adds (every|each) bucket", r"re:\(b\)[^.]{0,20}(is|=) the last (one|bucket)",
                   r"re:latency[^.]{0,40}(each|every|per) bucket"),
        implemented_by=("lab_utils.learn.scaling_model.predicted_comm_seconds",),
        mistakes=(
            Mistake("(b) from the first bucket", "DDP all-reduces the first bucket (the last layers' "
                    "gradients) while backward still computes the others; the one that cannot hide is the "
                    "LAST, ready when backward ends",
                    wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps, steps, 0)),
            Mistake("(b) with no overlap", "(b) is what backward could NOT hide; every bucket but the last "
                    "hides behind the rest of backward",
                    wrong=lambda b, lat, gbps, steps: (_comm_pair(b, lat, gbps, steps)[1],) * 2),
            Mistake("one latency for (c)", "each bucket is an all-reduce of its own and pays the latency: "
                    "(c) adds one all-reduce per bucket, not one of all the bytes",
                    wrong=lambda b, lat, gbps, steps: (_comm_pair(b, lat, gbps, steps)[0],
                                                       steps * _wait(sum(b), lat, gbps))),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, "every step all-reduces its buckets: multiply by the epoch's "
                    "steps", wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps, 1)),
            Mistake("GiB for GB", "the bandwidth is in decimal GB/s (10^9 bytes per second), not GiB/s",
                    wrong=lambda b, lat, gbps, steps: _comm_pair(b, lat, gbps * 2**30 / 1e9, steps)),
        )),
    Exercise(
        "q04_gradient_bytes", "grad_bytes", call=lambda fn, case: plain(fn(_resnet(case))),
        show=_grad_bytes_show, needs=("torch", "lab_utils.learn.models"),
        giveaways=("re:element_?size", "re:numel\\s*(x|×)?\\s*(the )?element", "undercounts the bytes 4x"),
        implemented_by=("lab_utils.learn.ring.gradient_bytes",),
        mistakes=(
            Mistake("parameters counted as bytes", "that is the parameter count; the all-reduce moves "
                    "bytes: elements x p.element_size() (4 for fp32)",
                    wrong=lambda model: sum(p.numel() for p in model.parameters() if p.requires_grad)),
            Mistake("4 bytes per element whatever the dtype", "use each tensor's own element size "
                    "(p.element_size()): bf16 gradients are 2 bytes",
                    wrong=lambda model: sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)),
            Mistake("frozen parameters counted", "a parameter that does not require grad has no gradient "
                    "and is not all-reduced",
                    wrong=lambda model: sum(p.numel() * p.element_size() for p in model.parameters())),
            BITS_FOR_BYTES,
        )),
    Exercise(
        "q04_ring_bytes", "ring_bytes_per_rank_per_epoch", find_the_bug=True,
        giveaways=(_TWO_P_MINUS_1, "re:\\(\\s*p\\s*-\\s*1\\s*\\)\\s*/\\s*p", "bandwidth-optimal"),
        implemented_by=("lab_utils.learn.ring.ring_bytes_per_epoch",
                        "lab_utils.learn.ring.ring_bytes_per_rank"),
        mistakes=(
            Mistake("the log2 tree formula", "a ring all-reduce sends 2(P-1)/P x S bytes per rank per "
                    "iteration, not S x log2(P) (a tree's step count; the two agree only at P = 2)",
                    wrong=lambda s, p, n, b: epoch_iterations(n, p, b) * s * math.log2(p)),
            Mistake("one gradient per all-reduce", "each rank sends 2(P-1)/P x S (reduce-scatter, then "
                    "all-gather), not S", wrong=lambda s, p, n, b: epoch_iterations(n, p, b) * s),
            Mistake("all ranks together", "2(P-1) x S is what all P ranks send together; one rank sends "
                    "2(P-1)/P x S", wrong=lambda s, p, n, b: epoch_iterations(n, p, b) * 2 * (p - 1) * s),
            Mistake("iterations over the whole data set", "each rank sees ceil(N/P) samples, so an epoch "
                    "has ceil(ceil(N/P)/b) iterations, not ceil(N/b)",
                    wrong=lambda s, p, n, b: math.ceil(n / b) * 2 * (p - 1) / p * s),
            Mistake("iterations rounded down", "the sampler pads to a multiple of P and the last partial "
                    "batch is kept: round both divisions up",
                    wrong=lambda s, p, n, b: (n // p) // b * 2 * (p - 1) / p * s),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY, wrong=lambda s, p, n, b: s),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, n, b: 2 * (p - 1) / p * s),
            BITS_FOR_BYTES,
        )),
    Exercise(
        "q04_utilization", "achieved_gb_per_s", find_the_bug=True,
        giveaways=("one gradient per epoch", ONE_ALLREDUCE_PER_EPOCH, r"re:(?<![\d.])250\.1 mb/s",
                   "re:steps?(\\s*per\\s*epoch)?\\s*(x|×)?\\s*2\\s*\\("),
        implemented_by=("lab_utils.learn.ring.achieved_gb_per_s",),
        mistakes=(
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, steps, secs: s / secs / 1e9),
            Mistake(ONE_ALLREDUCE_PER_EPOCH, _ONE_PER_EPOCH_WHY,
                    wrong=lambda s, p, steps, secs: 2 * (p - 1) / p * s / secs / 1e9),
            Mistake("one gradient per all-reduce", "in a ring all-reduce each rank sends 2(P-1)/P x S, not S "
                    "(the two agree only at P = 2)", wrong=lambda s, p, steps, secs: steps * s / secs / 1e9),
            Mistake("GiB for GB", "that is GiB/s (2^30 bytes); bandwidths here are decimal GB/s "
                    "(10^9 bytes), as nccl-tests reports", factor=1e9 / 2 ** 30),
            Mistake("MB for GB", "that is MB/s; divide bytes per second by 10^9 for GB/s", factor=1e3),
            Mistake("bits for bytes", "that is Gbit/s; GB/s counts bytes (8 bits each)", factor=8.0),
            Mistake("bytes per second", "divide bytes per second by 10^9 for decimal GB/s", factor=1e9),
        )),
    Exercise(
        "q04_predicted_bandwidth", "predicted_gb_per_s",
        giveaways=("once per bucket", "re:(k|buckets)\\s*(x|×)?\\s*2\\s*\\(\\s*p\\s*-\\s*1\\s*\\)"),
        implemented_by=("lab_utils.learn.ring.predicted_allreduce_gb_per_s",),
        mistakes=(
            Mistake("latency left out", "each bucket's ring all-reduce also pays 2(P-1) alpha, so the rate "
                    "stays below B; without it the prediction is B itself",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw, latency=0)),
            Mistake("one latency for all buckets", "DDP all-reduces each bucket separately, and every one "
                    "pays the latency term 2(P-1) alpha",
                    wrong=lambda b, p, a, bw: _predicted([sum(b)], p, a, bw)),
            Mistake("P-1 latency steps", "a ring all-reduce takes 2(P-1) steps (P-1 of reduce-scatter, P-1 "
                    "of all-gather), each paying alpha",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw, latency=0.5)),
            Mistake("algbw for busbw", "Table 3 counts the bytes one rank sends, 2(P-1)/P x each bucket "
                    "(nccl-tests' busbw), not the bucket's size (algbw)",
                    wrong=lambda b, p, a, bw: _predicted(b, p, a, bw) * p / (2 * (p - 1))),
        )),
)
