"""Notebook 09: data parallelism by hand (lab_utils.learn.handmade), its plan, worker, tables and trace.

Fast: bucket assignment, shard bounds, ring bytes and the alpha-beta prediction, the plan on a CPU and on
the budget's 4-GPU node, the tables from records (notebook 04's fit preferred), the merged trace and the
lanes of a CPU and of a GPU trace. Slow (processes): every implementation equals one process on 2 gloo
ranks, (c) launches its buckets during backward, the whole plan through torchrun, and the graded
exercise on gloo ranks inside the bubblewrap sandbox.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
from store_helpers import put

from lab_utils.engine import fork_ranks, profiles
from lab_utils.engine.machine import BUDGET_NODE, Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.engine.store import Record
from lab_utils.experiments.n09_build_ddp import experiment as build_ddp
from lab_utils.experiments.n09_build_ddp import replica_memory
from lab_utils.experiments.n09_build_ddp import tables as T
from lab_utils.learn import bucketing, handmade, traffic
from lab_utils.learn.errors import LabError
from lab_utils.learn.ring import MIB

pytestmark = pytest.mark.timeout(60)
CPU2 = Machine(gpus=0, cores=2)


# --------------------------------------------------------------------------- the pieces, by hand


def test_bucket_assignment_is_ddps_rule_by_hand():
    """Add the parameter, then close the bucket once it holds at least its cap (the first bucket: its own
    cap): a bucket can exceed its cap; one that holds exactly its cap is full."""
    assert bucketing.assign_buckets([100, 200, 300, 400], 500) == [[3, 2], [1, 0]]       # 700 > 500: closed
    assert bucketing.assign_buckets([400, 100, 300, 200], 500, 100) == [[3], [2, 1, 0]]  # first cap 100
    assert bucketing.assign_buckets([100, 900, 100, 250, 250], 500) == [[4, 3], [2, 1], [0]]  # 500 is full
    assert bucketing.assign_buckets([5, 5], 0) == [[1], [0]]                              # cap 0: per tensor
    assert bucketing.assign_buckets([5, 5], math.inf) == [[1, 0]]


def test_bucket_assignment_equals_torchs_own_on_resnet18_and_at_ddps_caps():
    """torch's compute_bucket_assignment_by_size (the pinned build's, given the parameters last first,
    as DDP rebuilds its buckets in gradient-ready order), and the sizes the issue worked out for the spec
    model: at an explicit 25 MiB cap 28.87 + 15.82 MB; DDP's default (1 MiB first) 9.46 + 26.49 + 8.74 MB.
    The lab's old stay-under-the-cap rule made 19.44 + 25.26 MB at 25 MiB."""
    import torch.distributed as dist

    from lab_utils.learn.models import ResNet18

    for width, caps in ((8, ((16_000, 16_000), (419_430, 16_384), (705_608, 1), (1, 10**9))),
                        (64, ((25 * MIB, 25 * MIB), (25 * MIB, MIB)))):
        params = list(ResNet18(width=width).parameters())
        sizes = [p.numel() * p.element_size() for p in params]
        order = list(reversed(range(len(params))))
        for cap, first in caps:
            want, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [first, cap],
                                                              [False] * len(params), order)
            assert bucketing.assign_buckets(sizes, cap, first) == [list(b) for b in want], (width, cap, first)
    mb = {first: [round(sum(sizes[i] for i in b) / 1e6, 2)
                  for b in bucketing.assign_buckets(sizes, 25 * MIB, first)] for first in (25 * MIB, MIB)}
    assert mb == {25 * MIB: [28.87, 15.82], MIB: [9.46, 26.49, 8.74]}


def test_shard_bounds_by_hand():
    assert bucketing.shard_bounds(10, 4) == [(0, 3), (3, 6), (6, 8), (8, 10)]
    assert bucketing.shard_bounds(12, 3) == [(0, 4), (4, 8), (8, 12)]
    assert bucketing.shard_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    spec = bucketing.shard_bounds(11_173_962, 4)   # 11,173,962 = 4 x 2,793,490 + 2
    assert [e - s for s, e in spec] == [2_793_491, 2_793_491, 2_793_490, 2_793_490]
    assert spec[-1][1] == 11_173_962


def test_exposed_communication_model_by_hand():
    """S = 100 MB, P = 2, alpha = 50 us (A = 2(P-1) alpha = 0.1 ms), B = 10 GB/s (W = S/B = 10 ms), T = 50 ms.
    4 buckets of 25 MB: c = 0.1 + 2.5 = 2.6 ms <= T/k = 12.5 ms: only the last is left, 2.6 ms. 1,000
    buckets of 100 kB: c = 0.11 ms > T/k = 0.05 ms: they queue, T/k + k c - T = 0.05 + 110 - 50 = 60.05 ms.
    The best k is where c = T/k: k = (T - W) / A = 400 (250 kB buckets), exposing 0.125 ms."""
    args = (100e6, 2, 5e-5, 1e10, 0.05)
    assert math.isclose(traffic.overlap_exposed_seconds(25e6, *args), 2.6e-3)
    assert math.isclose(traffic.overlap_exposed_seconds(1e5, *args), 60.05e-3)
    assert traffic.overlap_exposed_seconds(30e6, *args) == traffic.overlap_exposed_seconds(25e6, *args)  # 4
    assert traffic.optimal_bucket_bytes(*args) == 250e3
    assert math.isclose(traffic.overlap_exposed_seconds(250e3, *args), 0.125e-3)
    assert traffic.optimal_bucket_bytes(100e6, 2, 0.0, 1e10, 0.05) == 0.0    # no latency: smaller is better
    # backward shorter than the bandwidth term: queued everywhere, best at k = sqrt(T/A) = sqrt(50) ~ 7
    assert traffic.optimal_bucket_bytes(100e6, 2, 5e-5, 1e10, 0.005) == 100e6 / 7


def test_the_best_bucket_is_the_models_minimum_over_whole_bucket_counts():
    import random

    rng = random.Random(0)
    for _ in range(200):
        s, p = rng.uniform(1e5, 1e9), rng.choice([2, 4, 8])
        a, bw, t = rng.uniform(1e-6, 1e-3), rng.uniform(1e8, 1e11), rng.uniform(1e-3, 1.0)
        k = round(s / traffic.optimal_bucket_bytes(s, p, a, bw, t))
        exposed = [traffic._exposed_by_buckets(n, s, p, a, bw, t) for n in range(1, max(2 * k, 1000) + 1)]
        assert math.isclose(exposed[k - 1], min(exposed), rel_tol=1e-12), (s, p, a, bw, t, k)


def test_ring_bytes_and_the_alpha_beta_prediction_by_hand():
    """P = 4, alpha = 10 us, B = 1 GB/s. An all-reduce of 1 MB: 2 x 3 x 10 us + 1.5 x 1e6 / 1e9 s = 1.56 ms,
    1.5 MB sent per rank; a reduce-scatter or all-gather of it: half of each."""
    msgs = [("all_reduce", 1_000_000), ("all_reduce", 200_000)]
    assert traffic.bytes_sent_per_rank(msgs, 4) == 1.5 * 1_200_000
    total, exposed = traffic.predicted_seconds(msgs, 4, 1e-5, 1e9, overlaps=False)
    assert math.isclose(total, 1.56e-3 + (6e-5 + 3e-4)) and exposed == total
    total2, exposed2 = traffic.predicted_seconds(msgs, 4, 1e-5, 1e9, overlaps=True)
    assert total2 == total and math.isclose(exposed2, 6e-5 + 3e-4)        # the last bucket only
    zero = [("reduce_scatter", 1_000_000), ("all_gather", 1_000_000)]    # = one all-reduce of 1 MB
    assert traffic.bytes_sent_per_rank(zero, 4) == 1.5e6
    assert math.isclose(traffic.predicted_seconds(zero, 4, 1e-5, 1e9, False)[0], 1.56e-3)
    naive = [("all_reduce", 4)] * 62    # 62 tiny tensors: alpha 62 times
    assert math.isclose(traffic.predicted_seconds(naive, 2, 1e-5, 1e9, False)[0], 62 * (2e-5 + 4e-9))
    # behind a backward of T: 4 equal buckets are the exercise's model; unequal ones queue by their bytes
    equal = [("all_reduce", 25_000_000)] * 4
    assert math.isclose(traffic.predicted_seconds(equal, 2, 5e-5, 1e10, True, 0.05)[1], 2.6e-3)
    assert math.isclose(traffic.predicted_seconds([("all_reduce", 1e8)] * 1, 2, 5e-5, 1e10, True, 0.05)[1],
                        10.1e-3)
    # 90 MB ready at 45 ms takes 9.1 ms (ends 54.1 ms); the last 10 MB, ready at 50 ms, waits: ends 55.2 ms
    two = [("all_reduce", 90_000_000), ("all_reduce", 10_000_000)]
    assert math.isclose(traffic.predicted_seconds(two, 2, 5e-5, 1e10, True, 0.05)[1], 5.2e-3)


def test_memory_use_on_a_cpu_counts_every_tensor_until_it_is_freed_on_any_thread():
    """Known in advance: the implementation holds 1 MiB; its step holds 4 + 1 MiB at once, frees the 4 MiB
    on another thread (as gloo's does when it holds a collective's tensor last), then allocates 2 MiB:
    held 1 MiB, peak 6 MiB. Missing that free would read 1 + 7 = 8 MiB."""
    import threading

    def build():
        return [torch.ones(MIB // 4)]

    def step(held):
        box = [torch.ones(MIB)]
        small = torch.ones(MIB // 4)
        t = threading.Thread(target=box.clear)
        t.start()
        t.join()
        later = torch.ones(MIB // 2)
        return small, later

    use, held = replica_memory.memory_use(build, step, torch.device("cpu"), warm_steps=1)
    assert (use.held_bytes, use.peak_bytes) == (MIB, 6 * MIB) and held[0].numel() == MIB // 4


def test_memory_use_on_a_gpu_reads_the_allocators_counters_from_before_the_build(fake_gpu):
    """On the (fake) GPU: 2 MiB held by someone else before, a 8 MiB spike while building (gone before the
    measured step), 1 MiB kept, 3 MiB more during the measured step: held 1 MiB, peak 4 MiB."""
    gpu = fake_gpu(count=1)
    dev = torch.device("cuda", 0)
    before = gpu.tensor(2 * MIB, 0)

    def build():
        spike = gpu.tensor(8 * MIB, 0)
        del spike
        return [gpu.tensor(MIB, 0)]

    def step(held):
        temporary = gpu.tensor(3 * MIB, 0)
        del temporary

    use, held = replica_memory.memory_use(build, step, dev)
    assert (use.held_bytes, use.peak_bytes) == (MIB, 4 * MIB) and before and held


def test_a_step_takes_the_slowest_rank():
    assert traffic.slowest_per_step([[1.0, 5.0, 2.0], [3.0, 1.0, 2.5]]) == [3.0, 5.0, 2.5]


# --------------------------------------------------------------------------- the plan


def test_the_plan_on_two_cpu_cores_and_on_the_budget_node():
    quick = profiles.settings(build_ddp.Settings, "quick")
    runs = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, quick, CPU2, "quick")
    kinds = [(r.processes, r.config["kind"], r.config["batch_size"]) for r in runs]
    assert kinds == [(2, "check", 4), (2, "bench", 4), (2, "memory", 4), (2, "compare", 4),
                     (2, "compare", 16), (2, "compare", 16), (2, "trace", 16), (4, "check", 4),
                     (4, "bench", 4), (4, "memory", 4), (4, "compare", 4), (4, "compare", 16)]
    assert {r.group for r in runs} == {"build_ddp 2", "build_ddp 4"}
    assert all(r.device == "cpu" and r.config["backend"] == "gloo" and r.threads == 1 and not r.skip
               for r in runs)
    sweep = runs[5].config["implementations"]
    assert [m for n, m in sweep if n == "bucketed"] == [0.016, 0.08, 0.4, None] and sweep[-1][0] == "ddp_bf16"
    assert runs[0].config["dtype"] == "float64" and runs[6].options["trace_dir"].endswith("quick/traces")
    assert runs[2].config["implementations"] == [
        ["local", None, "sgd"], ["naive", None, "sgd"], ["per_tensor", None, "sgd"], ["flat", None, "sgd"],
        ["bucketed", 0.4, "sgd"], ["zero1", None, "sgd"], ["ddp", 0.4, "sgd"], ["zero1", None, "adam"],
        ["ddp", 0.4, "adam"]]
    full = profiles.settings(build_ddp.Settings, "full")
    here = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, full, CPU2, "full")
    assert {r.skip for r in here} == {"needs 2 GPUs", "needs 4 GPUs"}
    node = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, full, BUDGET_NODE, "full")
    assert all(r.device == "cuda" and r.config["backend"] == "nccl" and not r.skip for r in node)
    assert len(node) == 14 and node[3].config["implementations"][4] == ["bucketed", 25.0]
    two_gpus = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, full, Machine(gpus=2, cores=16, gpu_name="G"),
                         "full")
    assert {(r.processes, r.skip, r.config["backend"]) for r in two_gpus} == {(2, None, "nccl"),
                                                                           (4, "needs 4 GPUs", "nccl")}
    doctor = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, build_ddp.doctor_settings(full), BUDGET_NODE, "full")
    assert {r.processes for r in doctor} == {2} and len(doctor) == 6


def test_cost_by_hand():
    """A full-profile comparison at 512 per GPU: 3.329 GFLOP per image at 30 % of 495 TFLOP/s is 22.42 us
    per image, 11.48 ms per step; (3 + 20) rounds x 7 implementations and 20 more backward-timing steps
    = 181 steps, 2.08 s. At 32 per GPU the 5 ms floor of a launch-bound step wins: 0.905 s. Memory at 32:
    three steps of each of its 9 rows, 0.135 s."""
    full = profiles.settings(build_ddp.Settings, "full")
    node = make_plan(build_ddp.BUILD_DDP_EXPERIMENT, full, BUDGET_NODE, "full")
    by_batch = {r.config["batch_size"]: r for r in node[3:6]}   # 2 ranks: the comparisons at 32, 128, 512
    assert math.isclose(build_ddp.cost(by_batch[512]), 181 * 512 * 3.329e9 / (0.3 * 495e12), rel_tol=1e-3)
    assert math.isclose(build_ddp.cost(by_batch[32]), 181 * 0.005)
    assert node[2].config["kind"] == "memory" and math.isclose(build_ddp.cost(node[2]), 27 * 0.005)


def test_bad_settings_are_one_sentence_before_anything_runs():
    with pytest.raises(LabError, match="2 or more ranks"):
        profiles.settings(build_ddp.Settings, "quick", devices=(1, 2))
    with pytest.raises(LabError, match="bucket sizes must be positive"):
        profiles.settings(build_ddp.Settings, "quick", sweep_mb=(0.0,))


# --------------------------------------------------------------------------- tables from records


def _row(name, messages, step, exposed, bucket_mb=None, overlaps=False):
    spread = {"step_seconds": step, "step_seconds_p10": step * 0.9, "step_seconds_p90": step * 1.1,
              "comm_exposed_seconds": exposed, "comm_exposed_seconds_p10": exposed - 1e-3,
              "comm_exposed_seconds_p90": exposed + 1e-3}
    return {"implementation": name, "bucket_mb": bucket_mb, **spread, "messages": messages,
            "bytes_per_rank_per_step": traffic.bytes_sent_per_rank(messages, 2), "overlaps": overlaps,
            "last_step_loss": 2.0, "sgd_state_bytes": 400}


def _records():
    base = {"devices": 2, "backend": "gloo", "width": 8, "seed": 0, "dataset": "synthetic",
            "train_images": 64}
    flat = [("all_reduce", 1000)]
    impls = [["local", None], ["naive", None], ["flat", None], ["bucketed", 0.4], ["zero1", None],
             ["ddp", 0.4]]
    main = Record("build_ddp", {**base, "kind": "compare", "batch_size": 4, "implementations": impls},
                  {"implementations": [_row("local", [], 0.1, 0.0),
                                       _row("naive", [("all_reduce", 500)] * 2, 0.2, 0.1),
                                       _row("flat", flat, 0.12, 0.02)]})
    sweep_impls = [["local", None], ["bucketed", 0.01], ["bucketed", None], ["ddp", 0.4], ["ddp_bf16", 0.4]]
    sweep = Record("build_ddp", {**base, "kind": "compare", "batch_size": 16, "implementations": sweep_impls},
                   {"implementations": [_row("local", [], 0.3, 0.0),
                                        _row("bucketed", [("all_reduce", 500)] * 2, 0.35, 0.05, 0.01, True),
                                        _row("bucketed", flat, 0.33, 0.03, None, True),
                                        _row("ddp", flat, 0.34, 0.04, 0.4, True),
                                        _row("ddp_bf16", [("all_reduce", 500)], 0.32, 0.02, 0.4, True)],
                    "gradient_bytes": 1000, "backward_seconds": 3e-4})
    memory_rows = [{"implementation": n, "bucket_mb": None, "optimizer": o, "held_bytes": h, "peak_bytes": p,
                    "optimizer_state_bytes": st}
                   for n, o, h, p, st in (("ddp", "sgd", 4000, 5000, 1000),
                                          ("zero1", "adam", 3500, 6000, 1000))]
    memory = Record("build_ddp", {**base, "kind": "memory", "batch_size": 4}, {"implementations": memory_rows,
                                                                              "parameter_bytes": 1000})
    fit = {"alpha_seconds": 1e-4, "bandwidth_bytes_per_s": 1e8}
    bench = Record("build_ddp", {**base, "kind": "bench", "batch_size": 4,
                                 "sizes_bytes": [4096, 16384, 65536]},
                   {"fit": fit, "bench_time_us": [300.0, 400.0, 900.0]})
    rows = [{"implementation": n, "bucket_mb": None, "dtype": "float64", "max_abs_diff": 0.0, "equal": True,
             "rtol": 1e-7, "atol": 1e-9, "last_step_loss": 2.5, "sgd_state_bytes": [800, 800]}
            for n in ("naive", "flat", "ddp")]
    rows.append({**rows[-1], "implementation": "ddp_bf16", "dtype": "bfloat16", "max_abs_diff": 0.02,
                 "equal": None, "rtol": None, "atol": None, "last_step_loss": 2.6})
    check = Record("build_ddp", {**base, "kind": "check", "batch_size": 4}, {"implementations": rows,
                                                                           "check_steps": 3})
    skipped = Record("build_ddp", {**base, "devices": 4, "kind": "compare", "batch_size": 4},
                     status="skipped", reason="needs 4 GPUs")
    return [check, bench, memory, main, sweep, skipped]


def test_tables_select_the_records_and_predict_with_the_fit_by_hand(store):
    """Own fit alpha = 100 us, B = 100 MB/s on 2 ranks: flat's 1,000 B all-reduce = 2 x 100 us + 1,000 / 1e8 s
    = 0.21 ms; naive's two 500 B ones = 2 x 0.205 ms; DDP overlaps: exposed = its last (only) bucket."""
    recs = _records()
    table = T.compare_table(store, recs).set_index("implementation")
    assert math.isclose(table.loc["(b) flat", "predicted_comm_ms"], 0.21)
    assert math.isclose(table.loc["(a) naive", "predicted_comm_ms"], 0.41)
    assert table.loc["(b) flat", "step_ms"] == 120 and table.loc["(b) flat", "comm_exposed_ms"] == 20
    assert table.loc["(b) flat", "fit"].startswith("this run's all-reduce timing")
    assert "not measured: needs 4 GPUs" in table.index
    sweep = T.sweep_table(store, recs)
    assert list(sweep["bucket_mb"]) == [0.01, "one bucket", 0.4] and list(sweep["buckets"]) == [2, 1, 1]
    assert list(sweep["implementation"]) == ["(c) bucketed"] * 2 + ["torch DDP"]
    assert list(sweep["bucket_sizes_mb"]) == ["0.0005 + 0.0005", "0.001", "0.001"]
    # behind a 0.3 ms backward: the first 500 B ready at 0.15 ms, done at 0.355 ms; the second, ready at
    # 0.3 ms, waits for it: done at 0.56 ms, 0.26 ms after backward (its own 0.205 ms is a lower bound)
    assert math.isclose(sweep["predicted_exposed_ms"][0], 0.26)
    assert math.isclose(sweep["predicted_comm_ms"][0], 0.41)
    cases, measured, labels = T.overlap_cases(store, recs)
    assert labels == ["(c) at 0.01 MB", "(c), one bucket"] and measured == [0.05, 0.03]
    assert [c["bucket_bytes"] for c in cases] == [0.01 * MIB, 1000] and cases[0]["backward_seconds"] == 3e-4
    yours, one, best, lab_model = T.best_bucket_args(traffic.overlap_exposed_seconds, cases, measured)
    assert best == [1000 / MIB] and "bucket_bytes" not in one[0]   # the sweep's best: one bucket
    assert math.isclose(yours(**one[0]), lab_model(**one[0]))       # the lab's model, minimized both ways
    assert T.best_bucket_args(lambda **c: None, cases, measured)[0](**one[0]) is None   # not done yet
    mem = T.memory_table(recs).set_index(["implementation", "optimizer"])
    assert mem.loc[("(d) ZeRO-1 (paper)", "adam"), "peak_bytes"] == 6000
    assert mem.loc[("torch DDP", "sgd"), "optimizer_state_bytes_per_rank"] == 1000
    assert T.notes(recs, "memory")[0].startswith("held_bytes") and T.notes(recs)[0].startswith("step_ms")
    comp = T.compression_table(recs).set_index("implementation")
    assert comp.loc["torch DDP, bf16 hook", "loss_after_k_steps"] == 2.6
    assert comp.loc["torch DDP, bf16 hook", "bytes_per_rank_per_step"] == 500
    # notebook 04's benchmark in the store (3 sizes on 2 gloo ranks) wins over this run's own timing:
    # t = a0 + a1 S exactly, a0 = 2 alpha = 50 us, a1 = 1 / B: B = 1e9 -> flat's all-reduce 50 us + 1 us
    for size in (1000, 100_000, 1_000_000):
        cfg = {"world_size": 2, "backend": "gloo", "size_bytes": size, "dtype": "float32"}
        put(store, "allreduce_bench", cfg, {"time_us": 50 + size / 1e3})
    table = T.compare_table(store, recs).set_index("implementation")
    assert table.loc["(b) flat", "fit"].startswith("notebook 04's benchmark")
    assert math.isclose(table.loc["(b) flat", "predicted_comm_ms"], 0.051, rel_tol=1e-6)


def test_timings_that_cannot_be_fitted_leave_the_rows_and_say_why(store):
    """On a loaded CPU the all-reduce times may not grow with the size: the run keeps its timings (the
    worker stores ``fit: {problem}``), its rows stay, their prediction is empty and says why; notebook
    04's benchmark that cannot be fitted either falls back to this run's own fit."""
    recs = _records()
    bench = recs[1]
    assert T.overlap_cases(store, [r for r in recs if r is not bench]) == ([], [], [])   # no fit: no cases
    bench.metrics["fit"] = {"problem": "The timings do not grow with message size, so B cannot be fitted"}
    table = T.compare_table(store, recs).set_index("implementation")
    why = "no fit: The timings do not grow with message size, so B cannot be fitted"
    assert table.loc["(b) flat", "fit"] == why
    assert pd.isna(table.loc["(b) flat", "predicted_comm_ms"]) and table.loc["(b) flat", "step_ms"] == 120
    flat_04 = [(1000, 100.0), (100_000, 100.0), (1_000_000, 100.0)]   # no growth: notebook 04's cannot fit
    for size, us in flat_04:
        cfg = {"world_size": 2, "backend": "gloo", "size_bytes": size, "dtype": "float32"}
        put(store, "allreduce_bench", cfg, {"time_us": us})
    bench.metrics["fit"] = {"alpha_seconds": 1e-4, "bandwidth_bytes_per_s": 1e8}
    table = T.compare_table(store, recs).set_index("implementation")
    assert table.loc["(b) flat", "fit"].startswith("this run's all-reduce timing")
    assert math.isclose(table.loc["(b) flat", "predicted_comm_ms"], 0.21)


def test_the_check_passes_only_when_every_implementation_is_equal():
    recs = _records()
    table = T.check_table(recs)
    assert T.check_verdict(table).startswith("passed: (a)-(e) and torch's DDP equal one process")
    assert table.set_index("implementation").loc["torch DDP, bf16 hook", "tolerance"].startswith("bfloat16")
    recs[0].metrics["implementations"][1] = {**recs[0].metrics["implementations"][1], "equal": False,
                                             "max_abs_diff": 0.5}
    with pytest.raises(AssertionError, match=r"\(b\) flat on 2 ranks \(max \|diff\| 0.5\)"):
        T.check_verdict(T.check_table(recs))


def _trace(rank, t0, events):
    meta = [{"ph": "M", "name": "process_name", "pid": 100 + rank, "tid": 0, "args": {"name": "python"}}]
    return {"traceEvents": meta + [{"ph": "X", "pid": 100 + rank, "tid": 7, "ts": t0 + ts, "dur": dur,
                                    "name": name, **({"cat": cat} if cat else {})}
                                   for name, ts, dur, cat in events]}


def test_merged_trace_one_row_per_rank_and_the_lanes_of_cpu_and_gpu_traces(tmp_path):
    backward = "autograd::engine::evaluate_function: "
    ev = [("(b) flat", 0, 100, "user_annotation"), (backward + "ConvBackward0", 10, 40, ""),
          (backward + "AddmmBackward0", 45, 20, ""), ("gloo:all_reduce", 70, 25, "")]
    paths = []
    for rank, t0 in ((0, 1000), (1, 1030)):   # rank 1 starts 30 us late: a straggler
        paths.append(tmp_path / f"r{rank}.json")
        paths[-1].write_text(json.dumps(_trace(rank, t0, ev)))
    rec = Record("build_ddp", {"kind": "trace", "devices": 2, "batch_size": 4},
                 {"trace_paths": [str(p) for p in paths], "steps_traced": 1})
    out = T.merge_traces([rec], tmp_path / "figures" / "build_ddp_trace.json")
    merged = json.loads(out.read_text())["traceEvents"]
    assert {e["pid"] for e in merged} == {0, 1}
    assert [e["args"]["name"] for e in merged if e["name"] == "process_name"] == ["rank 0", "rank 1"]
    compute, comm = T._lanes([e for e in merged if e["pid"] == 1], 1030, 1130)
    assert compute == [(1040, 1095)] and comm == [(1100, 1125)]
    assert T.trace_figure(out) is not None
    gpu = [{"ph": "X", "ts": 0, "dur": 50, "name": "sm80_xmma_dgrad_conv", "cat": "kernel"},
           {"ph": "X", "ts": 30, "dur": 40, "name": "ncclDevKernel_AllReduce_Sum_f32_RING_LL",
            "cat": "kernel"},
           {"ph": "X", "ts": 0, "dur": 90, "name": "autograd::engine::evaluate_function: X", "cat": "cpu_op"}]
    assert T._lanes(gpu, 0, 100) == ([(0, 50)], [(30, 70)])   # NCCL's kernels are communication, not compute
    paths[1].unlink()
    assert T.merge_traces([rec], tmp_path / "again.json") is None   # a rank's file gone: no half merge


# --------------------------------------------------------------------------- on gloo ranks (processes)


def _tiny():
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(4 * 6 * 6, 5)).double()


def _batch(seed, n=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 3, 8, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


@pytest.mark.slow
def test_each_implementation_equals_one_process_on_two_gloo_ranks():
    """K = 3 steps of the spec's SGD through the lab's loop: (a)-(d) on 2 gloo ranks against one process
    on the global batch (each step: both ranks' batches, one forward), float64 tolerance."""
    from lab_utils.learn.loop import make_optimizer, train_steps

    steps = 3

    def global_batch(s):
        (x0, y0), (x1, y1) = _batch(10 * s), _batch(10 * s + 1)
        return torch.cat([x0, x1]), torch.cat([y0, y1])

    torch.manual_seed(0)
    ref = _tiny()
    train_steps(ref, [global_batch(s) for s in range(steps)], steps, make_optimizer(ref),
                torch.nn.CrossEntropyLoss(), None, torch.device("cpu"))
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])

    def ranks(rank, world):
        out = {}
        for name in ("naive", "per_tensor", "flat", "bucketed", "zero1"):
            torch.manual_seed(0)
            model = _tiny()
            opt = make_optimizer(model)
            sync = {"naive": handmade.Naive, "per_tensor": handmade.PerTensor, "flat": handmade.Flat,
                    "zero1": handmade.ZeroOne}.get(name)
            sync = sync(model, opt) if sync else handmade.Bucketed(model, opt, 200)
            train_steps(model, [_batch(10 * s + rank) for s in range(steps)], steps, sync,
                        torch.nn.CrossEntropyLoss(), None, torch.device("cpu"))
            got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out[name] = (float((got - want).abs().max()),
                         bool(torch.allclose(got, want, *handmade.TOLERANCE["float64"])),
                         replica_memory.optimizer_state_bytes(sync))
        return out

    full = sum(p.numel() for p in ref.parameters()) * 8   # 837 float64 momenta
    got = fork_ranks.run_in_ranks(ranks, 2, timeout_s=50)
    for rank_out in got:
        assert set(rank_out) == {"naive", "per_tensor", "flat", "bucketed", "zero1"}, rank_out
        for name, (diff, close, state) in rank_out.items():
            assert close and diff < 1e-12, (name, diff)
            assert state == full or name == "zero1", (name, state)
    assert [r["zero1"][2] for r in got] == [419 * 8, 418 * 8]   # ZeRO-1: each rank its shard's momentum


@pytest.mark.slow
def test_bucketed_launches_every_bucket_during_backward_in_bucket_order():
    def ranks(rank, world):
        torch.manual_seed(0)
        model = _tiny()
        sync = handmade.Bucketed(model, torch.optim.SGD(model.parameters(), lr=0.1), 200)
        x, y = _batch(rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        launched = [k for k, _, _ in sync.launched]     # before step(): the hooks launched them
        sync.step()
        return launched, [[p.shape[0] for p in b] for b in sync.buckets], sync.launched

    for launched, shapes, after in fork_ranks.run_in_ranks(ranks, 2, timeout_s=50):
        assert launched == [0, 1] and after == []
        # DDP's rule at 200 B: Linear bias (40 B), then its weight takes the bucket over the cap, which
        # closes; then Conv bias and weight: last first
        assert shapes == [[5, 5], [4, 4]]


@pytest.mark.slow
def test_per_tensor_launches_every_tensor_during_backward_in_place_last_first():
    """(e): one asynchronous all-reduce per gradient tensor, started by the hooks while backward runs
    (before step()), in reverse parameter order, on the gradient itself (no copy)."""
    def ranks(rank, world):
        torch.manual_seed(0)
        model = _tiny()
        sync = handmade.PerTensor(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = _batch(rank)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        launched = [(k, flat.data_ptr() == p.grad.data_ptr()) for (k, flat, _), p in
                    zip(sync.launched, reversed(list(model.parameters())))]
        sync.step()
        return launched, sync.messages()

    for launched, messages in fork_ranks.run_in_ranks(ranks, 2, timeout_s=50):
        assert launched == [(0, True), (1, True), (2, True), (3, True)]
        # float64: Linear bias 5, weight 5 x 144, then Conv bias 4, weight 4 x 3 x 3 x 3 (8 bytes each)
        assert messages == [("all_reduce", 40), ("all_reduce", 5760), ("all_reduce", 32), ("all_reduce", 864)]


@pytest.mark.slow
def test_every_implementation_starts_from_rank_0s_weights_and_buffers():
    """As DDP does (B5): each rank seeds its own weights and BatchNorm statistics; once wrapped, every rank
    holds rank 0's (the old classes relied on the seed and broadcast nothing)."""
    def ranks(rank, world):
        out = []
        for make in (handmade.Local, handmade.Naive, handmade.PerTensor, handmade.Flat, handmade.ZeroOne,
                     lambda m, o: handmade.Bucketed(m, o, 200)):
            torch.manual_seed(rank)
            model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).double()
            model[1].running_mean.uniform_()
            make(model, torch.optim.SGD(model.parameters(), lr=0.1))
            out.append(torch.cat([t.detach().reshape(-1).double() for t in model.state_dict().values()]))
        return out

    first, second = fork_ranks.run_in_ranks(ranks, 2, timeout_s=50)
    assert all(torch.equal(a, b) for a, b in zip(first, second)) and len(first) == 6


@pytest.mark.slow
def test_memory_of_implementations_whose_bytes_are_known_in_advance():
    """The tiny float64 model, S = 837 x 8 = 6,696 bytes, on 2 gloo ranks, with SGD's momentum: between
    steps no communication holds 3S (weights, gradients, momentum); DDP 4S (its one bucket too); ZeRO-1
    2S + its shard's momentum and gradient (419 x 8 each on rank 0, padded to 419: 2S + 6,704 bytes)."""
    from lab_utils.learn.loop import make_optimizer, train_steps

    def ranks(rank, world):
        batch = _batch(rank)
        out = {}
        for name, make in (("local", handmade.Local), ("zero1", handmade.ZeroOne), ("ddp", None)):
            def build(make=make):
                torch.manual_seed(0)
                model = _tiny()
                opt = make_optimizer(model)
                if make is None:
                    return torch.nn.parallel.DistributedDataParallel(model), opt
                return model, make(model, opt)

            def step(it):
                train_steps(it[0], [batch], 1, it[1], torch.nn.CrossEntropyLoss(), None, torch.device("cpu"))

            use, _ = replica_memory.memory_use(build, step, torch.device("cpu"))
            out[name] = use
        return out

    s = 837 * 8
    for rank, got in enumerate(fork_ranks.run_in_ranks(ranks, 2, timeout_s=50)):
        assert got["local"].held_bytes == 3 * s and got["ddp"].held_bytes == 4 * s, got
        assert got["zero1"].held_bytes == 2 * s + (419 if rank == 0 else 418) * 8 + 419 * 8, got
        assert all(u.peak_bytes > u.held_bytes for u in got.values())


@pytest.mark.timeout(60)
def test_no_rank_exits_before_every_rank_has_answered(tmp_path):
    """A rank that answers at once (a blank exercise raises on its first line) must not exit while a
    peer is still at work: its closed sockets would fail the peer's gloo calls, its
    ``init_process_group`` first (seen once in CI). Rank 1 answers a second after rank 0, then looks
    at rank 0's process: it must still be running (sleeping), not exited (a zombie, or gone)."""
    def ranks(rank, world):
        if rank == 0:
            (tmp_path / "rank0.pid").write_text(str(os.getpid()))
            raise NotImplementedError("not done yet")
        time.sleep(1.0)
        pid = (tmp_path / "rank0.pid").read_text()
        status = Path(f"/proc/{pid}/status")
        return next(ln.split()[1] for ln in status.read_text().splitlines()
                    if ln.startswith("State:")) if status.exists() else "gone"

    first, second = fork_ranks.run_in_ranks(ranks, 2)
    assert "not done yet" in first["error"]
    assert second in ("S", "R"), f"rank 0 was {second!r} while rank 1 still worked"


@pytest.mark.timeout(60)
def test_ctrl_c_while_ranks_work_leaves_no_rank_behind(tmp_path):
    """A kernel interrupt (KeyboardInterrupt in the parent) while one rank still works and another has
    answered: both are ended and reaped before the interrupt propagates, none left waiting."""
    import signal

    def ranks(rank, world):
        (tmp_path / f"rank{rank}.pid").write_text(str(os.getpid()))
        if rank == 1:
            time.sleep(30)
        return rank

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            fork_ranks.run_in_ranks(ranks, 2, timeout_s=20)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    left = [p for p in ("rank0.pid", "rank1.pid")
            if Path(f"/proc/{(tmp_path / p).read_text()}").exists()]
    assert left == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_plan_through_torchrun_gives_every_table_and_the_merged_trace(store):
    """The notebook's path (measure -> launcher -> worker -> records -> tables) on 2 gloo ranks, a tiny
    configuration: everything equal to one process, every implementation's memory, every implementation
    timed ((c) and DDP with the same buckets at the same 0.05 MiB cap), the backward time, the sweep, the
    bf16 rows, one trace per rank merged; a second measure reuses every record."""
    s = profiles.settings(build_ddp.Settings, "quick", devices=(2,), batch_sizes=(2,), width=4, steps=2,
                          check_steps=2, check_batch=2, bucket_cap_mb=0.05, sweep_mb=(0.01,), trace_steps=1,
                          bench_max_bytes=MIB, train_images=64)
    recs = measure("quick", build_ddp.BUILD_DDP_EXPERIMENT, s, machine=CPU2)
    assert [r.status for r in recs] == ["ok"] * 6
    check = T.check_table(recs)
    assert T.check_verdict(check).startswith("passed") and len(check) == 7
    memory = T.memory_table(recs)
    assert len(memory) == 9 and (memory["peak_bytes"] >= memory["held_bytes"]).all()
    main = next(r for r in recs if r.config["kind"] == "compare")
    rows = {(r["implementation"], r["bucket_mb"]): r for r in main.metrics["implementations"]}
    assert len(rows[("bucketed", 0.05)]["messages"]) > 1
    assert rows[("bucketed", 0.05)]["messages"] == rows[("ddp", 0.05)]["messages"]   # DDP's own, logged
    assert 0 < main.metrics["backward_seconds"] < max(r["step_seconds"] for r in rows.values())
    table = T.compare_table(store, recs)
    assert list(table["implementation"]) == [handmade_name for handmade_name in
                                             ("no communication", "(a) naive", "(e) per tensor, overlapped",
                                              "(b) flat", "(c) bucketed", "(d) ZeRO-1 (paper)", "torch DDP")]
    assert (table["step_ms"] > 0).all()
    # the run's own alpha-beta fit (4 KiB ... 1 MiB on gloo), or, on a CPU too busy for one, a row saying so
    assert table["predicted_comm_ms"].notna().all() or table["fit"].str.startswith("no fit: ").all(), table

    by_name = table.set_index("implementation")
    assert {by_name.loc[n, "collectives"] for n in ("(a) naive", "(e) per tensor, overlapped")} == {62}
    grad = next(r for r in recs if r.config["kind"] == "compare").metrics["gradient_bytes"]   # S, fp32
    for name in ("(a) naive", "(e) per tensor, overlapped", "(b) flat", "(c) bucketed", "torch DDP"):  # S
        assert by_name.loc[name, "bytes_per_rank_per_step"] == grad, name
    assert grad <= by_name.loc["(d) ZeRO-1 (paper)", "bytes_per_rank_per_step"] < grad + 2 * 4   # padded
    assert len(T.sweep_table(store, recs)) == 3 and len(T.compression_table(recs)) == 2
    out = T.merge_traces(recs, store.figures_dir / "build_ddp_trace.json")
    events = json.loads(Path(out).read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    assert any(e.get("name") == "gloo:all_reduce" for e in events)
    again = measure("quick", build_ddp.BUILD_DDP_EXPERIMENT, s, machine=CPU2)
    assert [r.metrics for r in again] == [r.metrics for r in recs]


SOLUTION = """import torch.distributed as dist


def average_gradients(grads):
    for g in grads:
        dist.all_reduce(g)
        g /= dist.get_world_size()
    return grads
"""


@pytest.mark.slow
def test_the_exercise_runs_on_gloo_ranks_inside_the_sandbox(tmp_path):
    """The grader's child, in bubblewrap (no network: gloo over the sandbox's loopback), runs a student's
    average_gradients on 2 and 3 ranks; a sum without the division gives its known wrong answer."""
    from lab_utils.app.grading import sandbox

    why = sandbox.probe()
    if why:
        pytest.skip(why)
    cases = [{"grads": [[[1.0, 2.0], [3.0]], [[5.0, 6.0], [7.0]]]},
             {"grads": [[[1.0, 2.0]], [[4.0, 8.0]], [[7.0, -3.0]]]}]
    notebook = tmp_path / "09_build_ddp.ipynb"
    notebook.write_text("{}")
    wrong = SOLUTION.replace("        g /= dist.get_world_size()\n", "")
    job = {"questions": [{"name": "q09_average", "function": "average_gradients", "code": code,
                          "first_line": 4, "cases": [[0, i, c] for i, c in enumerate(cases)]}
                         for code in (SOLUTION, wrong)]}
    out = sandbox.run(job, notebook, sandbox.Limits(wall_seconds=50), sandbox=True)
    answers = [r["answer"] for r in out.lines if "answer" in r]
    assert out.sandbox == "bwrap" and out.done and len(answers) == 4, (out.lines, out.stderr[-2000:])
    given = "the tensors it was given"
    assert answers[0] == [{"grads": [[3.0, 4.0], [5.0]], "returns": given}] * 2
    first = answers[1][0]["grads"][0]
    assert first[0] == 4.0 and math.isclose(first[1], 7 / 3, rel_tol=1e-6)
    assert answers[2] == [{"grads": [[6.0, 8.0], [10.0]], "returns": given}] * 2   # summing without dividing


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_alternative_answers_earn_every_case_and_the_prompts_demands_are_named():
    """Each tests/alternatives/q09_*.py (another correct answer: dividing before the all-reduce, another
    style of DDP's bucket rule, of the shards, a simulation of the exposed time) passes every public and
    hidden case the build writes; an average that works on copies, or forgets its return, is told so."""
    from lab_utils.app.grading import EXERCISES, build
    from lab_utils.app.grading import notebooks as nbs
    from lab_utils.app.grading.exercises import verdict

    master = nbs.parse_master(Path(__file__).resolve().parent.parent / "labs" / "09_build_ddp.ipynb")
    folder = Path(__file__).resolve().parent / "alternatives"
    specs = {q.name: build.exercise_spec(master, q) for q in master.questions if not q.manual}
    assert sorted(p.stem for p in folder.glob("q09_*.py")) == sorted(specs)
    for name, spec in specs.items():
        ns: dict = {}
        exec(compile((folder / f"{name}.py").read_text(), name, "exec"), ns)
        fn = ns[EXERCISES[name].function]
        for t in spec["tests"]:
            cases = [c["case"] for c in t["cases"]]
            assert verdict(name, fn, cases, [c["expected"] for c in t["cases"]], t["hidden"]) == "", name
    public = [c for t in specs["q09_average"]["tests"] if not t["hidden"] for c in t["cases"]]
    cases, expected = [c["case"] for c in public], [c["expected"] for c in public]
    loop = "    for g in grads:"
    copies = SOLUTION.replace(loop, "    grads = [g.clone() for g in grads]\n" + loop)
    no_return = SOLUTION.replace("    return grads\n", "")
    for code, named in ((copies, "new tensors, not in place"), (no_return, "the return missing")):
        ns = {}
        exec(code, ns)
        assert named in verdict("q09_average", ns["average_gradients"], cases, expected), named
