"""One epoch over all ranks: the slowest rank defines T(N).

Every optimizer step of DDP ends with an all-reduce that no rank can finish before the last rank arrives,
so an epoch on N devices lasts as long as its slowest rank. Averaging the ranks' times (what an earlier
report did, SPEC.md Part 2) hides that rank and can report a "super-linear" speedup that never happened.
:func:`aggregate_epoch` turns the per-rank records of one epoch (``EpochRecord`` fields as dicts, plus
whatever a worker adds) into one aggregate (names defined in :mod:`lab_utils.learn.metrics`):

- ``epoch_seconds`` and ``train_seconds`` are the MAXIMUM over ranks (T(N) is the aggregate's
  ``train_seconds``), with the mean over ranks beside them (``*_mean``, what averaging would report),
  ``epoch_seconds_min``, ``imbalance`` = max / min of the epoch times, ``slowest_rank``/``fastest_rank``;
- every other ``*_seconds`` key (the phases, validation, ...) is the SLOWEST rank's (the longest epoch's:
  its breakdown adds up to the epoch that was waited for), with ``*_seconds_mean`` and ``*_seconds_max``;
- counts of work (:data:`SUM_KEYS`) are summed, ``steps`` and ``micro_steps`` the maximum (equal unless a
  rank's shard is shorter); rates (:data:`RATES`) are global: all ranks' count / T(N);
- the per-step spread is that of the rank whose ``train_seconds`` IS T(N), not a mean over ranks;
- values already global (all-reduced) or the same on every rank (:data:`SHARED_KEYS`) are rank 0's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lab_utils.learn.comm_probe import overlap_figures
from lab_utils.learn.spread import STEP_PERCENTILE_KEYS, STEP_STAT_KEYS

#: Time keys whose aggregate is the maximum over ranks (every rank waits for the last).
MAX_KEYS = ("epoch_seconds", "train_seconds", "eval_seconds", "elapsed_seconds")
SUM_KEYS = ("images", "tokens", "sequences")
SHARED_KEYS = ("train_loss", "train_accuracy", "lr", "lr_first", "test_loss", "test_accuracy", "test_images",
               "global_images", "val_loss")
RATES = {"images_per_s": "images", "tokens_per_s": "tokens"}
#: Fractions of the slowest rank's own times: taken from that rank, like its times.
SLOWEST_KEYS = ("overlap_fraction",)


def aggregate_epoch(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One epoch's aggregate over ranks by the module docstring's rules; ``per_rank`` holds one dict per
    rank, in rank order (a ``rank`` key, when present, names it)."""
    if not per_rank:
        raise ValueError("aggregate_epoch needs the records of at least one rank")
    first = per_rank[0]
    ep = [float(r["epoch_seconds"]) for r in per_rank]
    slow = max(range(len(per_rank)), key=lambda i: ep[i])
    fast = min(range(len(per_rank)), key=lambda i: ep[i])
    out: dict[str, Any] = {
        "epoch": first.get("epoch"), "world_size": len(per_rank),
        "slowest_rank": per_rank[slow].get("rank", slow), "fastest_rank": per_rank[fast].get("rank", fast),
        "steps": max(r["steps"] for r in per_rank),
        "epoch_seconds": max(ep), "epoch_seconds_mean": statistics.fmean(ep), "epoch_seconds_min": min(ep),
        "imbalance": max(ep) / min(ep) if min(ep) > 0 else None,
    }
    if "micro_steps" in first:
        out["micro_steps"] = max(r["micro_steps"] for r in per_rank)
    for k in SUM_KEYS:
        if k in first:
            out[k] = sum(r[k] for r in per_rank)
    for k in SHARED_KEYS:
        if k in first:
            out[k] = first[k]
    for k in SLOWEST_KEYS:
        if k in per_rank[slow]:
            out[k] = per_rank[slow][k]
    # time keys of any rank; one a rank lacks counts as 0 (e.g. skew_wait_seconds in entries written
    # before that phase existed); a key some rank holds as None (not measured there) is left out
    def number(v) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool)

    keys = dict.fromkeys(k for r in per_rank for k in r)
    times = [k for k in keys if k.endswith("_seconds") and k != "epoch_seconds"
             and all(number(r.get(k, 0.0)) for r in per_rank)]
    for k in times:
        vals = [float(r.get(k, 0.0)) for r in per_rank]
        out[k] = max(vals) if k in MAX_KEYS else vals[slow]
        if k not in ("eval_seconds", "elapsed_seconds"):
            out[f"{k}_mean"] = statistics.fmean(vals)
        if k not in MAX_KEYS:
            out[f"{k}_max"] = max(vals)
    timed = [i for i, r in enumerate(per_rank) if number(r.get("train_seconds"))]
    if timed and any(k in first for k in STEP_PERCENTILE_KEYS):  # the spread of T(N): its own rank's steps
        tn_rank = max(timed, key=lambda i: float(per_rank[i]["train_seconds"]))
        out.update({k: per_rank[tn_rank].get(k) for k in STEP_STAT_KEYS})
    if "train_seconds" in out and "skew_wait_seconds" in out:
        out["train_plus_skew_wait_seconds"] = max(
            float(r["train_seconds"]) + float(r.get("skew_wait_seconds") or 0) for r in per_rank)
    t = out.get("train_seconds")
    for rate, count in RATES.items():
        if count in out:
            out[rate] = out[count] / t if t else math.nan
    return out


def epochs_over_ranks(gathered: Sequence[Mapping[str, Any]],
                      combine: Callable[[list[dict[str, Any]]], dict[str, Any]] = aggregate_epoch
                      ) -> list[dict[str, Any]]:
    """Every epoch over the ranks, THE path of every DDP worker: ``gathered`` holds each rank's results
    (:func:`lab_utils.engine.dist.gather`) in rank order, one ``epochs`` entry per epoch; epoch e is
    ``combine`` (:func:`aggregate_epoch`, or a worker's wrapper of it) of the ranks' entries e."""
    return [combine([{**g["epochs"][e], "rank": r} for r, g in enumerate(gathered)])
            for e in range(len(gathered[0]["epochs"]))]


def probe_seconds(probe: Mapping[str, Any], steps: int) -> dict[str, Any]:
    """One rank's ``no_sync`` probe (:class:`~lab_utils.learn.comm_probe.CommProbe`, per step) scaled to an
    epoch of ``steps`` optimizer steps: (b), (c), their overlap and the standard error of (b). A worker
    puts them in its rank's epoch entry, so :func:`aggregate_epoch` takes them from the slowest rank."""
    exposed = float(probe["exposed_per_step_seconds"]) * steps
    allreduce = float(probe["allreduce_per_step_seconds"]) * steps
    overlap, fraction = overlap_figures(exposed, allreduce)
    return {"exposed_comm_seconds": exposed, "allreduce_seconds": allreduce, "overlap_seconds": overlap,
            "overlap_fraction": fraction, "exposed_comm_noise_seconds": float(probe["noise_seconds"]) * steps}
