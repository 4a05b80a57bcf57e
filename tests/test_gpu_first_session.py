"""Issue 33: the defects a read of the CUDA paths found that would crash, hang or mislabel a student's
first session on a GPU node, each run on this CPU machine.

Every test here failed on the code before its fix and passes after it (the commit that fixed each
says so); the fake GPU (tests/fake_gpu.py) stands in for the device, and gloo runs stand in for NCCL
where a launch is needed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lab_utils import launcher
from lab_utils.core.errors import LaunchError
from lab_utils.workers.args import TrainConfig, WorkerArgs

TESTS = Path(__file__).resolve().parent

# --------------------------------------------------------------------------- 2. a failing rank under NCCL


def test_under_nccl_any_error_ends_the_rank_and_under_gloo_it_propagates(monkeypatch, capsys):
    from lab_utils.core import dist

    exits = []

    def fake_exit(code):
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(dist.os, "_exit", fake_exit)
    nccl = dist.DistContext(rank=1, world_size=2, backend="nccl")
    with pytest.raises(SystemExit), dist.failure_ends_rank(nccl):
        raise RuntimeError("CUDA error: an illegal memory access was encountered\nmore")
    assert exits == [1]
    err = capsys.readouterr().err
    assert "RuntimeError on rank 1 of 2: CUDA error: an illegal memory access was encountered; this" in err
    assert "Traceback" in err
    for ctx in (dist.DistContext(rank=1, world_size=2, backend="gloo"), dist.DistContext(backend="nccl")):
        with pytest.raises(ValueError), dist.failure_ends_rank(ctx):
            raise ValueError("propagates")
    assert exits == [1]


def _test_env(worker: str) -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": str(TESTS) + (os.pathsep + path if path else ""), "LAB_TEST_WORKER": worker}


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("worker", ["ddp", "gpt_train"])
def test_a_rank_failing_under_nccl_ends_at_once_and_the_launch_names_it(worker, tmp_path):
    """Rank 1 of 2 raises a CUDA error (not out of memory) while rank 0 waits in the gradient all-reduce
    (tests/failing_rank_worker.py: the rank says nccl, destroy_process_group blocks as NCCL's can).

    Before: rank 1 ran destroy_process_group() in a finally, which never returned; the launch hung
    until its time limit. Now it writes its error line and leaves with os._exit: torchrun sees it and
    stops rank 0 at once, and the launch error quotes rank 1's line."""
    if worker == "ddp":
        args = WorkerArgs(profile="quick", batch_size=4, epochs=1, width=2, train_images=32, num_workers=0,
                          dataset="synthetic", backend="gloo").validate().to_argv()
    else:
        args = TrainConfig(size="tiny", batch_size=2, epochs=1, max_steps=2, steps_per_epoch=2, dtype="fp32",
                           max_chars=20_000, val_batches=1, device="cpu").validate().to_argv()
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as e:
        launcher.launch("failing_rank_worker", args, nproc=2, timeout_s=75, log_dir=tmp_path,
                        env=_test_env(worker), threads_per_rank=1)
    took = time.perf_counter() - t0
    text = str(e.value)
    assert "did not finish within" not in text and took < 60, (took, text[:400])
    assert "failed (torchrun exit code" in text and "Last lines of rank 1" in text
    assert "RuntimeError on rank 1 of 2: CUDA error: an illegal memory access was encountered" in text
