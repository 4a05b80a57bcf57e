"""Test worker (tests/test_gpu_first_session.py): a torchrun worker of the lab failing on one rank as it
would under NCCL.

``LAB_TEST_WORKER`` names the worker (``ddp`` or ``gpt_train``), run through the lab's one worker entry
(:func:`lab_utils.engine.harness.serve`: the job file is its argument). Rank 1 raises a non-OOM CUDA error as
its first epoch starts, while rank 0 goes on into DDP's gradient all-reduce and waits for it there.
gloo carries the collectives, but the rank's context says ``nccl`` and ``destroy_process_group`` blocks,
as NCCL's can while a peer is still inside a collective: a rank that tears its group down before it
exits never exits, and the run hangs until its time limit.
"""

from __future__ import annotations

import importlib
import os
import sys
import time

import torch.distributed as dist

from lab_utils.engine import harness

WORKERS = {"ddp": "lab_utils.experiments.n02_scaling.ddp_worker",
           "gpt_train": "lab_utils.experiments.n06_gpt_ddp.worker"}
worker = importlib.import_module(WORKERS[os.environ["LAB_TEST_WORKER"]])
_real_init, _real_run_epoch = harness.init_distributed, worker.run_epoch


def _init(*args, **kwargs):
    ctx = _real_init(*args, **kwargs)
    ctx.backend = "nccl"          # what the rank would be on GPUs; gloo runs the collectives here
    return ctx


def _run_epoch(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 1:
        raise RuntimeError("CUDA error: an illegal memory access was encountered (test: rank 1)")
    return _real_run_epoch(*args, **kwargs)


def _blocking_destroy(*args, **kwargs):
    time.sleep(3600)              # NCCL waiting for the collective rank 0 is stuck in


harness.init_distributed, worker.run_epoch = _init, _run_epoch
dist.destroy_process_group = _blocking_destroy

if __name__ == "__main__":
    sys.exit(harness.serve(worker))
