"""How gradients are cut for communication (notebook 09): DDP's all-reduce buckets
(:func:`assign_buckets`, what :class:`lab_utils.learn.handmade.Bucketed` sends) and ZeRO's shards
(:func:`shard_bounds`, what :class:`lab_utils.learn.handmade.ZeroOne` reduce-scatters and all-gathers).
"""

from __future__ import annotations

from collections.abc import Sequence


def assign_buckets(sizes_bytes: Sequence[int], cap_bytes: float,
                   first_cap_bytes: float | None = None) -> list[list[int]]:
    """Parameter indices (``model.parameters()`` order) in buckets by torch's
    ``compute_bucket_assignment_by_size`` (reducer.cpp), as DDP applies it when it rebuilds its buckets in
    gradient-ready order: parameters in REVERSE order (backward makes the last layer's gradient first), each
    added to the open bucket, which closes once it holds at least its cap (so it can exceed it by its last
    tensor; the last may be below it). The first bucket's cap is ``first_cap_bytes`` (None: ``cap_bytes``;
    DDP's: :data:`lab_utils.learn.ring.DDP_FIRST_BUCKET_BYTES`)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i in reversed(range(len(sizes_bytes))):
        current.append(i)
        filled += sizes_bytes[i]
        if filled >= (first_cap_bytes if not buckets and first_cap_bytes is not None else cap_bytes):
            buckets.append(current)
            current, filled = [], 0
    if current:
        buckets.append(current)
    return buckets


def shard_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's shard of ``numel`` elements: together they cover every element
    once, in order; sizes differ by at most one (the first ``numel % world_size`` ranks hold one more)."""
    base, extra = divmod(numel, world_size)
    return [(r * base + min(r, extra), (r + 1) * base + min(r + 1, extra)) for r in range(world_size)]
