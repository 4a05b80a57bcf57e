"""Train ResNet-18 with ``nn.DataParallel`` over a node's GPUs, in a process of its own (notebooks 02, 03).

Launched like every GPU run (:func:`lab_utils.engine.plan.measure`) with ONE process: DataParallel opens a
CUDA context on every GPU it uses, and in the notebook's kernel that context would stay there,
taking memory from GPU 0 before the next ``torchrun`` launch (and, on a node in EXCLUSIVE_PROCESS
compute mode, keeping the ranks from creating their own). The job's configurations are
:class:`lab_utils.experiments.n02_scaling.ddp_worker.RunConfig` dicts with ``method`` "DataParallel" and
``devices`` N.

``batch_size`` is per GPU: DataParallel splits each global batch of N x batch over GPUs 0..N-1 in
this one process (it scatters the inputs, replicates the model from GPU 0 every step and reduces
the gradients onto GPU 0: no ring all-reduce). One record per configuration, epoch ``epochs``
reported, its times those of the whole DataParallel step; out of memory is the harness's ``oom``
record (the model, optimizer and loaders are dropped with the failed frame).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

import torch

from lab_utils.engine.backends import apply_training_backends
from lab_utils.engine.dist import DistContext
from lab_utils.engine.hardware import hardware_summary
from lab_utils.engine.harness import Job, serve
from lab_utils.engine.records import Record
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.shared.data import make_loaders
from lab_utils.learn.devices import wrap_data_parallel
from lab_utils.learn.loop import make_optimizer, run_epoch
from lab_utils.learn.models import ResNet18, count_parameters
from lab_utils.learn.ring import gradient_bytes

#: The version of this worker's metrics, in every record's key (:func:`lab_utils.engine.plan.versioned`):
#: bumped when a metric changes meaning, so that a record from an older lab is measured again, not reused.
METRICS_VERSION = 1

METHOD = "DataParallel"
BACKEND = "single process"
TIME_RULE = "one process: epoch and training times of the whole DataParallel step"


def dp_config(args: RunConfig) -> dict[str, Any]:
    """A DataParallel record's config: the DDP worker's keys (``args``, a DDP run's settings), with the
    method and backend changed, no communication probe and no DDP buckets."""
    dp = replace(args, method=METHOD, measure_comm=False, comm_steps=None, bucket_cap_mb=None)
    return {**dp.config(), "backend": BACKEND, "device_type": "cuda"}


def run_config(config: dict[str, Any], job: Job, ctx: DistContext, state: Any) -> list[Record]:
    """Train ``config["epochs"]`` epochs with DataParallel on GPUs 0..devices-1; the record."""
    args = RunConfig.from_config({**config, "backend": "nccl"})
    n = args.devices
    apply_training_backends()
    loaders = make_loaders(batch_size=args.batch_size * n, num_workers=args.num_workers,
                           train_images=args.train_images, test_images=args.test_images, dataset=args.dataset,
                           seed=args.seed)
    torch.manual_seed(args.seed)
    model = ResNet18(width=args.width).cuda()
    params = count_parameters(model)
    dp = wrap_data_parallel(model, device_ids=list(range(n)))
    opt = make_optimizer(dp, lr=args.lr)
    history = [run_epoch(dp, loaders.train, opt, "cuda:0", epoch=epoch).as_dict()
               for epoch in range(1, args.epochs + 1)]
    last = history[-1]
    metrics = {k: v for k, v in last.items() if k != "epoch"}
    metrics.update({"reported_epoch": last["epoch"], "epochs": history, "world_size": n,
                    "backend": BACKEND, "device_type": "cuda", "parameters": params,
                    "threads_per_rank": torch.get_num_threads(), "gradient_bytes": gradient_bytes(model),
                    "steps_per_epoch": last["steps"], "global_batch": args.batch_size * n,
                    "time_rule": TIME_RULE})
    return [Record(job.experiment, dict(config), metrics, profile=job.profile, synthetic=loaders.synthetic,
                   dataset=loaders.dataset_name,
                   hardware={**hardware_summary("cuda", n), "processes": 1, "backend": BACKEND})]


if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
