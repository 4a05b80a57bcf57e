"""The all-reduce benchmark worker, run on every rank under torchrun.

Started by :func:`lab_utils.experiments.comm.measure_bench` through
:func:`lab_utils.launcher.launch` as ``python -m torch.distributed.run ... -m
lab_utils.workers.allreduce_bench --min-bytes 8 --max-bytes N --iters I --warmup W --backend B
--out FILE``. NCCL runs one rank per GPU (``LOCAL_RANK`` selects it); gloo runs CPU
processes.

For each fp32 message size (doubling from ``--min-bytes`` to ``--max-bytes``):

1. correctness: every rank fills the buffer with ``rank + 1``; after a SUM all-reduce
   every element must equal ``P(P+1)/2``;
2. ``--warmup`` untimed all-reduces (connection set-up, NCCL channel and buffer
   allocation, caches);
3. barrier, device synchronize, start the clock; ``--iters`` all-reduces back to back;
   device synchronize, stop the clock. Time per all-reduce = elapsed / iters (seconds),
   then the MAX over ranks (the slowest rank sets the pace, as in a training step).

Rank 0 appends one record per size to ``--out`` (its config:
:meth:`lab_utils.workers.args.BenchArgs.record_config`; status ``error`` when the sum was wrong),
metrics ``count`` (elements), ``time_us`` (slowest rank, microseconds per all-reduce),
``time_us_min_rank``, ``algbw_gb_per_s`` and ``busbw_gb_per_s`` (nccl-tests' definitions,
decimal GB/s), ``correct``. The parent stores them.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from lab_utils.core.hardware import hardware_summary, software_versions
from lab_utils.core.records import Record, append_records
from lab_utils.core.ring import ELEMENT_BYTES, algbw_gb_per_s, busbw_gb_per_s, message_sizes
from lab_utils.launcher import setup_rank_logging
from lab_utils.workers.args import BenchArgs


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


def main(argv: list[str] | None = None) -> int:
    setup_rank_logging()
    a = BenchArgs.from_argv(argv)
    sizes = message_sizes(a.min_bytes, a.max_bytes)

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if a.backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"rank {rank}/{world}: backend {a.backend}, device {device} ({name}), {len(sizes)} sizes",
          flush=True)
    hardware = hardware_summary(device.type, world) if rank == 0 else {}
    try:
        records = []
        for s in sizes:
            m = measure_size(s, a.iters, a.warmup, device, rank, world)
            records.append(Record(
                "allreduce_bench", a.record_config(world, s),
                {k: m[k] for k in ("count", "time_us", "time_us_min_rank", "algbw_gb_per_s", "busbw_gb_per_s",
                                   "correct")},
                status="ok" if m["correct"] else "error",
                reason=None if m["correct"] else "the all-reduce returned a wrong sum",
                hardware=hardware, software=software_versions() if rank == 0 else {}))
            if rank == 0:
                print(f"{s:>12d} B {m['time_us']:>12.1f} us {m['busbw_gb_per_s']:>10.3f} GB/s", flush=True)
        if rank == 0:
            append_records(a.out, records)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
