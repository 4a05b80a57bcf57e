"""Train ResNet-18 with ``nn.DataParallel`` over a node's GPUs, in a process of its own (notebooks 02, 03).

Started by :func:`lab_utils.launcher.launch` with ONE process (``nproc=1``), like a one-rank DDP run:
DataParallel opens a CUDA context on every GPU it uses, and in the notebook's kernel that context would
stay there, taking memory from GPU 0 before the next ``torchrun`` launch (and, on a node in
EXCLUSIVE_PROCESS compute mode, keeping the ranks from creating their own). Command line::

    python -m lab_utils.workers.dataparallel <the DDP worker's options, one --batch-size> \
        --gpus N [--threads K]

``--batch-size`` is per GPU: DataParallel splits each global batch of N x batch over GPUs 0..N-1 in
this one process (it scatters the inputs, replicates the model from GPU 0 every step and reduces the
gradients onto GPU 0: no ring all-reduce). ``--threads K``: torch threads, pinned for the run (the
quick profile's rule, as the DDP workers'); without it torch's own.

Output (the workers' protocol: appended to ``--out``): one :class:`~lab_utils.core.records.Record`,
epoch ``epochs`` reported, its times those of the whole DataParallel step (one process); status
``oom`` with the allocator's words when the batch does not fit (:func:`lab_utils.core.memory.catch_oom`;
the model, optimizer and loaders are dropped and the cache emptied after the ``with`` statement).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from lab_utils.core.backends import apply_training_backends, pinned_threads
from lab_utils.core.data import make_loaders
from lab_utils.core.errors import LabError
from lab_utils.core.hardware import hardware_summary
from lab_utils.core.loop import make_optimizer, run_epoch, wrap_data_parallel
from lab_utils.core.memory import catch_oom, free_device_memory
from lab_utils.core.records import Record, append_records
from lab_utils.launcher import setup_rank_logging
from lab_utils.models import ResNet18, count_parameters
from lab_utils.workers.args import WorkerArgs

METHOD = "DataParallel"
BACKEND = "single process"
TIME_RULE = "one process: epoch and training times of the whole DataParallel step"


def dp_config(args: WorkerArgs, devices: int) -> dict[str, Any]:
    """A DataParallel record's config: the DDP worker's keys, with the method and backend changed."""
    cfg = args.record_config(devices, "nccl")
    cfg.update({"method": METHOD, "backend": BACKEND, "device_type": "cuda", "comm_steps": None,
                "bucket_cap_mb": None, "measure_comm": False})
    return cfg


def train_dp(args: WorkerArgs, n: int, held: dict[str, Any]) -> tuple[list[dict[str, Any]], int]:
    """Train ``args.epochs`` epochs with DataParallel on ``n`` GPUs; (per-epoch history, parameters).

    Everything that holds device memory is also put in ``held`` (and is otherwise local to
    this frame), so that the caller can drop it all after an out-of-memory failure.
    """
    held["loaders"] = loaders = make_loaders(
        batch_size=args.batch_size * n, num_workers=args.num_workers, train_images=args.train_images,
        test_images=args.test_images, dataset=args.dataset, seed=args.seed)
    torch.manual_seed(args.seed)
    held["model"] = model = ResNet18(width=args.width).cuda()
    params = count_parameters(model)
    held["dp"] = dp = wrap_data_parallel(model, device_ids=list(range(n)))
    held["optimizer"] = opt = make_optimizer(dp, lr=args.lr)
    history = [run_epoch(dp, loaders.train, opt, "cuda:0", epoch=epoch).as_dict()
               for epoch in range(1, args.epochs + 1)]
    return history, params


def run_dp(args: WorkerArgs, n: int, threads: int | None = None) -> Record:
    """DataParallel over GPUs 0..n-1 in this process, global batch n x per-GPU batch: the record."""
    cfg = dp_config(args, n)
    synthetic = args.dataset == "synthetic"
    common = {"profile": args.profile, "synthetic": synthetic,
              "dataset": "synthetic CIFAR-10 stand-in" if synthetic else "CIFAR-10",
              "hardware": {**hardware_summary("cuda", n), "processes": 1, "backend": BACKEND}}
    experiment = args.experiment or "scaling"
    apply_training_backends()
    held: dict[str, Any] = {}  # what holds device memory, dropped before the cache is emptied
    with pinned_threads(threads) as used, catch_oom() as oom:
        history, params = train_dp(args, n, held)
    held.clear()
    free_device_memory("cuda")
    if oom:
        return Record(experiment, cfg, status="oom", reason=oom.reason, **common)
    last = history[-1]
    metrics = {k: v for k, v in last.items() if k != "epoch"}
    metrics.update({"reported_epoch": last["epoch"], "epochs": history, "world_size": n,
                    "backend": BACKEND, "device_type": "cuda", "parameters": params,
                    "threads_per_rank": used, "threads_pinned": threads is not None,
                    "gradient_bytes": 4 * params, "steps_per_epoch": last["steps"],
                    "global_batch": args.batch_size * n, "time_rule": TIME_RULE})
    return Record(experiment, cfg, metrics, **common)


def parse(argv: list[str] | None = None) -> tuple[WorkerArgs, int, int | None]:
    """``(worker args for one batch size, GPUs, pinned threads or None)`` from a command line."""
    p = argparse.ArgumentParser(prog="python -m lab_utils.workers.dataparallel", add_help=False)
    p.add_argument("--gpus", type=int, required=True, help="DataParallel over GPUs 0..N-1")
    p.add_argument("--threads", type=int, default=None, help="torch threads, pinned (default: torch's)")
    ours, rest = p.parse_known_args(argv)
    args = WorkerArgs.from_argv(rest).resolved()
    if not isinstance(args.batch_size, int):
        raise LabError("The DataParallel worker runs one --batch-size at a time.")
    if ours.gpus < 1:
        raise LabError(f"--gpus must be 1 or more, got {ours.gpus}.")
    return args, ours.gpus, ours.threads


def main(argv: list[str] | None = None) -> int:
    setup_rank_logging()
    try:
        args, gpus, threads = parse(argv)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    append_records(args.out, [run_dp(args, gpus, threads)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
