"""The exercises of notebook 09 (data parallelism by hand): averaging gradients in gloo ranks,
DDP's buckets, optimizer shards, the exposed communication."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from lab_utils.app.grading.exercises.answers import fmt, plain
from lab_utils.app.grading.exercises.exercise import Exercise, Mistake

# --------------------------------------------------------------------------- q09: data parallelism by hand


# How long q09_average's forked gloo ranks get to meet and answer (s). Below the grader's case limit
# (lab_utils.app.grading.sandbox.Limits.case_seconds, 20 s), so that a deadlocked answer (an all-reduce on
# one rank only) ends here as "timed out" with its ranks killed, not at the case alarm with its ranks
# left running; above the 10 s that `make student` once needed on a loaded node for the master's answers.
RANKS_TIMEOUT_S = 15.0


def _average_call(fn: Callable, case: dict) -> Any:
    """Case ``{"grads": [rank 0's gradients, rank 1's, ...]}`` (each a list of nested lists): ``fn`` runs
    in that many gloo ranks (:func:`lab_utils.engine.fork_ranks.run_in_ranks`, forked processes), each on its
    own gradients as float32 tensors. The answer, per rank: ``{"grads": what the given tensors hold
    afterwards, "returns": what fn returned}`` (:func:`_returned`); None (not done yet) when a rank's fn
    returned None and changed nothing."""
    import torch

    from lab_utils.engine.fork_ranks import run_in_ranks

    def rank(r: int, world: int) -> Any:
        given = [torch.tensor(g, dtype=torch.float32) for g in case["grads"][r]]
        before = [g.clone() for g in given]
        out = fn(given)
        if out is None and all(torch.equal(g, b) for g, b in zip(given, before)):
            return None
        return {"grads": [g.tolist() for g in given], "returns": _returned(out, given)}

    answers = run_in_ranks(rank, len(case["grads"]), timeout_s=RANKS_TIMEOUT_S)
    for r, a in enumerate(answers):
        if isinstance(a, dict) and "error" in a:
            raise RuntimeError(f"on rank {r} of {len(answers)}: {a['error']}")
    return None if any(a is None for a in answers) else plain(answers)


#: What q09_average's answer says it returned: the list it was given (or its tensors), or not.
RETURNS_GRADS = "the tensors it was given"


def _returned(out: Any, given: list) -> str:
    if out is None:
        return "None"
    if isinstance(out, (list, tuple)) and len(out) == len(given) and all(o is g for o, g in zip(out, given)):
        return RETURNS_GRADS
    if isinstance(out, (list, tuple)) and all(hasattr(o, "shape") for o in out):
        return "new tensors"
    return f"a {type(out).__name__}"


def _average_show(case: dict) -> str:
    held = "; ".join(f"rank {r} holds {g}" for r, g in enumerate(case["grads"]))
    return f"average_gradients on {len(case['grads'])} gloo ranks ({held})"


def _average_hint(got: Any, want: Any) -> str:
    """What the prompt requires and the answer lacks: the return value, then the work in place."""
    if not (isinstance(got, list) and all(isinstance(r, dict) and "returns" in r for r in got)):
        return ""
    returns = {r["returns"] for r in got}
    if "None" in returns:
        return "average_gradients returns None: the prompt asks it to return grads, the list it was given"
    if "new tensors" in returns:
        return ("it returns new tensors: the prompt asks for the mean in place, in the tensors of grads "
                "(g /= n changes g, g = g / n makes a new tensor), and grads returned")
    if returns != {RETURNS_GRADS}:
        return f"it returns {sorted(returns)[0]}: the prompt asks it to return grads, the list it was given"
    return "the tensors of grads do not hold the mean over the ranks afterwards"


def _average(grads, before=False, reduce=True, after="world", copy=False, give_back=True):
    """Gradient averaging with one known mistake switched on (the right one with none): divide by the
    world size ``before`` the all-reduce too, skip the all-reduce, divide ``after`` it by 2 or not, work
    on a ``copy`` (new tensors returned, the given ones unchanged), or forget to ``give_back`` grads."""
    import torch.distributed as dist

    world = dist.get_world_size()
    work = [g.clone() for g in grads] if copy else grads
    for g in work:
        if before:
            g /= world
        if reduce:
            dist.all_reduce(g)
        if after:
            g /= world if after == "world" else after
    return work if give_back else None


def _ddp_buckets(sizes, cap, first, forward=False, under=False, above=False, first_ignored=False,
                 first_everywhere=False, drop_last=False):
    """DDP's bucket rule with one known mistake switched on (the right one with none)."""
    order = range(len(sizes)) if forward else reversed(range(len(sizes)))
    buckets, current, filled = [], [], 0
    for i in order:
        limit = first if (first_everywhere or not buckets) and not first_ignored else cap
        if under and current and filled + sizes[i] > limit:   # the stay-under rule: close BEFORE it
            buckets.append(current)
            current, filled = [], 0
            limit = cap
        current.append(i)
        filled += sizes[i]
        if not under and (filled > limit if above else filled >= limit):
            buckets.append(current)
            current, filled = [], 0
    if current and not drop_last:
        buckets.append(current)
    return buckets


def _exposed(bucket_bytes, gradient_bytes, world_size, alpha_seconds, bandwidth_bytes_per_s,
             backward_seconds, overlap=True, queue=True, floor=False, ring_steps=True):
    """Exercise 09-d's exposed seconds with one known mistake switched on (the right one with none)."""
    s, p, t = gradient_bytes, world_size, backward_seconds
    k = max(1, math.floor(s / bucket_bytes) if floor else math.ceil(s / bucket_bytes))
    c = (2 * (p - 1) if ring_steps else 1) * alpha_seconds + 2 * (p - 1) / p * (s / k) / bandwidth_bytes_per_s
    if not overlap:
        return k * c
    return max(c, t / k + k * c - t) if queue else c


def _shards_floor(numel, world_size):
    size = numel // world_size
    return [(r * size, (r + 1) * size) for r in range(world_size)]


def _shards_last(numel, world_size):
    size = numel // world_size
    return [(r * size, (r + 1) * size if r < world_size - 1 else numel) for r in range(world_size)]


def _shards_ceil(numel, world_size):
    size = -(-numel // world_size)
    return [(min(r * size, numel), min((r + 1) * size, numel)) for r in range(world_size)]


def _shards_inclusive(numel, world_size):
    base, extra = divmod(numel, world_size)
    out, start = [], 0
    for r in range(world_size):
        size = base + (1 if r < extra else 0)
        out.append((start, start + size - 1))
        start += size
    return out


# --------------------------------------------------------------------------- the exercises


#: Notebook 09's exercises, in the order of :data:`lab_utils.app.grading.exercises.EXERCISES`.
EXERCISES: tuple[Exercise, ...] = (
    Exercise(
        "q09_average", "average_gradients", call=_average_call, show=_average_show, hint=_average_hint,
        rel_tol=1e-5, abs_tol=1e-6, needs=("torch", "torch.distributed", "lab_utils.learn.handmade"),
        implemented_by=("lab_utils.learn.handmade.Naive",),
        giveaways=(r"re:/=\s*(dist\.)?get_?world_?size\(\)", r"re:grad /=\s*self\.world",
                   "then divided by the number of ranks", "leaves the sum over ranks on every rank"),
        mistakes=(
            Mistake("summing without dividing", "an all-reduce adds the ranks' gradients: divide by the "
                    "number of ranks for their mean, the gradient of the global batch",
                    wrong=lambda grads: _average(grads, after=None)),
            Mistake("dividing twice", "divide by the number of ranks once, before or after the all-reduce, "
                    "not both", wrong=lambda grads: _average(grads, before=True)),
            Mistake("two ranks hard-coded", "divide by dist.get_world_size(), not by 2",
                    wrong=lambda grads: _average(grads, after=2)),
            Mistake("no all-reduce", "each rank divided its own gradient: the ranks never exchanged "
                    "anything, so they still disagree", wrong=lambda grads: _average(grads, reduce=False)),
            Mistake("new tensors, not in place", "the averages went into new tensors and grads kept this "
                    "rank's own values: change the tensors of grads themselves (dist.all_reduce(g) and "
                    "g /= n work in place) and return grads", wrong=lambda grads: _average(grads, copy=True)),
            Mistake("the return missing", "grads hold the mean, but average_gradients returns None: the "
                    "prompt asks it to return grads (end it with return grads)",
                    wrong=lambda grads: _average(grads, give_back=False)),
        )),
    Exercise(
        "q09_buckets", "assign_buckets", implemented_by=("lab_utils.learn.bucketing.assign_buckets",),
        giveaways=(r"re:if filled\s*>=", r"re:for i in reversed\(range\(len\(sizes"),
        mistakes=(
            Mistake("forward order", "backward produces the LAST layer's gradient first: fill buckets from "
                    "the last parameter backwards", wrong=partial(_ddp_buckets, forward=True)),
            Mistake("the stay-under-the-cap rule", "closing a bucket BEFORE a parameter would take it over "
                    "the cap is a valid design, but not DDP's, which this asks for: DDP adds the parameter, "
                    "then closes the bucket once it holds at least its cap",
                    wrong=partial(_ddp_buckets, under=True)),
            Mistake("a full bucket left open", "a bucket that holds exactly its cap is full: DDP closes it "
                    "once it reaches OR exceeds the cap (>=)", wrong=partial(_ddp_buckets, above=True)),
            Mistake("the first cap ignored", "the first bucket (the first one sent) has its own cap, "
                    "first_cap_bytes; every later one cap_bytes",
                    wrong=partial(_ddp_buckets, first_ignored=True)),
            Mistake("the first cap everywhere", "only the first bucket has first_cap_bytes; every later "
                    "one closes at cap_bytes", wrong=partial(_ddp_buckets, first_everywhere=True)),
            Mistake("a parameter missed", "the last bucket, still open when the loop ends, holds parameters "
                    "too: append it", wrong=partial(_ddp_buckets, drop_last=True)),
        )),
    Exercise(
        "q09_shards", "shard_bounds", implemented_by=("lab_utils.learn.bucketing.shard_bounds",),
        giveaways=(r"re:divmod\(numel,\s*world_?size\)", r"re:min\(r \+ 1, extra\)"),
        mistakes=(
            Mistake("the remainder dropped", "with numel // world_size elements per shard, the last numel % "
                    "world_size elements belong to no rank: no rank steps them", wrong=_shards_floor),
            Mistake("the remainder on the last rank", "shard sizes must differ by at most one: give one "
                    "extra element to each of the first numel % world_size ranks", wrong=_shards_last),
            Mistake("ceil-sized shards", "shards of ceil(numel / world_size) leave the last ranks short or "
                    "empty (sizes differ by more than one)", wrong=_shards_ceil),
            Mistake("end inclusive", "end is one past the shard's last element: shards [start, end) meet "
                    "without a gap", wrong=_shards_inclusive),
        )),
    Exercise(
        "q09_exposed", "exposed_seconds", call=lambda fn, case: plain(fn(**case)), rel_tol=1e-6,
        implemented_by=("lab_utils.learn.traffic.overlap_exposed_seconds",
                        "lab_utils.learn.traffic.optimal_bucket_bytes"),
        show=lambda case: "exposed_seconds(" + ", ".join(f"{k}={fmt(v)}" for k, v in case.items()) + ")",
        giveaways=("T/k + k c - T", r"re:max\(\s*c\s*,\s*t\s*/\s*k", "they queue from the first bucket on",
                   "a bucket's communication takes exactly as long as its computation"),
        mistakes=(
            Mistake("no overlap", "the all-reduces of the first k - 1 buckets run while backward goes on: "
                    "not all k of them are exposed", wrong=partial(_exposed, overlap=False)),
            Mistake("the last bucket only", "when a bucket's all-reduce takes longer than backward takes to "
                    "make the next bucket, the all-reduces queue up and more than the last one is left "
                    "after backward", wrong=partial(_exposed, queue=False)),
            Mistake("buckets rounded down", "k = ceil(S / bucket_bytes): a partial last bucket is a bucket "
                    "too", wrong=partial(_exposed, floor=True)),
            Mistake("alpha once per all-reduce", "a ring all-reduce takes 2(P-1) steps, each paying alpha "
                    "(notebook 04)", wrong=partial(_exposed, ring_steps=False)),
        )),
)
