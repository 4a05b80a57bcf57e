"""The all-reduce benchmark worker, run on every rank under torchrun (:mod:`lab_utils.engine.harness`).

Each configuration of the job is one fp32 message size (``world_size``, ``backend``, ``size_bytes``,
``iters``, ``warmup``: :func:`lab_utils.experiments.n04_allreduce.experiment.plan_bench`). NCCL runs one rank
per GPU, gloo CPU processes. For each size, :func:`measure_size`:

1. correctness: every rank fills the buffer with ``rank + 1``; after a SUM all-reduce
   every element must equal ``P(P+1)/2``;
2. ``warmup`` untimed all-reduces (connection set-up, NCCL channel and buffer
   allocation, caches);
3. barrier, device synchronize, start the clock; ``iters`` all-reduces back to back;
   device synchronize, stop the clock. Time per all-reduce = elapsed / iters (seconds),
   then the MAX over ranks (the slowest rank sets the pace, as in a training step).

Rank 0's record per size: metrics ``count`` (elements), ``time_us`` (slowest rank, microseconds
per all-reduce), ``time_us_min_rank``, ``algbw_gb_per_s`` and ``busbw_gb_per_s`` (nccl-tests'
definitions, decimal GB/s), ``correct``; status ``error`` when the sum was wrong.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import software_versions
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.records import Record
from lab_utils.learn.alpha_beta import ELEMENT_BYTES
from lab_utils.learn.errors import LabError
from lab_utils.learn.ring import algbw_gb_per_s, busbw_gb_per_s

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_size(size_bytes: int, iters: int, warmup: int, device: torch.device, rank: int,
                 world: int) -> dict:
    """Check, warm up and time all-reduces of one message size; return the record of this size."""
    count = size_bytes // ELEMENT_BYTES
    buf = torch.empty(count, dtype=torch.float32, device=device)
    buf.fill_(rank + 1)
    dist.all_reduce(buf)
    expected = world * (world + 1) / 2
    ok = torch.tensor([1.0 if bool(torch.all(buf == expected)) else 0.0], dtype=torch.float64, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    buf.zero_()  # zeros stay zeros: repeated sums cannot overflow
    for _ in range(warmup):
        dist.all_reduce(buf)
    _sync(device)
    dist.barrier()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        dist.all_reduce(buf)
    _sync(device)
    per_op = (time.perf_counter() - start) / iters
    times = torch.tensor([per_op, -per_op], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # [max over ranks, -min over ranks]
    slowest, fastest = float(times[0]), -float(times[1])
    algbw = algbw_gb_per_s(size_bytes, slowest)
    del buf
    return {"size_bytes": size_bytes, "count": count, "dtype": "float32", "world_size": world,
            "iters": iters, "warmup": warmup, "time_us": slowest * 1e6, "time_us_min_rank": fastest * 1e6,
            "algbw_gb_per_s": algbw, "busbw_gb_per_s": busbw_gb_per_s(algbw, world),
            "correct": bool(float(ok[0]) == 1.0)}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: Any) -> list[Record]:
    """Time one message size on every rank; rank 0 returns its record."""
    if config["world_size"] != ctx.world_size:
        raise LabError(f"The configuration is for {config['world_size']} ranks; the job has {ctx.world_size}")
    m = measure_size(config["size_bytes"], config["iters"], config["warmup"], ctx.device, ctx.rank,
                     ctx.world_size)
    if ctx.rank != 0:
        return []
    print(f"{m['size_bytes']:>12d} B {m['time_us']:>12.1f} us {m['busbw_gb_per_s']:>10.3f} GB/s", flush=True)
    keep = ("count", "time_us", "time_us_min_rank", "algbw_gb_per_s", "busbw_gb_per_s", "correct")
    return [Record(job.experiment, dict(config), {k: m[k] for k in keep},
                   status="ok" if m["correct"] else "error",
                   reason=None if m["correct"] else "the all-reduce returned a wrong sum",
                   profile=job.profile, hardware=ctx.hardware(), software=software_versions())]


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
