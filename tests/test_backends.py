"""lab_utils.engine.backends: the training paths set cuDNN's autotuning, and every record states
the cuDNN / matmul settings it was measured under."""

from __future__ import annotations

import json

import pytest
import torch
from store_helpers import lab_for, put

from lab_utils.engine import backends, profiles
from lab_utils.engine.store import Record

KEYS = {"cudnn_benchmark", "cudnn_deterministic", "cudnn_allow_tf32", "matmul_allow_tf32",
        "float32_matmul_precision"}


@pytest.fixture
def benchmark_off(monkeypatch):
    """cuDNN autotuning off, as in a fresh process; restored after the test."""
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


def test_settings_report_and_apply(benchmark_off):
    now = backends.backend_settings()
    assert set(now) == KEYS and now["cudnn_benchmark"] is False
    assert now["float32_matmul_precision"] == torch.get_float32_matmul_precision()
    applied = backends.apply_training_backends()
    assert torch.backends.cudnn.benchmark is True and applied["cudnn_benchmark"] is True
    assert backends.apply_training_backends(cudnn_benchmark=False)["cudnn_benchmark"] is False


def test_a_record_built_anywhere_carries_the_settings(benchmark_off, store):
    bare = Record("anything", {"a": 1})
    assert set(bare.backends) == KEYS and bare.backends["cudnn_benchmark"] is False
    backends.apply_training_backends()
    stored = put(store, "anything", {"a": 2}, {"seconds": 1.0})
    assert stored.backends["cudnn_benchmark"] is True
    line = json.loads(store.path("anything").read_text().splitlines()[-1])
    assert line["backends"] == stored.backends
    # Reading it back keeps the stored settings, not this process's.
    torch.backends.cudnn.benchmark = False
    assert store.get("anything", {"a": 2}).backends["cudnn_benchmark"] is True
    # A record stored before the field existed says nothing rather than today's settings.
    legacy = {k: v for k, v in line.items() if k != "backends"}
    assert Record.from_dict(legacy).backends == {}


def test_training_paths_apply_the_settings(benchmark_off):
    from lab_utils.experiments.n04_allreduce import compute_step_worker as compute_step
    from lab_utils.experiments.n08_speed_limits import fast_train

    compute_step.measure_compute_step_seconds(width=2, batch_size=2, device="cpu", steps=1, warmup=0)
    assert torch.backends.cudnn.benchmark is True
    torch.backends.cudnn.benchmark = False
    fast_train.build_trainer(fast_train.TrainOptions(), width=2, device="cpu")
    assert torch.backends.cudnn.benchmark is True


def test_sweep_records_state_the_settings(benchmark_off, store):
    from lab_utils.engine.plan import measure
    from lab_utils.experiments.n01_batch_sweep import experiment as sweep

    s = profiles.settings(sweep.Settings, "quick", batch_sizes=(16,), width=2, train_images=32,
                          test_images=16, dataset="synthetic", memory_cap_bytes=0)
    rec = measure(lab_for(store), sweep.SWEEP_EXPERIMENT, s, verbose=False)[0]
    assert rec.status == "ok" and rec.backends["cudnn_benchmark"] is True
    assert store.latest(sweep.EXPERIMENT)[0].backends == rec.backends
