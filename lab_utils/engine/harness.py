"""THE worker entry point: one job file in, records out, one loop over the job's configurations.

Every worker module (``lab_utils.experiments.nNN_name.*worker``) has the same shape::

    def prepare(job, ctx) -> state        # optional: what all configurations share (data sets)
    def run_config(config, job, ctx, state) -> list[Record]   # rank 0: its records; others: []

    if __name__ == "__main__":
        sys.exit(serve(sys.modules[__name__]))

The parent (:func:`lab_utils.engine.plan.measure`) hands it a :class:`Job` as a JSON file
(:func:`lab_utils.engine.launcher.stream` writes it) and starts it under ``torchrun`` with that file as
its only argument: no command line to build or parse, so the configuration a worker runs is
byte for byte the configuration the store keys its record by. :func:`serve` sets up the rank's
log and the process group, then :func:`execute` runs each configuration in order; rank 0
appends each configuration's records to the job's records file as soon as they exist
(:func:`lab_utils.engine.records.append_records`), so a later failure keeps them.

Failures, one rule for every worker:

- **Out of memory in one process** (no peer waiting): the memory is given back, an ``oom``
  record for that configuration is written, and the job ends there (the plan's order is
  smallest first; :func:`lab_utils.engine.plan.measure` says what the rest become).
- **Any failure under DDP** (more than one rank): the rank writes its failure file (``oom`` or
  ``error``, which configuration) and, where a peer could be left waiting, ends at once
  (:func:`lab_utils.engine.dist.failure_ends_rank`); torchrun stops the others and the launcher
  reads the file, not the log's words. That holds for :func:`serve`'s own work too (rank 0's
  append to the records file on a full or read-only disk, the final barrier): under NCCL,
  ``destroy_process_group()`` with a peer waiting in a collective would block until the run's
  time limit.

:func:`execute` is also how the parent runs a CPU worker in its own process (``in_process``
runs), so both paths share every line but the process boundary.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from lab_utils.engine.dist import DistContext, failure_ends_rank, init_distributed
from lab_utils.engine.launcher import mark_stage, setup_rank_logging
from lab_utils.engine.memory import catch_oom, free_device_memory
from lab_utils.engine.records import Record, append_records


@dataclass
class Job:
    """What a worker runs: ``configs`` in order (each the resume key of its record), ``options``
    shared by all and not part of any key (e.g. where to save a checkpoint), where records go."""

    experiment: str                  # the store's experiment the records belong to
    profile: str
    configs: list[dict[str, Any]]
    options: dict[str, Any] = field(default_factory=dict)
    out: str | None = None           # rank 0 appends the records here (the launcher sets it)
    folder: str | None = None        # where a failing rank writes its failure file (the launcher's)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Job:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})


def oom_record(job: Job, config: Mapping[str, Any], reason: str, ctx: DistContext) -> Record:
    """The ``oom`` row of a configuration that did not fit."""
    return Record(job.experiment, dict(config), status="oom", reason=reason, profile=job.profile,
                  hardware=ctx.hardware())


def execute(worker: ModuleType, job: Job, ctx: DistContext) -> Iterator[list[Record]]:
    """Run ``job``'s configurations in order with ``worker``; yield each one's records (rank 0's).
    Failures: the module docstring's rule."""
    prepare = getattr(worker, "prepare", None)
    with failure_ends_rank(ctx, job.folder, None):
        state = prepare(job, ctx) if prepare is not None else None
    for index, config in enumerate(job.configs):
        mark_stage(job.folder, ctx.rank, f"in configuration {index + 1} of {len(job.configs)}")
        if ctx.ddp:
            with failure_ends_rank(ctx, job.folder, index):
                records = worker.run_config(config, job, ctx, state)
        else:
            with catch_oom() as oom:
                records = worker.run_config(config, job, ctx, state)
            if oom:  # outside the handler: the failed step's tensors are gone, give the memory back
                free_device_memory(ctx.device)
                yield [oom_record(job, config, oom.reason, ctx)]
                return
        yield records if ctx.rank == 0 else []


def serve(worker: ModuleType, argv: list[str] | None = None) -> int:
    """``python -m lab_utils.experiments.nNN_name.<worker> JOB.json``: run the job; rank 0 appends the
    records."""
    setup_rank_logging()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or not Path(argv[0]).is_file():
        print(f"usage: python -m {worker.__name__} JOB.json (a job file written by "
              f"lab_utils.engine.launcher); got {argv}", file=sys.stderr, flush=True)
        return 2
    job = Job.from_dict(json.loads(Path(argv[0]).read_text(encoding="utf-8")))
    rank = int(os.environ.get("RANK", "0"))
    mark_stage(job.folder, rank, "joining the process group (NCCL: creating its communicator)")
    # one process driving several GPUs itself (DataParallel) needs no process group
    ctx = (init_distributed(job.options.get("backend", "auto"), folder=job.folder)
           if job.options.get("process_group", True)
           else DistContext(device=torch.device("cuda" if torch.cuda.is_available() else "cpu")))
    # What the rank holds so far (torch, the worker's modules, the process group) lives as long as the
    # rank: gc.freeze() takes it out of the cyclic collector's walk, so that the gc.collect() a
    # configuration ends with (free_device_memory, replica_memory.memory_use) walks only what the job made
    # since: 75 ms instead of 175 ms a call here, and nothing of the job is frozen (none exists yet).
    gc.freeze()
    try:
        with failure_ends_rank(ctx, job.folder, None):   # under NCCL: no teardown with a peer waiting
            for records in execute(worker, job, ctx):
                if records:
                    append_records(job.out, records)
            mark_stage(job.folder, ctx.rank, "in the final barrier (waiting for the other ranks)")
            if dist.is_initialized():
                dist.barrier()
    except Exception:
        traceback.print_exc()
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
