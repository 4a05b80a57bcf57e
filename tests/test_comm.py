"""Ring all-reduce formulas, the fit, projections, Table 3 rows and the gloo benchmark.

Every expected value below was computed by hand (the arithmetic is in the comments).
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from store_helpers import lab_for, put

from lab_utils.engine import profiles
from lab_utils.engine.hardware import classify_interconnect
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.experiments.n04_allreduce import algorithms as comm_algorithms
from lab_utils.experiments.n04_allreduce import experiment as comm
from lab_utils.experiments.n04_allreduce import projection as comm_projection
from lab_utils.experiments.n04_allreduce import table3 as comm_table3
from lab_utils.experiments.n04_allreduce import tables as comm_tables
from lab_utils.learn import alpha_beta, ring
from lab_utils.learn.errors import LabError

S_RESNET18 = 44_695_848  # 11,173,962 params x 4 bytes


# --------------------------------------------------------------------------- bytes


def test_gradient_bytes_resnet18_fp32():
    from lab_utils.learn.models import ResNet18

    assert comm.gradient_bytes(ResNet18()) == S_RESNET18


def test_gradient_bytes_skips_frozen_and_counts_element_size():
    import torch

    model = torch.nn.Linear(10, 4)  # weight 40 + bias 4 elements
    assert comm.gradient_bytes(model) == 44 * 4
    model.bias.requires_grad_(False)
    assert comm.gradient_bytes(model) == 40 * 4
    assert comm.gradient_bytes(model.to(torch.bfloat16)) == 40 * 2


def test_ring_bytes_per_rank_by_hand():
    assert ring.bus_factor(4) == 1.5  # 2*3/4
    assert ring.bus_factor(1) == 0.0
    assert ring.ring_bytes_per_rank(S_RESNET18, 2) == S_RESNET18  # 2*1/2 = 1
    assert ring.ring_bytes_per_rank(S_RESNET18, 4) == 67_043_772  # 1.5 * 44,695,848
    assert ring.ring_bytes_per_rank(1000, 8) == 1750  # 2*7/8 * 1000
    assert ring.ring_bytes_per_rank(1000, 1) == 0


def test_iterations_follow_distributed_sampler_padding():
    assert ring.iterations_per_epoch(50_000, 128, 1) == 391  # 390.6 -> 391, partial batch kept
    assert ring.iterations_per_epoch(50_000, 128, 4) == 98  # 12,500 per rank / 128 = 97.7
    assert ring.iterations_per_epoch(50_000, 512, 4) == 25  # 12,500 / 512 = 24.4
    assert ring.samples_per_rank(10, 4) == 3  # padded to 12 = 4 x 3
    assert ring.iterations_per_epoch(10, 2, 4) == 2  # 3 samples -> batches of 2 and 1


def test_iterations_match_a_real_distributed_sampler_and_loader():
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    ds = TensorDataset(torch.arange(103))
    for world, batch in [(2, 8), (3, 10), (4, 7)]:
        for rank in range(world):
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
            steps = len(list(DataLoader(ds, batch_size=batch, sampler=sampler)))
            assert steps == ring.iterations_per_epoch(len(ds), batch, world)
            assert len(sampler) == ring.samples_per_rank(len(ds), world)


def test_ring_bytes_per_epoch_by_hand():
    # 98 iterations x 67,043,772 bytes
    assert comm.ring_bytes_per_epoch(S_RESNET18, 4, 50_000, 128) == 6_570_289_656
    # parameter counts are not bytes: the fp32 answer is 4x the count-based one
    count_based = comm.ring_bytes_per_epoch(S_RESNET18 // 4, 4, 50_000, 128)
    assert comm.ring_bytes_per_epoch(S_RESNET18, 4, 50_000, 128) == 4 * count_based


# --------------------------------------------------------------------------- time models

A, B, S = 1e-5, 1e11, 1e9  # 10 us per step, 100 GB/s, 1 GB


def test_ring_time_by_hand():
    # 2*3*1e-5 + 1.5 * 1e9 / 1e11 = 6e-5 + 0.015
    assert ring.ring_allreduce_seconds(S, 4, A, B) == pytest.approx(0.01506, rel=1e-12)
    assert ring.ring_allreduce_seconds(S, 1, A, B) == 0.0


def test_alternatives_by_hand():
    # tree: 2 * ceil(log2 4) * (1e-5 + 0.01) = 4 * 0.01001
    assert ring.tree_allreduce_seconds(S, 4, A, B) == pytest.approx(0.04004, rel=1e-12)
    # tree on 5 ranks: ceil(log2 5) = 3 levels -> 6 hops
    assert ring.tree_allreduce_seconds(S, 5, A, B) == pytest.approx(0.06006, rel=1e-12)
    # recursive doubling on 8: 3 * 0.01001
    assert ring.recursive_doubling_seconds(S, 8, A, B) == pytest.approx(0.03003, rel=1e-12)
    # halving+doubling on 8: 2*3*1e-5 + 1.75 * 0.01
    assert ring.halving_doubling_seconds(S, 8, A, B) == pytest.approx(0.01756, rel=1e-12)
    # the earlier student's formula: (0.01 + 0.005) * log2 8
    assert ring.spec_log2_seconds(0.01, 0.005, 8) == pytest.approx(0.045, rel=1e-12)


def test_ring_is_bandwidth_optimal_and_latency_grows_linearly():
    big = [ring.ring_allreduce_seconds(S, p, 0.0, B) for p in (2, 16, 1024)]
    assert big[0] < big[1] < big[2] < 2 * S / B  # bandwidth term bounded by 2S/B
    # the earlier student's log2 formula keeps growing: at 1024 ranks it is 10x the transfer time
    assert ring.spec_log2_seconds(S / B, 0.0, 1024) == pytest.approx(10 * S / B)
    small = [ring.ring_allreduce_seconds(8, p, A, B) for p in (2, 1024)]
    assert small[1] / small[0] == pytest.approx(2046 / 2, rel=1e-4)  # 2(P-1) alpha dominates


def test_bucketed_ring_by_hand():
    # 44,695,848 B in 25 MiB buckets -> 2 buckets: 2 * 6e-5 + 1.5 * 44,695,848 / 1e11
    expected = 2 * 6e-5 + 1.5 * S_RESNET18 / 1e11
    assert ring.bucketed_ring_seconds(S_RESNET18, 4, A, B) == pytest.approx(expected, rel=1e-12)
    assert ring.bucketed_ring_seconds(S_RESNET18, 4, A, B, bucket_bytes=1e12) == pytest.approx(
        ring.ring_allreduce_seconds(S_RESNET18, 4, A, B), rel=1e-12)


def test_compare_algorithms_frame():
    df = comm_algorithms.compare_algorithms(S, [2, 8], A, B)
    assert list(df.devices) == [2, 8]
    assert df.loc[1, "ring (ms)"] == pytest.approx(1e3 * (14 * A + 1.75 * S / B))
    assert df.loc[1, comm_algorithms.EARLIER_LOG2_COLUMN] == pytest.approx(1e3 * 3 * S / B)


# --------------------------------------------------------------------------- nccl-tests


def test_algbw_busbw_by_hand():
    assert ring.algbw_gb_per_s(1e9, 0.5) == 2.0  # 1e9 B / 0.5 s = 2 GB/s (decimal)
    assert ring.busbw_gb_per_s(2.0, 4) == 3.0  # x 2*3/4
    assert ring.busbw_gb_per_s(2.0, 8) == 3.5  # x 2*7/8
    assert ring.busbw_gb_per_s(2.0, 2) == 2.0
    assert ring.algbw_gb_per_s(2**30, 1.0) == pytest.approx(1.073741824)


def test_bad_inputs_raise_lab_error():
    with pytest.raises(LabError, match="world size"):
        ring.ring_bytes_per_rank(10, 0)
    with pytest.raises(LabError, match="time in seconds"):
        ring.algbw_gb_per_s(10, 0)
    with pytest.raises(LabError, match="per-device batch"):
        ring.iterations_per_epoch(100, 0, 2)
    with pytest.raises(LabError, match="multiple of 4"):
        alpha_beta.message_sizes(6, 64)
    with pytest.raises(LabError, match="max-bytes"):
        alpha_beta.message_sizes(64, 8)


def test_message_sizes_double():
    assert alpha_beta.message_sizes(8, 64) == [8, 16, 32, 64]
    assert alpha_beta.message_sizes(8, 100) == [8, 16, 32, 64]
    assert len(alpha_beta.message_sizes(8, ring.GIB)) == 28  # 2^3 .. 2^30
    assert alpha_beta.message_sizes(8, profiles.settings(comm.Settings, "full").max_bytes)[-1] == 2**30


# --------------------------------------------------------------------------- fit


def _synthetic(alpha, bw, p, noise=0.0, seed=0):
    sizes = np.array(alpha_beta.message_sizes(8, ring.GIB), dtype=float)
    t = np.array([ring.ring_allreduce_seconds(s, p, alpha, bw) for s in sizes])
    if noise:
        t = t * (1 + noise * np.random.default_rng(seed).standard_normal(len(t)))
    return sizes, t


def test_fit_recovers_exact_model():
    sizes, t = _synthetic(5e-6, 50e9, 4)
    fit = alpha_beta.fit_alpha_beta(sizes, t, 4)
    assert fit.alpha_seconds == pytest.approx(5e-6, rel=1e-9)
    assert fit.bandwidth_bytes_per_s == pytest.approx(50e9, rel=1e-9)
    assert fit.rms_relative_error < 1e-9 and fit.max_relative_error < 1e-9
    assert fit.predict_seconds(1e6) == pytest.approx(ring.ring_allreduce_seconds(1e6, 4, 5e-6, 50e9))
    # busbw of the model tends to B for large messages
    assert fit.predict_busbw_gb_per_s(1e12) == pytest.approx(50.0, rel=1e-3)


def test_fit_recovers_model_under_noise_with_honest_errors():
    sizes, t = _synthetic(20e-6, 2e9, 2, noise=0.03, seed=1)
    fit = alpha_beta.fit_alpha_beta(sizes, t, 2)
    assert fit.alpha_seconds == pytest.approx(20e-6, rel=0.05)
    assert fit.bandwidth_bytes_per_s == pytest.approx(2e9, rel=0.05)
    assert 0.01 < fit.rms_relative_error < 0.06
    assert abs(fit.alpha_seconds - 20e-6) < 4 * fit.alpha_stderr_seconds
    assert abs(fit.bandwidth_bytes_per_s - 2e9) < 4 * fit.bandwidth_stderr_bytes_per_s
    assert "alpha" in fit.summary() and "GB/s" in fit.summary()


def test_fit_clamps_negative_latency():
    sizes = np.array([1e6, 2e6, 4e6, 8e6])
    t = sizes / 1e9 - 1e-5  # a negative intercept
    fit = alpha_beta.fit_alpha_beta(sizes, t, 2)
    assert fit.latency_clamped and fit.alpha_seconds == 0.0
    assert fit.bandwidth_bytes_per_s > 0


def test_fit_rejects_bad_input():
    with pytest.raises(LabError, match="3 or more"):
        alpha_beta.fit_alpha_beta([8, 16], [1e-5, 1e-5], 2)
    with pytest.raises(LabError, match="at least 2 ranks"):
        alpha_beta.fit_alpha_beta([8, 16, 32], [1e-5] * 3, 1)
    with pytest.raises(LabError, match="do not grow"):
        alpha_beta.fit_alpha_beta([8, 16, 32], [3e-5, 2e-5, 1e-5], 2)


# --------------------------------------------------------------------------- projections


def test_epoch_compute_prorates_partial_step():
    # 10 samples on 4 ranks -> 3 per rank; b=2: one full step + half a step
    assert comm_projection._epoch_compute_seconds(10, 2, 4, 0.2) == pytest.approx(0.3)


def test_projection_by_hand():
    fit = alpha_beta.AlphaBetaFit(world_size=2, alpha_seconds=1e-3, bandwidth_bytes_per_s=1e9,
                            alpha_stderr_seconds=0, bandwidth_stderr_bytes_per_s=0, rms_relative_error=0,
                            max_relative_error=0, n_points=3)
    rows = comm_projection._project_scaling(fit, grad_bytes=100_000_000, dataset_size=1000,
                                compute_seconds_per_step={100: 0.1}, devices=[1, 8], bucket_bytes=None)
    one, eight = rows.itertuples()
    assert one.epoch_seconds == pytest.approx(1.0) and one.speedup == pytest.approx(1.0)
    # 8 ranks: 125 samples each -> 2 steps (100 + 25); compute 0.1 + 0.025 = 0.125 s
    assert eight.steps_per_epoch == 2 and eight.compute_seconds == pytest.approx(0.125)
    # comm per step: 2*7*1e-3 + 1.75 * 1e8 / 1e9 = 0.014 + 0.175 = 0.189 s; 2 steps -> 0.378
    assert eight.comm_seconds_per_step == pytest.approx(0.189)
    assert eight.epoch_seconds == pytest.approx(0.503)
    assert eight.speedup == pytest.approx(1 / 0.503)
    assert eight.efficiency == pytest.approx(1 / 0.503 / 8)
    # full overlap: 2 steps x max(0.0625, 0.189)
    assert eight.epoch_seconds_full_overlap == pytest.approx(0.378)
    assert eight.efficiency_full_overlap >= eight.efficiency


def test_projection_default_devices_and_buckets():
    fit = alpha_beta.AlphaBetaFit(2, 1e-5, 1e11, 0, 0, 0, 0, 3)
    df = comm_projection._project_scaling(fit, S_RESNET18, 50_000, {32: 0.01, 512: 0.1})
    assert list(df.devices[:8]) == [8, 16, 32, 64, 128, 256, 512, 1024]
    expected = ring.bucketed_ring_seconds(S_RESNET18, 8, 1e-5, 1e11)
    assert df.comm_seconds_per_step[0] == pytest.approx(expected)
    assert len(df) == 16 and (df.efficiency <= df.efficiency_full_overlap + 1e-12).all()
    with pytest.raises(LabError, match="compute time"):
        comm_projection._project_scaling(fit, S_RESNET18, 50_000, {})


# --------------------------------------------------------------------------- Table 3 and links


def test_utilization_rows_by_hand():
    m = comm_table3.CommMeasurement(devices=2, per_device_batch=10, source="hook", seconds=1e-6,
                                    grad_bytes=1000, dataset_size=100)
    link = comm.LinkPeak(20.0, "test link")
    (row,) = comm_table3.utilization_rows([m], {2: 10.0}, link)
    # 50 samples per rank / 10 = 5 steps x 1000 bytes (2 ranks: factor 1) = 5000 bytes in 1 us = 5 GB/s
    assert row["bytes_per_rank_per_epoch"] == 5000
    assert row["achieved_gb_per_s"] == pytest.approx(5.0)
    assert row["pct_of_bench_peak_busbw"] == pytest.approx(50.0)
    assert row["pct_of_link_nominal"] == pytest.approx(25.0)


def test_utilization_rows_missing_data_give_no_numbers():
    missing = comm_table3.CommMeasurement(4, 32, "derived", None, 1000, 100, reason="run notebook 03 first")
    negative = comm_table3.CommMeasurement(2, 32, "exposed", -0.01, 1000, 100)
    rows = comm_table3.utilization_rows([missing, negative], {2: 10.0}, comm.LinkPeak(None, "unknown"))
    assert rows[0]["achieved_gb_per_s"] is None and rows[0]["note"] == "run notebook 03 first"
    assert rows[0]["pct_of_bench_peak_busbw"] is None
    assert rows[1]["achieved_gb_per_s"] is None and "noise" in rows[1]["note"]
    assert rows[1]["pct_of_link_nominal"] is None
    with pytest.raises(LabError, match="one device communicates nothing"):
        comm_table3.utilization_rows([comm_table3.CommMeasurement(1, 32, "derived", 1.0, 1000, 100)], None)


TOPO_NVLINK = """\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tCPU Affinity\tNUMA Affinity\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tPXB\t0-47\t0
GPU1\tNV18\t X \tNV18\tNV18\tPXB\t0-47\t0
GPU2\tNV18\tNV18\t X \tNV18\tSYS\t48-95\t1
GPU3\tNV18\tNV18\tNV18\t X \tSYS\t48-95\t1
NIC0\tPXB\tPXB\tSYS\tSYS\t X
"""

TOPO_PCIE = """\tGPU0\tGPU1\tCPU Affinity
GPU0\t X \tPHB\t0-15
GPU1\tPHB\t X \t0-15
"""


def test_classify_interconnect_and_nominal_peaks():
    assert classify_interconnect(TOPO_NVLINK, 4) == "nvlink"
    assert classify_interconnect(TOPO_PCIE, 2) == "pcie"
    mixed = TOPO_NVLINK.replace("GPU3\tNV18", "GPU3\tSYS", 1).replace("GPU0\t X \tNV18\tNV18\tNV18",
                                                                      "GPU0\t X \tNV18\tNV18\tSYS")
    assert classify_interconnect(mixed, 4) == "mixed"
    assert classify_interconnect(None, 2) is None
    assert classify_interconnect(TOPO_PCIE, 4) is None  # fewer GPUs listed than asked
    assert comm._nominal_link_peak("NVIDIA H100 80GB HBM3", "nvlink").gb_per_s == 450.0
    assert comm._nominal_link_peak("NVIDIA A100-SXM4-40GB", "nvlink").gb_per_s == 300.0
    assert comm._nominal_link_peak("Tesla T4", "nvlink").gb_per_s is None
    assert comm._nominal_link_peak("x", "pcie", 4, 16).gb_per_s == pytest.approx(31.504)
    assert comm._nominal_link_peak("cpu (x)", None).gb_per_s is None
    assert comm._nominal_link_peak("x", "mixed").gb_per_s is None


def test_detect_link_peak_without_gpu_link():
    for n in (0, 1):
        peak = comm.detect_link_peak(n_gpus=n)
        assert peak.gb_per_s is None and "CPU processes" in peak.description


H100_NODE = Machine(gpus=4, gpu_name="NVIDIA H100 80GB HBM3", cores=64, bf16=True)


def _ranks(runs):
    """{rank count: (backend, device, skip reason, number of sizes)} of a benchmark plan."""
    out = {}
    for r in runs:
        assert r.config["world_size"] == r.processes and r.together
        assert r.group == f"allreduce_bench {r.processes}"
        out.setdefault(r.processes, [r.config["backend"], r.device, r.skip, 0])[3] += 1
    return {p: tuple(v) for p, v in out.items()}


def test_the_benchmark_plan_on_a_4_gpu_node_and_without_gpus():
    """NCCL with a GPU per rank on 2+ GPUs (all the GPUs too); gloo CPU processes with fewer than 2; a rank
    count the machine lacks is a row that says why. Made on this CPU for machines that are not here."""
    full = profiles.settings(comm.Settings, "full")
    runs = make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, H100_NODE, "full")
    assert _ranks(runs) == {2: ("nccl", "cuda", None, 28), 4: ("nccl", "cuda", None, 28)}  # 8 B ... 1 GiB
    assert [r.config["size_bytes"] for r in runs[:3]] == [8, 16, 32]
    assert runs[27].config["size_bytes"] == 2**30
    assert all(r.options == {"backend": "nccl"} and not r.in_process for r in runs)
    assert {r.config["iters"] for r in runs} == {20} and {r.config["warmup"] for r in runs} == {5}
    eight = _ranks(make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, Machine(gpus=8, gpu_name="G", cores=8)))
    assert sorted(eight) == [2, 4, 8] and eight[8] == ("nccl", "cuda", None, 28)
    two = _ranks(make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, Machine(gpus=2, gpu_name="G", cores=8)))
    assert two == {2: ("nccl", "cuda", None, 28), 4: ("nccl", "cuda", "needs 4 GPUs", 28)}
    one = _ranks(make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, Machine(gpus=1, gpu_name="G", cores=8)))
    assert one == {2: ("gloo", "cpu", None, 28), 4: ("gloo", "cpu", None, 28)}  # NCCL cannot share a GPU
    cpu = _ranks(make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, Machine(gpus=0, cores=2)))
    assert cpu[2][2] is None and cpu[4][2].startswith("needs 4 CPU cores")
    assert _ranks(make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, Machine(gpus=0, cores=1)))[2][2] is None
    with pytest.raises(LabError, match="at least 2 ranks"):
        make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, replace(full, bench_ranks=(1, 2)), H100_NODE)
    with pytest.raises(LabError, match="iters"):
        make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, replace(full, iters=0), H100_NODE)


def test_the_compute_step_plan_cost_and_doctor_settings():
    """The compute step launched on a GPU, in this process on a CPU; the budget's seconds by hand."""
    from lab_utils.experiments.shared import estimates

    full = profiles.settings(comm.Settings, "full")
    gpu = make_plan(comm.COMPUTE_STEP_EXPERIMENT, full, H100_NODE, "full")
    assert [r.config["batch_size"] for r in gpu] == [32, 128, 512]
    assert {r.group for r in gpu} == {"compute_step"}
    assert all(r.device == "cuda" and not r.in_process and r.options == {"process_group": False} for r in gpu)
    assert gpu[0].config == {"model": "resnet18", "width": 64, "batch_size": 32, "device_type": "cuda",
                             "steps": 20, "warmup": 5, "metrics_version": 1}  # the worker's (plan.versioned)
    cpu = make_plan(comm.COMPUTE_STEP_EXPERIMENT, full, Machine(gpus=0, cores=2), "full")
    assert all(r.device == "cpu" and r.in_process for r in cpu)
    # budget: 30 s per rank count for the 28 sizes (the time budget's value before the plans); a compute step
    # at batch b: 25 steps x b images at the fast path's TF32 rate (50,000 images in fast_epoch_seconds)
    bench = make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, full, H100_NODE, "full")
    assert sum(comm.cost(r) for r in bench) == pytest.approx(2 * 30.0)
    assert comm.cost(gpu[2]) == pytest.approx(25 * 512 * estimates.fast_epoch_seconds("tf32") / 50_000)
    small = comm.doctor_settings(full)
    doctor = make_plan(comm.ALLREDUCE_BENCH_EXPERIMENT, small, H100_NODE, "full")
    assert _ranks(doctor) == {2: ("nccl", "cuda", None, 9), 4: ("nccl", "cuda", None, 9)}  # 1 .. 256 MiB
    assert [r.config["batch_size"] for r in make_plan(comm.COMPUTE_STEP_EXPERIMENT, small, H100_NODE)] == [32]


# --------------------------------------------------------------------------- the benchmark


def _check_bench(records, n):
    df = comm_tables.bench_frame(records)
    assert list(df.size_bytes) == sorted(df.size_bytes) and df.size_bytes.is_unique
    assert list(df.size_bytes) == alpha_beta.message_sizes(8, int(df.size_bytes.max()))
    assert (df.time_us > 0).all() and (df.algbw_gb_per_s > 0).all() and (df.busbw_gb_per_s > 0).all()
    for r in records:
        assert r.status == "ok" and r.metrics["correct"] is True
        assert r.metrics["busbw_gb_per_s"] == r.metrics["algbw_gb_per_s"] * 2 * (n - 1) / n
        algbw = r.config["size_bytes"] / r.metrics["time_us"] / 1e3  # B/us -> GB/s
        assert r.metrics["algbw_gb_per_s"] == pytest.approx(algbw, rel=1e-12)
        assert r.hardware["device_count"] == n
    return df


def _bench_settings(**kw):
    ranks = (kw.pop("ranks", 2),)
    return replace(profiles.settings(comm.Settings, "quick"), bench_ranks=ranks, timeout_s=180, **kw)


@pytest.mark.slow
def test_benchmark_two_gloo_ranks_then_reuse_and_cli(store, monkeypatch, capsys):
    settings = _bench_settings(max_bytes=64 * ring.KIB, iters=3, warmup=1)
    records = measure(lab_for(store), comm.ALLREDUCE_BENCH_EXPERIMENT, settings, verbose=False,
                      machine=Machine(gpus=0, cores=2))
    df = _check_bench(records, 2)
    assert len(df) == 14  # 8 B .. 64 KiB
    assert comm_tables._peak_busbw_gb_per_s(records, 2) == df.busbw_gb_per_s.max()

    def no_launch(*a, **k):
        raise AssertionError("stored sizes must be reused, not re-measured")

    monkeypatch.setattr("lab_utils.engine.launcher.stream", no_launch)
    again = measure(lab_for(store), comm.ALLREDUCE_BENCH_EXPERIMENT, settings, verbose=False,
                    machine=Machine(gpus=0, cores=2))
    assert [r.timestamp for r in again] == [r.timestamp for r in records]
    monkeypatch.undo()
    rc = comm_tables.bench_main(["--profile", "quick", "--nproc", "2", "--backend", "gloo", "--max-bytes",
                                 str(64 * ring.KIB), "--iters", "3", "--warmup", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "busbw(GB/s)" in out and "alpha" in out and "65536" in out


@pytest.mark.slow
def test_benchmark_three_gloo_ranks_bus_factor(store):
    settings = _bench_settings(ranks=3, max_bytes=4 * ring.KIB, iters=2, warmup=1)
    records = measure(lab_for(store), comm.ALLREDUCE_BENCH_EXPERIMENT, settings, verbose=False,
                      machine=Machine(gpus=0, cores=3))
    df = _check_bench(records, 3)
    assert (df.busbw_gb_per_s > df.algbw_gb_per_s).all()  # factor 4/3
    assert math.isclose(df.busbw_gb_per_s.iloc[0] / df.algbw_gb_per_s.iloc[0], 4 / 3)


# --------------------------------------------------------------------------- DDP buckets and notebook helpers


@pytest.mark.parametrize("width,caps", [(64, (ring.MIB, 25 * ring.MIB)), (64, (1000, 50_000)),
                                        (16, (ring.MIB, ring.MIB))])
def test_ddp_bucket_sizes_match_torch_assignment(width, caps):
    import torch.distributed as dist

    from lab_utils.learn.models import ResNet18

    model = ResNet18(width=width)
    ready_order = list(reversed([p for p in model.parameters() if p.requires_grad]))
    idx, _ = dist._compute_bucket_assignment_by_size(ready_order, list(caps), [False] * len(ready_order))
    expected = [sum(ready_order[i].numel() * ready_order[i].element_size() for i in b) for b in idx]
    sizes = comm_tables.ddp_bucket_sizes(model, bucket_bytes=caps[1], first_bucket_bytes=caps[0])
    assert sizes == expected and sum(sizes) == comm.gradient_bytes(model)


def test_resnet18_default_buckets():
    from lab_utils.learn.models import ResNet18

    # layer4's 3x3x512x512 convs are 9.4 MB each: the first bucket passes 1 MiB with one of them
    assert comm_tables.ddp_bucket_sizes(ResNet18()) == [9_461_800, 26_494_976, 8_739_072]
    fit = alpha_beta.AlphaBetaFit(2, 1e-5, 1e10, 0, 0, 0, 0, 3)
    df = comm_tables._bucket_table([9_461_800, 26_494_976, 8_739_072], {2: fit})
    assert list(df.bucket) == [0, 1, 2, "one message"] and df.bytes.iloc[-1] == S_RESNET18
    # 2 ranks: T = 2e-5 + S / 1e10; latency share = 2e-5 / T
    t0 = 2e-5 + 9_461_800 / 1e10
    assert df["P=2 modelled ms"].iloc[0] == pytest.approx(1e3 * t0)
    assert df["P=2 latency share"].iloc[0] == pytest.approx(2e-5 / t0)


def test_gradient_bytes_table_by_hand():
    df = comm_tables._gradient_bytes_table(S_RESNET18, 11_173_962, 50_000, [128], [4])
    (row,) = df.to_dict("records")
    assert row["steps_per_epoch"] == 98 and row["bytes_per_rank_per_step"] == 67_043_772
    assert row["bytes_per_rank_per_epoch"] == 6_570_289_656
    assert row["if_params_were_bytes"] * 4 == pytest.approx(row["bytes_per_rank_per_epoch"])


def test_compute_steps_in_this_process_and_the_inputs_table(store):
    """The compute-step runs of a CPU plan, in this process: one record per batch, reused; the projection's
    compute side from them."""
    settings = replace(profiles.settings(comm.Settings, "quick"), batch_sizes=(4,), width=4, compute_steps=1,
                       compute_warmup=0)
    records = measure(lab_for(store), comm.COMPUTE_STEP_EXPERIMENT, settings, verbose=False,
                      machine=Machine(gpus=0, cores=2))
    assert [(r.status, r.config["batch_size"], r.synthetic) for r in records] == [("ok", 4, True)]
    compute = comm_projection.projection_compute(records, settings)
    assert compute.seconds_per_step == {4: records[0].metrics["compute_seconds_per_step"]}
    assert compute.seconds_per_step[4] > 0
    from lab_utils.learn.models import ResNet18

    assert compute.dataset_size == 50_000 and compute.grad_bytes == comm.gradient_bytes(ResNet18(width=4))
    assert "one cpu device" in compute.source
    again = measure(lab_for(store), comm.COMPUTE_STEP_EXPERIMENT, settings, verbose=False,
                    machine=Machine(gpus=0, cores=2))
    assert again[0].timestamp == records[0].timestamp  # stored: not re-measured
    fit = alpha_beta.AlphaBetaFit(2, 1e-5, 1e10, 0, 0, 0.01, 0.02, 3)
    df = comm_projection._inputs_table({2: fit}, fit, compute, comm.LinkPeak(None, "unknown"), [])
    kinds = dict(zip(df.input, df.kind))
    assert kinds["compute seconds per step"] == "measured"
    assert kinds["alpha, B at 8..1024 devices"] == "assumed"
    assert kinds["link nominal bandwidth"] == "not available"
    assert (df.kind == "assumed").sum() >= len(comm_projection.PROJECTION_ASSUMPTIONS)


# --------------------------------------------------------------------------- notebook 03's records -> Table 3


def _nb03_store(store):
    scaling = pytest.importorskip("lab_utils.experiments.n02_scaling.experiment")
    base = {"method": "DDP", "record": "aggregate", "rank": None, "backend": "gloo", "device_type": "cpu",
            "width": 8, "train_images": 1024, "epochs": 2, "batch_size": 32}
    grad = 705_608
    put(store, scaling.SCALING, {**base, "devices": 1, "global_batch": 32, "measure_comm": False},
              {"train_seconds": 10.0, "steps": 32, "gradient_bytes": grad})
    put(store, scaling.COMPUTE_VS_COMM, {**base, "devices": 2, "global_batch": 64, "measure_comm": True},
              {"train_seconds": 6.0, "steps": 16, "gradient_bytes": grad, "exposed_comm_seconds": 0.5,
               "allreduce_seconds": 0.8})
    return grad


def test_table3_from_notebook03_records_by_hand(store):
    grad = _nb03_store(store)
    ms = comm_table3._measurements(store, devices=(2, 4))
    # quick grid: 2 and 4 devices x 32 ... 2048 per device; DDP: three sources for (2, 32), one "not
    # measured" row for each other pair; DataParallel: one (a) row each, none stored (no GPUs)
    assert len(ms) == (3 + 7) + 8
    rows = comm_table3.utilization_rows(ms, {2: 0.1}, comm.LinkPeak(None, "unknown"))
    ddp = [r for r in rows if r["method"] != comm_table3._DP_ASSUMED_RING]
    measured = {r["comm_source"]: r for r in ddp if r["devices"] == 2 and r["per_gpu_batch"] == 32}
    bytes_epoch = 16 * grad  # 16 steps x 2(2-1)/2 x S
    assert all(r["bytes_per_rank_per_epoch"] == bytes_epoch for r in measured.values())
    a, b, c = (measured[s] for s in comm_table3._COMM_SOURCES)
    assert a["comm_seconds"] == pytest.approx(1.0)  # T(2) - T(1)/2 = 6 - 10/2
    assert a["achieved_gb_per_s"] == pytest.approx(bytes_epoch / 1.0 / 1e9)
    assert b["achieved_gb_per_s"] == pytest.approx(bytes_epoch / 0.5 / 1e9)
    assert c["achieved_gb_per_s"] == pytest.approx(bytes_epoch / 0.8 / 1e9)
    assert c["pct_of_bench_peak_busbw"] == pytest.approx(100 * bytes_epoch / 0.8 / 1e9 / 0.1)
    assert c["pct_of_link_nominal"] is None
    others = [r for r in ddp if (r["devices"], r["per_gpu_batch"]) != (2, 32)]
    assert len(others) == 7 and all(r["comm_seconds"] is None and "not measured" in r["note"] for r in others)


def test_table3_without_notebook03_says_run_it_first(store):
    rows = comm_table3.utilization_rows(comm_table3._measurements(store, devices=(2, 4)), {2: 1.0})
    ddp = [r for r in rows if r["method"] != comm_table3._DP_ASSUMED_RING]
    assert len(ddp) == 8
    assert all(r["note"] == comm_table3._NB03_MISSING and r["achieved_gb_per_s"] is None for r in ddp)
    assert all(r["bytes_per_rank_per_epoch"] > 0 for r in rows)  # bytes are a formula, seconds are not


def _bench_report(peaks):
    return comm_tables.BenchReport(None, {}, peaks, None, None, [])


def test_report_utilization_saves_table3(store):
    _nb03_store(store)
    settings = replace(profiles.settings(comm.Settings, "quick"), table_devices=(2,))
    df = comm_table3.report_utilization(store, settings, _bench_report({2: 0.1}),
                                        comm.LinkPeak(None, "unknown"))
    assert (store.tables_dir / "allreduce_utilization.md").exists()
    assert (store.tables_dir / "allreduce_utilization.csv").exists()
    assert set(df.comm_source) >= set(comm_table3._COMM_SOURCES)


def test_projection_compute_from_the_compute_step_records_by_hand():
    from lab_utils.engine.store import Record
    from lab_utils.learn.models import ResNet18

    settings = profiles.settings(comm.Settings, "quick")  # width 8, 2 timed steps after 1
    recs = [Record("compute_step", {"batch_size": b, "device_type": "cuda"}, {"compute_seconds_per_step": t})
            for b, t in ((32, 0.01), (128, 0.03))]
    recs.append(Record("compute_step", {"batch_size": 512}, status="oom", reason="out of memory"))
    compute = comm_projection.projection_compute(recs, settings)
    assert compute.seconds_per_step == {32: 0.01, 128: 0.03}  # the out-of-memory batch has no time
    assert compute.grad_bytes == 4 * 176_402 == comm.gradient_bytes(ResNet18(width=8))
    assert "one cuda device" in compute.source and "2 timed steps after 1 warm-up" in compute.source
    assert "batch 32: 10.0 ms, batch 128: 30.0 ms" in compute.description


def test_unfittable_timings_give_a_reason_not_an_exception():
    """Latency-bound timings that shrink with size (noise) leave that rank count without a fit."""
    from lab_utils.engine.store import Record

    def rec(p, size, t_us):
        return Record("allreduce_bench", {"world_size": p, "backend": "gloo", "size_bytes": size,
                                          "dtype": "float32"},
                      {"count": size // 4, "time_us": t_us, "algbw_gb_per_s": size / t_us / 1e3,
                       "busbw_gb_per_s": size / t_us / 1e3})

    records = [rec(2, s, t) for s, t in [(8, 30.0), (16, 20.0), (32, 10.0)]]
    records += [rec(4, s, 10.0 + s / 1e3) for s in (8, 1024, 65536)]
    failures: dict[int, str] = {}
    fits = comm_tables._fit_records(records, failures)
    assert set(fits) == {4} and set(failures) == {2}
    assert "do not grow with message size" in failures[2]


# --------------------------------------------------------------------------- issue 18: Q3.2, noise, fit error


def test_q32_earlier_cohort_under_the_ring_assumption_by_hand():
    """The earlier cohort's Table 1 timings (module not stated) through Q3.1/Q3.2 with the spec's
    S = 44,695,848 B:
    4 GPUs x 32: comm = 11.65 - 41.3/4 = 1.325 s; steps = ceil(50,000/128) = 391; bytes per rank =
    391 x 2(3)/4 x 44,695,848 = 26,214,114,852 B; 26.214e9 / 1.325 = 19.78 GB/s.
    2 GPUs x 32: comm = 23.15 - 41.3/2 = 2.5 s; 782 x 44,695,848 = 34,952,153,136 B -> 13.98 GB/s."""
    from lab_utils.experiments.shared.anchors import SPEC_GRADIENT_BYTES

    assert SPEC_GRADIENT_BYTES == 11_173_962 * 4
    rows = {(r["devices"], r["per_gpu_batch"]): r
            for r in comm_table3.utilization_rows(comm_table3._anchor_measurements(), None)}
    four = rows[(4, 32)]
    assert four["steps_per_epoch"] == 391 and four["comm_seconds"] == pytest.approx(1.325)
    assert four["bytes_per_rank_per_epoch"] == pytest.approx(26_214_114_852)
    assert four["achieved_gb_per_s"] == pytest.approx(19.784, abs=1e-3)
    two = rows[(2, 32)]
    assert two["bytes_per_rank_per_epoch"] == pytest.approx(34_952_153_136)
    assert two["achieved_gb_per_s"] == pytest.approx(13.981, abs=1e-3)
    assert all("ring ASSUMED" in r["method"] and "module not stated" in r["method"]
               and r["comm_source"] == comm_table3._COMM_SOURCES[0] for r in rows.values())
    assert all(r["q3_2"].startswith("Q3.2 answer") for r in rows.values())


def test_table3_says_which_gb_per_s_answers_q32_and_has_dataparallel_rows(store):
    _nb03_store(store)
    settings = replace(profiles.settings(comm.Settings, "quick"), table_devices=(2,))
    df = comm_table3.report_utilization(store, settings, _bench_report({2: 0.1}),
                                        comm.LinkPeak(None, "unknown"))
    ddp = df[df["method"].str.startswith("DDP") & (df["per_gpu_batch"] == 32)].set_index("comm_source")
    assert ddp.loc[comm_table3._COMM_SOURCES[0], "q3_2"].startswith("Q3.2 answer")
    assert ddp.loc[comm_table3._COMM_SOURCES[1], "q3_2"].startswith("not Q3.2's answer")
    assert ddp.loc[comm_table3._COMM_SOURCES[2], "q3_2"].startswith("check")
    dp_here = df[df["method"] == comm_table3._DP_ASSUMED_RING]
    assert len(dp_here) and dp_here["achieved_gb_per_s"].isna().all()      # no GPUs: no DataParallel run
    assert all("needs 2 GPUs" in n for n in dp_here["note"])
    anchors = df[df["method"].str.contains("earlier cohort")]
    assert len(anchors) == 6 and anchors["pct_of_bench_peak_busbw"].isna().all()  # not this machine's peak
    md = (store.tables_dir / "allreduce_utilization.md").read_text()
    assert "Which GB/s answers Q3.2: (a)" in md


def test_noise_flag_marks_effects_within_two_standard_errors():
    from lab_utils.learn.comm_probe import NOISE_FLAG, noise_flag

    assert noise_flag(0.5, 0.25) == NOISE_FLAG      # 2 x 0.25 >= 0.5
    assert noise_flag(0.5, 0.2) == ""               # 0.4 < 0.5: the effect stands out
    assert noise_flag(0.0, 0.01) == NOISE_FLAG      # clamped to 0 with noise: not a result
    assert noise_flag(0.5, None) == "" and noise_flag(None, 0.1) == ""
    m = comm_table3.CommMeasurement(2, 32, comm_table3._COMM_SOURCES[1], 0.5, 1000, 100, noise_seconds=0.3)
    (row,) = comm_table3.utilization_rows([m], None)
    assert row["noise_flag"] == NOISE_FLAG


def test_projection_from_a_bad_fit_is_labelled_not_a_result(store):
    sizes, t = _synthetic(20e-6, 2e9, 2)
    good = alpha_beta.fit_alpha_beta(sizes, t, 2)
    assert comm_tables.fit_verdict(good) == ""
    from dataclasses import replace
    bad = replace(good, rms_relative_error=0.485)
    assert comm_tables.fit_verdict(bad) == "not a result: fit error 48.5% rms > 25%"
    compute = comm_projection._ProjectionCompute({32: 0.01}, 44_695_848, 50_000, 64, "test")
    df, fig = comm_projection.report_projection(store, bad, compute, [], devices=(8, 1024))
    assert set(df["status"]) == {"not a result: fit error 48.5% rms > 25%"}
    assert "NOT A RESULT" in (store.tables_dir / "allreduce_projection.md").read_text()
    df, _ = comm_projection.report_projection(store, good, compute, [], devices=(8,))
    assert set(df["status"]) == {"ok"}
    ft = comm_tables._fit_table({2: bad, 4: good}, {})
    assert list(ft["projection"]) == ["not a result: fit error 48.5% rms > 25%", "ok to project"]


# --------------------------------------------------------------------------- Exercise 04-d: predict


def test_predicted_allreduce_bandwidth_by_hand():
    """Buckets of 1e6 and 3e6 B on 4 ranks, alpha 10 us, B 2 GB/s: each bucket 2(P-1) = 6 steps x 10 us
    plus 2(P-1)/P = 1.5 x b / 2e9: 60 + 750 us and 60 + 2250 us = 3120 us for 1.5 x 4e6 = 6e6 B sent,
    1.923 GB/s. No latency: B itself; one message of 4e6 B: 60 + 3000 us."""
    assert ring.predicted_allreduce_gb_per_s([1e6, 3e6], 4, 10e-6, 2.0) == pytest.approx(6e6 / 3120e-6 / 1e9)
    assert ring.predicted_allreduce_gb_per_s([1e6, 3e6], 4, 0.0, 2.0) == pytest.approx(2.0)
    assert ring.predicted_allreduce_gb_per_s([4e6], 4, 10e-6, 2.0) == pytest.approx(6e6 / 3060e-6 / 1e9)
    # 2 ranks: 2 steps of alpha and S / B per bucket
    assert ring.predicted_allreduce_gb_per_s([1e6], 2, 1e-4, 1.0) == pytest.approx(1e6 / 1.2e-3 / 1e9)
    with pytest.raises(LabError, match="at least 2 ranks"):
        ring.predicted_allreduce_gb_per_s([1e6], 1, 1e-5, 1.0)
    with pytest.raises(LabError, match="buckets"):
        ring.predicted_allreduce_gb_per_s([], 2, 1e-5, 1.0)


def test_bandwidth_prediction_cases_from_notebook03_and_the_fit(store):
    """Exercise 04-d's table: per DDP configuration of Table 3, the buckets notebook 03's model was sent in
    (quick: an explicit 0.4 MB cap, so no small first bucket: 455,208 + 250,400 B of width 8's 705,608),
    the fit on that rank count (else the one on the most ranks) and the measured (c) GB/s."""
    grad = _nb03_store(store)
    fit = alpha_beta.AlphaBetaFit(2, 1e-5, 1e9, 0, 0, 0, 0, 3)
    bench = comm_tables.BenchReport(None, {2: fit}, {2: 0.1}, None, None, [])
    settings = profiles.settings(comm.Settings, "quick")
    cases, measured, labels = comm_table3.bandwidth_prediction_cases(store, settings, bench)
    assert cases[0] == {"bucket_bytes": [455_208, 250_400], "world_size": 2, "alpha_seconds": 1e-5,
                        "bandwidth_gb_per_s": 1.0}
    assert sum(cases[0]["bucket_bytes"]) == grad
    assert measured[0] == pytest.approx(16 * grad / 0.8 / 1e9)   # (c): 16 steps x 2(2-1)/2 x S over 0.8 s
    assert labels[:2] == ["2 x 32", "2 x 128: not measured"]
    assert len(cases) == 8 and all(m is None for m in measured[1:])   # 2 and 4 devices x 4 batches
    four = [c for c, label in zip(cases, labels) if label.startswith("4 x")]
    assert len(four) == 4 and all(c["world_size"] == 4 and c["alpha_seconds"] == 1e-5 for c in four)
    assert labels[4] == "4 x 32 (fit on 2): not measured"   # no 4-rank fit: the one on 2 ranks
    assert comm_table3.bandwidth_prediction_cases(store, settings, _bench_report({})) == ([], [], [])

