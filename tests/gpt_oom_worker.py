"""Test worker (tests/test_gpu_defects.py): the GPT worker, with rank 1 out of memory in its first step.

Launched under torchrun in place of ``lab_utils.experiments.n06_gpt_ddp.worker`` (the same ``run_config``,
through the
lab's one worker entry): rank 1's training loop raises the caching allocator's ``torch.OutOfMemoryError``
as its first epoch starts, while rank 0 goes on into DDP's gradient all-reduce and waits for it there.
"""

from __future__ import annotations

import os
import sys

import torch

from lab_utils.engine.harness import serve
from lab_utils.experiments.n06_gpt_ddp import worker as gpt_train
from lab_utils.experiments.n06_gpt_ddp.worker import (  # noqa: F401  (this module is the worker)
    METRICS_VERSION,
    run_config,
)

_real_run_epoch = gpt_train.run_epoch


def _run_epoch(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 1:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test: rank 1)")
    return _real_run_epoch(*args, **kwargs)


gpt_train.run_epoch = _run_epoch

if __name__ == "__main__":
    sys.exit(serve(sys.modules[__name__]))
