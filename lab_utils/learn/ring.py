"""Ring all-reduce from first principles: bytes, time models, nccl-tests metrics.

The formulas behind notebooks 02-04 (Tables 1-3), pure arithmetic tested against values computed by hand; the
alpha-beta fit to a benchmark is :mod:`lab_utils.learn.alpha_beta`, and
:mod:`lab_utils.experiments.n04_allreduce.experiment` runs the benchmark and the projections on top of it.

A ring all-reduce of S bytes over ``P`` ranks is a reduce-scatter followed by an all-gather, ``P-1`` steps
each, every step sending one ``S/P`` chunk. In the time models alpha is the seconds per message step and B the
bytes/s of one link direction. nccl-tests' figures (``doc/PERFORMANCE.md``) are in decimal GB/s (1e9 bytes/s).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from lab_utils.learn.errors import LabError, check_positive_int

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
GB = 1e9  # decimal, as nccl-tests reports GB/s

# DDP's default bucket_cap_mb=25 (25 * 1024 * 1024 bytes); only when it is not given is the first bucket
# capped at 1 MiB, for torch's reason (nn/parallel/distributed.py): "we allow for a single small bucket for
# parameters that are defined first, such that their gradients don't spill into a much larger bucket,
# adding unnecessary latency after gradient computation finishes". DDP rebuilds its buckets after the first
# step in gradient-ready order, so the 1 MiB cap falls on the first bucket sent: ResNet-18's 9.46 + 26.49
# + 8.74 MB.
DDP_BUCKET_BYTES = 25 * MIB
DDP_FIRST_BUCKET_BYTES = 1 * MIB


# --------------------------------------------------------------------------- bytes


def _check_world_size(world_size: object) -> int:
    return check_positive_int(world_size, "world size (number of ranks P)")


def _check_nonneg(value: float, what: str, above_zero: bool = False) -> float:
    if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
            or value < 0 or (above_zero and value == 0)):
        raise LabError(f"{what} must be a finite number {'above 0' if above_zero else 'of at least 0'}, "
                       f"got {value!r}.")
    return float(value)


def _check_pos(value: float, what: str) -> float:
    return _check_nonneg(value, what, above_zero=True)


def gradient_bytes(model) -> int:
    """S, the bytes of the gradients DDP all-reduces: numel x element size over the parameters that require
    grad (ResNet-18 in fp32: 11,173,962 x 4 = 44,695,848 bytes; a parameter *count* is not a size)."""
    return int(sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad))


def bus_factor(world_size: int) -> float:
    """``2(P-1)/P``: the fraction of S each rank sends in a ring all-reduce (0 for one rank)."""
    p = _check_world_size(world_size)
    return 2 * (p - 1) / p


def ring_bytes_per_rank(size_bytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in one ring all-reduce of ``size_bytes``: ``2(P-1)/P x S``."""
    s = _check_nonneg(size_bytes, "message size in bytes")
    p = _check_world_size(world_size)
    return 2 * (p - 1) * s / p


def samples_per_rank(dataset_size: int, world_size: int) -> int:
    """Samples one rank sees per epoch under ``DistributedSampler(drop_last=False)``: ``ceil(N/P)`` (the
    sampler pads the data set with repeated samples so every rank runs the same number of all-reduces)."""
    return -(-check_positive_int(dataset_size, "data set size") // _check_world_size(world_size))


def iterations_per_epoch(dataset_size: int, per_device_batch: int, world_size: int = 1) -> int:
    """Iterations (all-reduces) per epoch on each rank, the loader's last partial batch included:
    ``ceil(ceil(N/P) / b)``, equal to ``ceil(N / (P x b))``."""
    b = check_positive_int(per_device_batch, "per-device batch size")
    return -(-samples_per_rank(dataset_size, world_size) // b)


def ring_bytes_per_epoch(size_bytes: float, world_size: int, dataset_size: int,
                         per_device_batch: int) -> float:
    """Bytes each rank sends in one epoch: iterations x ``2(P-1)/P x S``."""
    return iterations_per_epoch(dataset_size, per_device_batch, world_size) * ring_bytes_per_rank(
        size_bytes, world_size)


def achieved_gb_per_s(size_bytes: float, world_size: int, steps_per_epoch: int, seconds: float) -> float:
    """Table 3's achieved bandwidth of one rank, in decimal GB/s: the bytes it sent in one epoch
    (``steps_per_epoch`` ring all-reduces of ``2(P-1)/P x S`` each) over the epoch's communication
    ``seconds``, comparable with nccl-tests' busbw. ``world_size`` 1 is refused: one device sends nothing."""
    p = _check_world_size(world_size)
    if p < 2:
        raise LabError("A bandwidth needs at least 2 ranks: one device communicates nothing (0 bytes per "
                       "epoch), so leave the 1-GPU row out of Table 3.")
    steps = check_positive_int(steps_per_epoch, "steps per epoch")
    t = _check_pos(seconds, "communication seconds")
    return steps * ring_bytes_per_rank(size_bytes, p) / t / GB


# --------------------------------------------------------------------------- time models


def _model_args(size_bytes: float, world_size: int, alpha_seconds: float,
                bandwidth_bytes_per_s: float) -> tuple[float, int, float, float, int]:
    """The time models' checked inputs (S, P, alpha, B) and ``ceil(log2 P)``."""
    p = _check_world_size(world_size)
    return (_check_nonneg(size_bytes, "message size in bytes"), p,
            _check_nonneg(alpha_seconds, "alpha (seconds per step)"),
            _check_pos(bandwidth_bytes_per_s, "bandwidth B (bytes/s)"), (p - 1).bit_length())


def ring_allreduce_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Ring all-reduce time: ``2(P-1) alpha + 2(P-1)/P x S / B`` seconds. The bandwidth term hardly grows
    with P (bandwidth-optimal), the latency term grows linearly (small messages, many ranks)."""
    s, p, a, bw, _ = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * (p - 1) * a + ring_bytes_per_rank(s, p) / bw


def bucketed_ring_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                          bandwidth_bytes_per_s: float, bucket_bytes: float = DDP_BUCKET_BYTES) -> float:
    """All-reduce of ``size_bytes`` split into ``k = ceil(S / bucket_bytes)`` ring all-reduces, as DDP
    does: the latency term is paid once per bucket, ``k x 2(P-1) alpha + 2(P-1)/P x S / B`` (the ideal
    split: real DDP buckets follow parameter boundaries and a 1 MiB first bucket)."""
    s, p, a, bw, _ = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    k = max(1, math.ceil(s / _check_pos(bucket_bytes, "bucket size in bytes")))
    return k * 2 * (p - 1) * a + ring_bytes_per_rank(s, p) / bw


def predicted_allreduce_gb_per_s(bucket_bytes: Sequence[float], world_size: int, alpha_seconds: float,
                                 bandwidth_gb_per_s: float) -> float:
    """Notebook 04's prediction of Table 3's (c) rate, in decimal GB/s: what one rank sends for one step's
    buckets over their ring all-reduces one after another. Below ``B`` by the latency paid once per
    bucket; one rank refused."""
    p = _check_world_size(world_size)
    if p < 2:
        raise LabError("A bandwidth needs at least 2 ranks: one device communicates nothing.")
    sizes = [_check_pos(b, "bucket size in bytes") for b in bucket_bytes]
    if not sizes:
        raise LabError("Give the sizes of the step's buckets in bytes (at least one).")
    bw = _check_pos(bandwidth_gb_per_s, "bandwidth B (GB/s)") * GB
    seconds = sum(ring_allreduce_seconds(b, p, alpha_seconds, bw) for b in sizes)
    return sum(ring_bytes_per_rank(b, p) for b in sizes) / seconds / GB


def tree_allreduce_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                           bandwidth_bytes_per_s: float) -> float:
    """Binary-tree reduce then broadcast, whole message per hop: ``2 ceil(log2 P) (alpha + S/B)``."""
    s, _, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * log2p * (a + s / bw)


def recursive_doubling_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                               bandwidth_bytes_per_s: float) -> float:
    """Recursive doubling (pairwise exchange): ``ceil(log2 P) (alpha + S/B)``: few steps, but the whole
    message on every step."""
    s, _, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return log2p * (a + s / bw)


def halving_doubling_seconds(size_bytes: float, world_size: int, alpha_seconds: float,
                             bandwidth_bytes_per_s: float) -> float:
    """Recursive halving + doubling (Rabenseifner): ``2 ceil(log2 P) alpha + 2(P-1)/P x S / B``."""
    s, p, a, bw, log2p = _model_args(size_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s)
    return 2 * log2p * a + ring_bytes_per_rank(s, p) / bw


def spec_log2_seconds(transfer_seconds: float, compute_seconds: float, world_size: int) -> float:
    """An earlier student's ``(transfer + compute) x log2(P)`` (not the spec's or the assignment's, which
    asks for the ring), for comparison only: log2(P) rounds that each move the *whole* gradient, neither a
    ring nor a correct tree model, unbounded in P where a ring's per-rank traffic stays below 2S."""
    p = _check_world_size(world_size)
    return (_check_nonneg(transfer_seconds, "transfer seconds")
            + _check_nonneg(compute_seconds, "compute seconds")) * math.log2(p)


ALGORITHMS = {
    "ring": ring_allreduce_seconds,
    "tree (reduce+broadcast)": tree_allreduce_seconds,
    "recursive doubling": recursive_doubling_seconds,
    "halving+doubling": halving_doubling_seconds,
}


# --------------------------------------------------------------------------- nccl-tests metrics


def algbw_gb_per_s(size_bytes: float, seconds: float) -> float:
    """nccl-tests' algorithm bandwidth ``S / t`` in decimal GB/s."""
    return _check_nonneg(size_bytes, "message size in bytes") / _check_pos(seconds, "time in seconds") / GB


def busbw_gb_per_s(algbw: float, world_size: int) -> float:
    """nccl-tests' all-reduce bus bandwidth ``algbw x 2(n-1)/n`` (same units as ``algbw``). In the
    bandwidth-dominated regime it approaches B, so it is comparable across rank counts and with a link's
    nominal bandwidth."""
    n = _check_world_size(world_size)
    return algbw * 2 * (n - 1) / n
