"""Notebooks 02/03: where each configuration runs, Table 1 and Table 2 arithmetic by hand,
the rows that did not run, OOM handling, and one small end-to-end run over gloo."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from lab_utils.app.grading.predict import one_output
from lab_utils.engine import plan, profiles
from lab_utils.engine.machine import BUDGET_NODE, Machine
from lab_utils.engine.plan import Experiment
from lab_utils.engine.store import Record
from lab_utils.experiments.n02_scaling import experiment as scaling
from lab_utils.experiments.n02_scaling import strong_weak as scaling_strong_weak
from lab_utils.experiments.n02_scaling import tables as scaling_tables
from lab_utils.experiments.n03_compute_vs_comm import tables as compute_vs_comm
from lab_utils.experiments.n03_compute_vs_comm.experiment import COMPUTE_VS_COMM_EXPERIMENT
from lab_utils.experiments.shared.anchors import (
    FIRST_COHORT_LABEL,
    FIRST_COHORT_TABLE1_SECONDS,
    OTHER_COHORT_LABEL,
)
from lab_utils.experiments.shared.repeats import merge_repeats
from lab_utils.experiments.shared.rows import one_device_runs, pair_key, per_step
from lab_utils.learn.comm_probe import compute_to_comm, hidden_percent
from lab_utils.learn.errors import LabError, LaunchError
from lab_utils.learn.ranks import probe_seconds

QUICK = profiles.settings(scaling.Settings, "quick")


# --------------------------------------------------------------------------- placement


def test_placement_without_gpus_uses_gloo_processes_up_to_max_cpu_processes():
    s = profiles.settings(scaling.Settings, "quick", max_cpu_processes=4, cpu_threads=1)
    cpu = Machine(gpus=0, cores=2)
    p1, p2, p4 = (scaling.place(scaling.DDP, n, cpu, s) for n in (1, 2, 4))
    assert (p1.backend, p1.device_type, p1.runs) == ("gloo", "cpu", True)
    assert p2.runs and p2.backend == "gloo"
    assert p4.runs and p4.backend == "gloo"                     # 4 processes on 2 cores: run (rows say so)
    assert not scaling.place(scaling.DDP, 8, Machine(cores=16), s).runs  # above max_cpu_processes
    for n in (1, 2):
        dp = scaling.place(scaling.DP, n, cpu, s)
        assert not dp.runs and dp.reason == ("needs 1 GPU" if n == 1 else "needs 2 GPUs")
    assert scaling.methods_here(cpu) == (scaling.DDP,)


def test_oversubscribed_rows_say_so():
    from lab_utils.engine.store import Record

    def rec(devices, threads, cores, device_type="cpu"):
        return Record("scaling", {"devices": devices, "device_type": device_type}, threads=threads,
                      hardware={"cpu_cores": cores})

    assert scaling_tables.oversubscribed(rec(4, 1, 2)) == "4 processes x 1 thread on 2 cores"
    assert scaling_tables.oversubscribed(rec(2, 2, 2)) == "2 processes x 2 threads on 2 cores"
    assert scaling_tables.oversubscribed(rec(2, 1, 2)) is None            # one core each
    assert scaling_tables.oversubscribed(rec(4, None, 2)) is None         # stored before threads were kept
    assert scaling_tables.oversubscribed(rec(4, 1, 2, "cuda")) is None


def test_placement_with_two_gpus():
    s = profiles.settings(scaling.Settings, "full")
    two = Machine(gpus=2, gpu_name="NVIDIA A100-SXM4-80GB", cores=16, bf16=True)
    assert scaling.place(scaling.DDP, 2, two, s).backend == "nccl"
    assert scaling.place(scaling.DP, 2, two, s).backend == scaling.DP_BACKEND
    four = scaling.place(scaling.DDP, 4, two, s)
    assert not four.runs and four.reason == "needs 4 GPUs"   # never gloo beside GPUs
    assert scaling.methods_here(two) == (scaling.DP, scaling.DDP)


def test_the_plan_for_a_four_gpu_node_launches_every_gpu_run():
    """Made on this CPU: DataParallel in one process over N GPUs, DDP with one rank per GPU; one launch
    per (method, devices) with its batch sizes; nothing in the notebook's kernel."""
    s = profiles.settings(scaling.Settings, "full")
    runs = scaling.plan(s, BUDGET_NODE, "full")
    assert len(runs) == 2 * len(s.devices) * len(s.batch_sizes) and not any(r.in_process for r in runs)
    dp = [r for r in runs if r.config["method"] == scaling.DP]
    assert {(r.processes, r.device, r.config["backend"]) for r in dp} == {(1, "cuda", scaling.DP_BACKEND)}
    assert all(r.options == {"process_group": False} for r in dp)
    ddp = [r for r in runs if r.config["method"] == scaling.DDP]
    assert {r.processes for r in ddp} == {1, 2, 4} and all(r.config["backend"] == "nccl" for r in ddp)
    assert all(r.processes == r.config["devices"] for r in ddp)
    assert len({r.group for r in runs}) == 6
    assert [r.config["batch_size"] for r in runs[:4]] == [32, 128, 512, 2048]
    assert all(r.skip is None for r in runs)
    # notebook 03: T(1) is notebook 02's one-device run (the same key: reused from its store)
    t3 = scaling.plan_compute_vs_comm(s, BUDGET_NODE, "full")
    ones = [r for r in t3 if r.config["devices"] == 1]
    assert {r.key for r in ones} <= {r.key for r in runs}
    assert all(r.experiment == scaling.SCALING for r in ones)
    comm = [r for r in t3 if r.experiment == scaling.COMPUTE_VS_COMM]
    assert all(r.config["measure_comm"] and r.config["comm_steps"] == s.comm_steps for r in comm)


def test_settings_overrides_and_bad_values():
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=[32, 128], width=None)
    assert s.batch_sizes == (32, 128) and s.width == QUICK.width
    with pytest.raises(LabError, match="Unknown scaling setting"):
        profiles.settings(scaling.Settings, "quick", colour="red")
    with pytest.raises(LabError):
        profiles.settings(scaling.Settings, "quick", batch_sizes=[0])
    with pytest.raises(LabError):
        profiles.settings(scaling.Settings, "quick", timeout_s=0)


# --------------------------------------------------------------------------- tables by hand


def agg(method, n, b, t, steps, status="ok", reason=None, backend="nccl", **metrics):
    cfg = {"method": method, "record": "aggregate", "rank": None, "devices": n, "batch_size": b,
           "backend": backend, "device_type": "cuda"}
    m = {"train_seconds": t, "steps": steps, **metrics} if status == "ok" else {}
    return Record("scaling", cfg, m, status=status, reason=reason, synthetic=False, dataset="CIFAR-10",
                  hardware={"device_name": "GPU X", "device_count": n})


def merged(rec):
    """A worker's record as a table's row holds it (core.spread.merge_repeats: one measurement, its
    train_seconds_median is its train_seconds)."""
    return merge_repeats([rec])[0]


def test_table1_speedups_and_efficiency_by_hand():
    recs = [agg("DDP", 1, 128, 40.0, 16), agg("DDP", 2, 128, 23.0, 8), agg("DDP", 4, 128, 12.5, 4),
            agg("DDP", 4, 512, None, None, status="skipped", reason="needs 4 GPUs"),
            agg("DataParallel", 2, 128, 30.0, 8, backend=scaling.DP_BACKEND)]  # no DP T(1): no speedup
    df = scaling_tables.scaling_frame(recs).set_index(["method", "devices", "per_device_batch"])
    two = df.loc[("DDP (NCCL, GPUs)", 2, 128)]
    assert two["speedup"] == pytest.approx(40 / 23)
    assert two["efficiency"] == pytest.approx(40 / 23 / 2)
    # per-step times: t(1) = 40/16 = 2.5 s, t(2) = 23/8 = 2.875 s -> 2 x 2.5 / 2.875
    assert two["TN_seconds_per_step"] == pytest.approx(2.875)
    assert two["scaled_speedup"] == pytest.approx(2 * 2.5 / 2.875)
    assert two["n_t1_over_tn_epoch"] == pytest.approx(80 / 23)  # 2 x 40 / 23: N counted twice
    assert two["serial_fraction"] == pytest.approx((23 / 40 - 0.5) / 0.5)  # 0.15 by hand
    assert pd_missing(df.loc[("DDP (NCCL, GPUs)", 1, 128)]["serial_fraction"])
    four = df.loc[("DDP (NCCL, GPUs)", 4, 128)]
    assert four["speedup"] == pytest.approx(3.2) and four["efficiency"] == pytest.approx(0.8)
    skipped = df.loc[("DDP (NCCL, GPUs)", 4, 512)]
    assert skipped["status"] == "needs 4 GPUs"
    assert all(pd_missing(skipped[c]) for c in ("epoch2_train_seconds", "speedup", "efficiency"))
    dp = df.loc[("DataParallel (1 process, GPUs)", 2, 128)]
    assert dp["epoch2_train_seconds"] == 30.0 and pd_missing(dp["speedup"])


def test_skew_wait_columns_new_and_old_records():
    """T(N) is ``train_seconds`` (loader and skew waits excluded); the skew wait is its own column,
    blank for records written before the barrier existed and for DataParallel."""
    recs = [agg("DDP", 1, 128, 40.0, 16, skew_wait_seconds_max=0.0, train_plus_skew_wait_seconds=40.0),
            agg("DDP", 2, 128, 21.0, 8, skew_wait_seconds_max=3.0, train_plus_skew_wait_seconds=24.0),
            agg("DDP", 2, 32, 30.0, 32),                                  # an old record: no field
            agg("DataParallel", 2, 128, 30.0, 8, backend=scaling.DP_BACKEND)]
    df = scaling_tables.scaling_frame(recs).set_index(["method", "devices", "per_device_batch"])
    new = df.loc[("DDP (NCCL, GPUs)", 2, 128)]
    assert new["epoch2_train_seconds"] == 21.0 and new["speedup"] == pytest.approx(40 / 21)
    assert new["skew_wait_seconds"] == 3.0 and new["train_plus_skew_wait_seconds"] == 24.0
    assert df.loc[("DDP (NCCL, GPUs)", 1, 128)]["skew_wait_seconds"] == 0.0
    for key in (("DDP (NCCL, GPUs)", 2, 32), ("DataParallel (1 process, GPUs)", 2, 128)):
        assert pd_missing(df.loc[key]["skew_wait_seconds"])
        assert pd_missing(df.loc[key]["train_plus_skew_wait_seconds"])
    row = compute_vs_comm.comm_row(*merge_repeats([recs[1], recs[0]]))
    assert row.skew_wait_seconds == 3.0 and row.tn_seconds == 21.0
    assert row.comm_a_seconds == pytest.approx(21.0 - 20.0)  # the 3 s loader skew is not communication
    assert compute_vs_comm.comm_row(merged(recs[2]), None).skew_wait_seconds is None
    t2 = compute_vs_comm.compute_vs_comm_frame([row])
    assert t2.iloc[0]["skew_wait_seconds"] == 3.0


def test_amdahl_gustafson_karp_flatt_by_hand():
    from lab_utils.learn.speedup import (
        amdahl_speedup,
        gustafson_serial_fraction,
        gustafson_speedup,
        karp_flatt,
    )

    assert amdahl_speedup(0.1, 4) == pytest.approx(1 / (0.1 + 0.9 / 4))      # 3.0769
    assert gustafson_speedup(0.1, 4) == pytest.approx(4 - 0.1 * 3)          # 3.7
    assert karp_flatt(amdahl_speedup(0.1, 4), 4) == pytest.approx(0.1)  # inverse of Amdahl
    assert karp_flatt(4.0, 4) == pytest.approx(0.0) and karp_flatt(1.0, 1) is None
    # issue 52 C5: e = 0.1 of the one-device time is s = 0.1 / (0.1 + 0.9/4) = 0.1 / 0.325 = 0.3077 of the
    # 4-device run's time; Gustafson with that s at N = 4 is the measured 3.0769 again, with e it was 3.7
    s = gustafson_serial_fraction(0.1, 4)
    assert s == pytest.approx(0.1 / 0.325)
    assert gustafson_speedup(s, 4) == pytest.approx(amdahl_speedup(0.1, 4))
    assert gustafson_serial_fraction(0.0, 4) == 0.0 and gustafson_serial_fraction(1.0, 4) == 1.0


def test_serial_fraction_frame_projects_only_sensible_fractions():
    recs = [agg("DDP", 1, 128, 40.0, 16), agg("DDP", 2, 128, 23.0, 8), agg("DDP", 4, 128, 9.0, 4)]
    sf = scaling_tables.serial_fraction_frame(scaling_tables.scaling_frame(recs), project_to=8)
    two, four = sf.iloc[0], sf.iloc[1]
    assert two["serial_fraction"] == pytest.approx(0.15)
    assert two["amdahl_speedup_at_8"] == pytest.approx(1 / (0.15 + 0.85 / 8))
    # Gustafson takes the serial share of the 2-device run, s = 0.15 / (0.15 + 0.85/2) = 0.2609, not e
    assert two["gustafson_serial_fraction"] == pytest.approx(0.15 / 0.575)
    assert two["gustafson_speedup_at_8"] == pytest.approx(8 - 0.15 / 0.575 * 7)
    assert four["speedup"] > 4 and pd_missing(four["amdahl_speedup_at_8"]) and "super-linear" in four["note"]


def test_comm_volume_by_hand():
    rec = agg("DDP", 4, 32, 10.0, 391, gradient_bytes=44_695_848)
    df = scaling_tables.comm_volume_frame([rec, agg("DDP", 1, 32, 40.0, 1563, gradient_bytes=44_695_848)])
    assert len(df) == 1  # one device sends nothing
    r = df.iloc[0]
    assert r["allreduce_mb_per_step_per_rank"] == pytest.approx(2 * 3 / 4 * 44.695848)
    assert r["allreduce_mb_per_epoch_per_rank"] == pytest.approx(2 * 3 / 4 * 44.695848 * 391)
    assert r["bytes_per_image"] == pytest.approx(2 * 3 / 4 * 44_695_848 / 32)


def pd_missing(v) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def test_table1_saved_rows_say_why_and_show_no_number(store):
    recs = [agg("DDP", 1, 32, 10.0, 4), agg("DDP", 2, 32, 6.0, 2),
            agg("DDP", 4, 32, None, None, status="skipped", reason="needs 4 GPUs")]
    scaling_tables.scaling_table(store, recs, QUICK)
    md = (store.tables_dir / "scaling.md").read_text()
    row4 = [line for line in md.splitlines() if "needs 4 GPUs" in line]
    assert len(row4) == 1 and "nan" not in md.lower()
    cells = [c.strip() for c in row4[0].strip("|").split("|")]
    assert all(c == "" for c in cells[5:])  # no time, no speedup, no efficiency
    csv = (store.tables_dir / "scaling.csv").read_text()
    assert "needs 4 GPUs" in csv and "provenance" in csv.splitlines()[0]
    fig, path = scaling_tables.speedup_figure(store, recs, QUICK)
    assert path.exists() and path.suffix == ".png"


def test_table2_three_methods_by_hand():
    one = agg("DDP", 1, 128, 40.0, 16)
    # what the worker's rank entry holds: a probe of 0.125 s exposed and 0.3125 s all-reduce per step,
    # over 8 steps (core.ranks.probe_seconds, the one place (b), (c) and their overlap are computed)
    probe = {"exposed_per_step_seconds": 0.125, "allreduce_per_step_seconds": 0.3125, "noise_seconds": 0.0}
    measured = probe_seconds(probe, 8)
    assert measured["exposed_comm_seconds"] == 1.0 and measured["allreduce_seconds"] == 2.5
    two = agg("DDP", 2, 128, 23.0, 8, gradient_bytes=44_695_848, **measured)
    row = compute_vs_comm.comm_row(merged(two), merged(one))
    assert (row.compute_a_seconds, row.comm_a_seconds) == (pytest.approx(20.0), pytest.approx(3.0))
    assert row.overlap_seconds == pytest.approx(1.5) and row.overlap_fraction == pytest.approx(0.6)
    df = compute_vs_comm.compute_vs_comm_frame([row])
    r = df.iloc[0]
    assert r["compute_to_comm_a"] == pytest.approx(20 / 3)
    assert r["hidden_percent"] == pytest.approx(60.0)
    assert r["compute_to_comm_b"] == pytest.approx((23 - 1) / 1)
    # without T(1) the derived split is not made up
    lonely = compute_vs_comm.comm_row(merged(two), None)
    assert lonely.compute_a_seconds is None and "T(1) missing" in lonely.status
    # a row that did not run stays a reason
    row = agg("DDP", 4, 128, None, None, status="skipped", reason="needs 4 GPUs")
    skipped = compute_vs_comm.comm_row(merged(row), merged(one))
    assert skipped.status == "needs 4 GPUs" and skipped.tn_seconds is None


# --------------------------------------------------------------------------- OOM and failures


def test_dataparallel_oom_is_a_row_and_larger_batches_are_not_tried(store, monkeypatch, fake_gpu,
                                                                     launch_here):
    """The DataParallel worker, launched (here: run by the harness in this process, on the fake GPU), with an
    out-of-memory at per-GPU batch 128: an oom row, 512 not tried, nothing of the failed run kept alive."""
    import weakref

    import torch

    from lab_utils.experiments.n02_scaling import dp_worker as dataparallel

    fake_gpu(count=1, name="Fake GPU")
    tried, refs = [], []

    def fake_epoch(model, loader, opt, device, epoch):
        tried.append(loader.batch_size)
        activations = torch.ones(128, 128)              # only in this frame and the traceback
        refs.append(weakref.ref(activations))
        if loader.batch_size >= 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return SimpleNamespace(as_dict=lambda: {"epoch": epoch, "train_seconds": 1.0, "epoch_seconds": 1.2,
                                                "steps": 4})

    monkeypatch.setattr(dataparallel, "run_epoch", fake_epoch)
    monkeypatch.setattr(dataparallel, "ResNet18", lambda width: torch.nn.Linear(2, 2))
    monkeypatch.setattr(dataparallel, "wrap_data_parallel", lambda model, device_ids: model)
    monkeypatch.setattr(torch.nn.Module, "cuda", lambda self, *a, **k: self)
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=(32, 128, 512), run_batch_sizes=None,
                          devices=(1,), epochs=1, dataset="synthetic")
    one_gpu = Machine(gpus=1, gpu_name="Fake GPU", cores=2)
    exp = Experiment("dp", "02", scaling.Settings,
                     lambda *a: [r for r in scaling.plan(*a) if r.config["method"] == scaling.DP])
    res = plan.measure("quick", exp, s, machine=one_gpu)
    assert (tried == [32, 128]
            and [m for m, n, job in launch_here] == ["lab_utils.experiments.n02_scaling.dp_worker"])
    ok, oom, skipped = res
    assert ok.status == "ok" and ok.metrics["train_seconds"] == 1.0
    assert oom.status == "oom" and oom.reason == "OOM: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert skipped.reason == "not tried: DataParallel 1 x 128 already ran out of memory"
    stored = {r.config["batch_size"]: r.status for r in store.latest(scaling.SCALING)}
    assert stored == {32: "ok", 128: "oom"}             # the skipped row follows from the OOM row
    assert all(ref() is None for ref in refs)           # nothing of the failed run is kept alive
    tried.clear()  # a stored OOM row stops larger batches on the next run too
    again = plan.measure("quick", exp, s, machine=one_gpu)
    assert tried == [] and [r.status for r in again] == ["ok", "oom", "skipped"]


def test_a_rank_oom_in_a_launch_keeps_earlier_batches_and_skips_larger(store, monkeypatch):
    """A DDP launch whose rank 1 ran out of memory at the second batch size: its failure file (not the
    log) makes that size an oom row; the first size's records are stored; the third is not tried."""
    import lab_utils.engine.launcher as launcher

    s = profiles.settings(scaling.Settings, "quick", devices=(2,), run_batch_sizes=None,
                          batch_sizes=(32, 128, 512), dataset="synthetic", train_images=1024)  # 2 x 512 fits
    runs = [r for r in scaling.plan(s, Machine(gpus=2, gpu_name="Fake GPU", cores=8), "quick")
            if r.config["method"] == scaling.DDP]

    def fake_stream(module, job, nproc, **kw):
        assert (module, nproc, [c["batch_size"] for c in job["configs"]]) == (
            "lab_utils.experiments.n02_scaling.ddp_worker", 2, [32, 128, 512])
        yield Record("scaling", job["configs"][0], {"train_seconds": 1.0})
        oom = "OOM: CUDA out of memory. Tried to allocate 1 GiB"
        raise LaunchError("rank 1 failed", failure={"status": "oom", "rank": 1, "config_index": 1,
                                                    "reason": oom})

    monkeypatch.setattr(launcher, "stream", fake_stream)
    got = plan.measure("quick", scaling.SCALING_EXPERIMENT, s, runs=runs)
    assert [(r.config["batch_size"], r.status) for r in got] == [(32, "ok"), (128, "oom"), (512, "skipped")]
    assert got[1].reason.startswith("OOM: CUDA out of memory") and got[2].reason.startswith("not tried")
    assert [r.status for r in store.records("scaling")] == ["ok", "oom"]   # the skipped row is not stored

    def broken(module, job, nproc, **kw):
        raise LaunchError("rank 1 failed: ImportError: no module", failure={
            "status": "error", "rank": 1, "config_index": 0, "reason": "ImportError: no module"})
        yield

    monkeypatch.setattr(launcher, "stream", broken)
    with pytest.raises(LaunchError, match="ImportError"):
        plan.measure("quick", scaling.SCALING_EXPERIMENT, s, runs=runs, force=True)


def test_rows_needing_gpus_are_not_stored(store):
    s = profiles.settings(scaling.Settings, "quick", devices=(4,), max_cpu_processes=2, dataset="synthetic")
    res = plan.measure("quick", scaling.SCALING_EXPERIMENT, s, machine=Machine(cores=2))
    assert [r.reason for r in res] == ["needs 4 GPUs"] * len(s.batch_sizes)
    assert store.records("scaling") == []


# --------------------------------------------------------------------------- end to end (gloo)


@pytest.mark.slow
def test_notebook_02_and_03_flow_on_two_cpu_processes(store):
    s = profiles.settings(scaling.Settings, "quick", batch_sizes=(8, 16, 32), run_batch_sizes=(8, 16),
                          devices=(1, 2), comm_devices=(2, 4), width=2, train_images=64, comm_steps=2,
                          max_cpu_processes=2, bucket_cap_mb=0.01, timeout_s=300, dataset="synthetic")
    records = plan.measure("quick", COMPUTE_VS_COMM_EXPERIMENT, s, machine=Machine(cores=2))
    aggs = plan.aggregates(records)
    one = [r for r in aggs if r.config["devices"] == 1]
    many = [r for r in aggs if r.config["devices"] > 1]
    assert {r.metrics.get("world_size") for r in one if r.status == "ok"} == {1}
    assert [(r.config["devices"], r.config["batch_size"], r.status) for r in many] == [
        (2, 8, "ok"), (2, 16, "ok"), (2, 32, "skipped"), (4, 8, "skipped"), (4, 16, "skipped"),
        (4, 32, "skipped")]
    df = compute_vs_comm.compute_vs_comm_table(store, records, s)
    ok = df[df["status"] == "ok"]
    assert len(ok) == 2
    for _, r in ok.iterrows():
        assert r["compute_a_seconds"] == pytest.approx(r["T1_seconds"] / 2)
        assert r["comm_a_seconds"] == pytest.approx(r["TN_seconds"] - r["T1_seconds"] / 2)
        assert r["exposed_comm_b_seconds"] >= 0 and r["allreduce_c_seconds"] > 0
    assert set(df[df["devices"] == 4]["status"]) == {"needs 4 GPUs"}
    assert (store.tables_dir / "compute_vs_comm.md").exists()
    fig, path = compute_vs_comm.compute_vs_comm_figure(store, df, many)
    assert path.exists()
    # Table 3's interface reads the same records
    rows = compute_vs_comm.comm_measurements(store)
    assert sorted(r.per_device_batch for r in rows) == [8, 16]
    assert all(r.gradient_bytes > 0 and r.steps_per_epoch > 0 and r.t1_seconds for r in rows)
    # per-rank breakdown: two ranks, then the aggregate's mean and slowest-rank rows, as the worker
    # computed them (not recomputed by the table)
    br = compute_vs_comm.rank_breakdown_frame(records, 2, 8)  # measure returned the per-rank records too
    aggregate = next(r for r in many if r.config["batch_size"] == 8).metrics
    assert list(br["rank"]) == [0, 1, "mean", f"slowest (rank {aggregate['slowest_rank']}, reported)"]
    assert br.iloc[-1]["train_seconds"] == max(br.iloc[:2]["train_seconds"]) == aggregate["train_seconds"]
    assert br.iloc[-2]["epoch_seconds"] == pytest.approx(br.iloc[:2]["epoch_seconds"].mean())
    assert (br["skew_wait_seconds"] >= 0).all()
    # resume: nothing is measured again, and Table 1 is built from the stored records
    stored = len(store.records(scaling.SCALING))
    ones = profiles.override(s, devices=(1,))
    again = plan.aggregates(plan.measure("quick", scaling.SCALING_EXPERIMENT, ones, machine=Machine(cores=2)))
    assert len(store.records(scaling.SCALING)) == stored  # nothing measured again
    assert [r.status for r in again] == ["ok", "ok", "skipped"]
    t1 = scaling_tables.scaling_frame(records)
    two = t1[(t1["devices"] == 2) & (t1["status"] == "ok")]
    assert (two["speedup"] > 0).all() and (two["efficiency"] == two["speedup"] / 2).all()


# ------------------------------------------------------------------------ issue 18 (Q2, Karp-Flatt, labels)


def test_karp_flatt_on_a_slowdown_is_not_super_linear():
    """Speedups 0.741 and 0.987 on 2 devices: e = (1/S - 1/2)/(1 - 1/2) = 1.699 and 1.026 (> 1:
    slower than one device), flagged as a slowdown, not as 'super-linear'."""
    assert scaling_tables.karp_flatt(0.741, 2) == pytest.approx(1.699, abs=5e-4)   # (1.3495 - 0.5) / 0.5
    assert scaling_tables.karp_flatt(0.987, 2) == pytest.approx(1.026, abs=5e-4)
    recs = [agg("DDP", 1, 32, 7.41, 8), agg("DDP", 2, 32, 10.0, 4),        # speedup 0.741
            agg("DDP", 1, 128, 9.87, 2), agg("DDP", 2, 128, 10.0, 1),      # speedup 0.987
            agg("DDP", 1, 512, 10.0, 1), agg("DDP", 2, 512, 4.0, 1)]       # speedup 2.5 > N
    sf = scaling_tables.serial_fraction_frame(scaling_tables.scaling_frame(recs))
    sf = sf.set_index("per_device_batch")
    for b, e in ((32, 1.699), (128, 1.026)):
        assert sf.loc[b, "serial_fraction"] == pytest.approx(e, abs=5e-4)
        assert "SLOWER than one" in sf.loc[b, "note"] and "super-linear" not in sf.loc[b, "note"]
        assert pd_missing(sf.loc[b, "amdahl_speedup_at_8"])
    assert "super-linear" in sf.loc[512, "note"]


def test_fixed_global_batch_comparison_from_the_spec_anchors():
    """1 GPU bs128 33.64 s vs 4 GPUs x 32 11.65 s: strong 33.64/11.65 = 2.888; weak (4 x 128, 9.23 s)
    33.64/9.23 = 3.645. 1 x 512 33.95 s vs 4 x 128 9.23 s: 3.678; weak 4 x 512 9.01 s: 3.768."""
    df = scaling_strong_weak.fixed_global_batch_frame(seconds=FIRST_COHORT_TABLE1_SECONDS, method="anchors")
    df = df.set_index("global_batch")
    assert list(df.index) == [128, 512] and set(df["devices"]) == {4}
    assert df.loc[128, "strong_speedup"] == pytest.approx(2.888, abs=1e-3)
    assert df.loc[128, "weak_speedup"] == pytest.approx(3.645, abs=1e-3)
    assert df.loc[128, "strong_efficiency"] == pytest.approx(2.888 / 4, abs=1e-3)
    assert df.loc[512, "strong_speedup"] == pytest.approx(3.678, abs=1e-3)
    assert df.loc[512, "weak_speedup"] == pytest.approx(3.768, abs=1e-3)
    assert set(df["better"]) == {"weak"}
    verdict = scaling_strong_weak.fixed_global_batch_verdict(df.reset_index())
    assert verdict.startswith("Strong scaling (fixed global batch) would be WORSE") and "2.89x" in verdict
    # the verdict follows the numbers, it is not written in advance
    flipped = scaling_strong_weak.fixed_global_batch_frame(
        seconds={(1, 128): 40.0, (4, 32): 8.0, (4, 128): 12.0})
    assert "BETTER" in scaling_strong_weak.fixed_global_batch_verdict(flipped)


def test_fixed_global_batch_rows_that_were_not_measured_say_why(store):
    recs = [agg("DDP", 1, 32, 4.0, 32, backend="gloo"), agg("DDP", 1, 128, 3.0, 8, backend="gloo"),
            agg("DDP", 4, 32, None, None, status="skipped", reason="needs 4 GPUs", backend="gloo"),
            agg("DDP", 4, 128, None, None, status="skipped", reason="needs 4 GPUs", backend="gloo")]
    df = scaling_strong_weak.fixed_global_batch_frame(recs)
    assert len(df) == 1 and df.iloc[0]["global_batch"] == 128
    assert df.iloc[0]["status"] == "no strong-scaling comparison: 4 x 32: needs 4 GPUs"
    assert pd_missing(df.iloc[0]["strong_speedup"])
    assert scaling_strong_weak.fixed_global_batch_verdict(df).startswith("No verdict")
    full, verdicts = scaling_strong_weak.fixed_global_batch_table(store, recs)
    assert list(verdicts) == ["This run", FIRST_COHORT_LABEL, OTHER_COHORT_LABEL]
    assert verdicts["This run"].startswith("No verdict") and "WORSE" in verdicts[FIRST_COHORT_LABEL]
    assert verdicts[OTHER_COHORT_LABEL].startswith("More GPUs were SLOWER at global batch 32 and 128")
    text = (store.tables_dir / "scaling_fixed_global_batch.md").read_text()
    assert "1,563 steps per epoch at G = 32 and 391 at 128" in text and "wall-clock" in text
    # the other cohort's rows sit beside this run's: strong columns only, their G split over the GPUs
    other = full[full["method"] == OTHER_COHORT_LABEL].set_index(["devices", "global_batch"])
    assert len(other) == 8 and other["weak_speedup"].isna().all()
    assert other.loc[(4, 32), "strong_per_device_batch"] == 8 and other.loc[(4, 32), "T1_seconds"] == 38.0
    assert other.loc[(4, 32), "strong_speedup"] == pytest.approx(38 / 121)          # 0.314: slower
    assert other.loc[(2, 512), "strong_speedup"] == pytest.approx(13 / 9)           # 1.444


def test_anchor_frame_shows_each_cohort_as_what_it_measured():
    """The earlier cohort's Table 1 (per-GPU batch fixed, module not stated) and the other cohort's
    DataParallel (global batch fixed: its 38 / 67 / 121 s are global batch 32, 8 per GPU on 4 GPUs,
    1,563 steps per epoch on 1, 2 and 4 GPUs alike), each with its steps per epoch."""
    df = scaling_tables.anchor_frame()
    assert set(df["method"]) == {FIRST_COHORT_LABEL, OTHER_COHORT_LABEL}
    assert "DataParallel" not in FIRST_COHORT_LABEL and not df["method"].str.contains("DDP").any()
    other = df[df["method"] == OTHER_COHORT_LABEL].set_index(["gpus", "global_batch"])
    assert len(other) == 12 and set(other["fixed"]) == {"global batch"}
    assert [other.loc[(n, 32), "epoch2_seconds"] for n in (1, 2, 4)] == [38.0, 67.0, 121.0]
    assert [other.loc[(n, 32), "per_gpu_batch"] for n in (1, 2, 4)] == [32, 16, 8]
    assert {other.loc[(n, 32), "steps_per_epoch"] for n in (1, 2, 4)} == {1563}      # ceil(50,000 / 32)
    assert {other.loc[(n, 128), "steps_logged"] for n in (1, 2, 4)} == {391}
    assert [other.loc[(n, 2048), "steps_per_epoch"] for n in (1, 2, 4)] == [25, 25, 25]
    assert other.loc[(4, 128), "speedup"] == pytest.approx(16 / 30)
    first = df[df["method"] == FIRST_COHORT_LABEL].set_index(["gpus", "per_gpu_batch"])
    assert len(first) == 9 and set(first["fixed"]) == {"per-GPU batch"}
    assert first.loc[(2, 32), "global_batch"] == 64 and first.loc[(2, 32), "steps_per_epoch"] == 782
    assert first.loc[(4, 512), "steps_per_epoch"] == 25 and first.loc[(2, 128), "steps_per_epoch"] == 196
    assert first.loc[(2, 32), "speedup"] == pytest.approx(41.3 / 23.15)             # 1.784


def test_rows_that_cannot_run_on_a_cpu_are_labelled_gloo_not_nccl(store):
    s = profiles.settings(scaling.Settings, "quick", devices=(4,), max_cpu_processes=2, dataset="synthetic")
    records = plan.measure("quick", scaling.SCALING_EXPERIMENT, s, machine=Machine(cores=2))
    df = scaling_tables.scaling_frame(records)
    assert set(df["method"]) == {"DDP (gloo, CPU processes)"}
    assert set(df["status"]) == {"needs 4 GPUs"}


def test_dataparallel_threads_are_pinned_in_quick_only():
    """The DataParallel process runs with cpu_threads torch threads in quick (the launcher's
    OMP_NUM_THREADS), as the DDP workers do; full leaves torch's own."""
    gpu = Machine(gpus=1, gpu_name="Fake GPU", cores=8)
    quick = profiles.settings(scaling.Settings, "quick", devices=(1,))
    full = profiles.settings(scaling.Settings, "full", devices=(1,))
    assert quick.pin_threads and quick.cpu_threads == 1 and not full.pin_threads
    dp = [r for r in scaling.plan(quick, gpu, "quick") if r.config["method"] == scaling.DP]
    assert {r.threads for r in dp} == {1}
    dp = [r for r in scaling.plan(full, gpu, "full") if r.config["method"] == scaling.DP]
    assert {r.threads for r in dp} == {None}


def test_table2_flags_exposed_comm_within_its_noise():
    """(b) = 0.01 s/step x 16 steps = 0.16 s with a standard error of 0.006 s/step (0.096 s/epoch):
    2 x 0.096 >= 0.16, so (b), the overlap and hidden_percent are flagged; 0.002 s/step is not."""
    one = agg("DDP", 1, 32, 10.0, 32)
    rows = []
    for se in (0.006, 0.002):
        probe = {"exposed_per_step_seconds": 0.01, "allreduce_per_step_seconds": 0.5 / 16,
                 "noise_seconds": se}
        rec = agg("DDP", 2, 32, 6.0, 16, **probe_seconds(probe, 16))   # the worker's numbers
        rows.append(compute_vs_comm.comm_row(merged(rec), merged(one)))
    assert rows[0].exposed_noise_b_seconds == pytest.approx(0.096)
    df = compute_vs_comm.compute_vs_comm_frame(rows)
    assert list(df["noise_flag"]) == ["noise >= effect: not a result", ""]
    old = compute_vs_comm.compute_vs_comm_frame([compute_vs_comm.comm_row(
        merged(agg("DDP", 2, 32, 6.0, 16, exposed_comm_seconds=0.1, allreduce_seconds=0.5)), merged(one))])
    assert old.iloc[0]["noise_flag"] == "" and pd_missing(old.iloc[0]["exposed_noise_b_seconds"])


def test_per_step_growth_of_the_cohort_by_hand():
    """Issue 52 A1, the cohort's 2 x 32: t(1) = 41.30 s / 1,563 steps = 26.42 ms, t(2) = 23.15 s / 782 =
    29.60 ms: 3.18 ms more per step, x 782 steps = 2.487 s; (a) = 23.15 - 41.30/2 = 2.50 s, the rest
    (0.013 s) the last partial batch: (782 - 1563/2) x 26.42 ms. A cost paid by every step at N = 1 as at
    N = 2 is not in it."""
    from lab_utils.learn.speedup import per_step_growth

    g = per_step_growth(41.30, 1563, 23.15, 782, 2)
    assert g.t1_step_seconds == pytest.approx(0.026424, abs=1e-6)
    assert g.tn_step_seconds == pytest.approx(0.029604, abs=1e-6)
    assert g.growth_seconds == pytest.approx(0.003180, abs=1e-6)
    assert g.growth_per_epoch_seconds == pytest.approx(2.487, abs=1e-3)
    assert g.partial_batch_seconds == pytest.approx(0.5 * 0.026424, abs=1e-6)
    assert g.growth_per_epoch_seconds + g.partial_batch_seconds == pytest.approx(23.15 - 41.30 / 2)
    # a fixed cost c added to every step of both runs changes nothing of the growth or of (a)
    c = 0.010
    h = per_step_growth(41.30 + 1563 * c, 1563, 23.15 + 782 * c, 782, 2)
    assert h.growth_seconds == pytest.approx(g.growth_seconds)
    df = scaling_tables.per_step_growth_frame().set_index(["devices", "per_device_batch"])
    assert df.loc[(2, 32), "step_growth_ms"] == pytest.approx(3.180, abs=1e-3)
    assert df.loc[(2, 32), "comm_a_seconds"] == pytest.approx(2.50)
    assert df.loc[(2, 512), "efficiency"] > df.loc[(2, 128), "efficiency"] > df.loc[(2, 32), "efficiency"]
    here = scaling_tables.per_step_growth_frame([agg("DDP", 1, 32, 40.0, 16), agg("DDP", 2, 32, 24.0, 8)])
    mine = here.iloc[0]
    assert mine["devices"] == 2 and mine["step_growth_ms"] == pytest.approx(3000 - 2500)  # 24/8 - 40/16 s


# ------------------------------------------------------------------------ predict, then measure (issue 48)


def _line_p4():
    """A ring fit at P = 4 with alpha = 10 us, B = 10 GB/s: t(S) = 6 x 10 us + 1.5 S / 1e10."""
    from lab_utils.learn.alpha_beta import AlphaBetaFit

    return AlphaBetaFit(world_size=4, alpha_seconds=10e-6, bandwidth_bytes_per_s=10e9,
                        alpha_stderr_seconds=0.0, bandwidth_stderr_bytes_per_s=0.0, rms_relative_error=0.05,
                        max_relative_error=0.1, n_points=8)


def test_allreduce_line_and_the_two_predictions_by_hand():
    from lab_utils.learn.scaling_model import AllReduceLine, predicted_comm_seconds, predicted_epoch_seconds

    line = AllReduceLine.from_fit(_line_p4())
    assert line.ranks == 4 and line.latency_seconds == pytest.approx(60e-6)   # 2(P-1) alpha
    assert line.bandwidth_gb_per_s == pytest.approx(10 / 1.5)                 # 1 / slope, slope 1.5e-10 s/B
    assert line.seconds(44_695_848) == pytest.approx(_line_p4().predict_seconds(44_695_848))
    # 782 steps of 26.42 ms, each then waiting for 44,695,848 B at 60 us + 6.667 GB/s: 782 x 33.18 ms
    t = predicted_epoch_seconds(0.02642, 782, 44_695_848, 60e-6, 10 / 1.5)
    assert t == pytest.approx(782 * (0.02642 + 60e-6 + 44_695_848 * 1.5e-10))
    assert predicted_epoch_seconds(0.02642, 1563, 0, 0.0, 1.0) == pytest.approx(1563 * 0.02642)
    # buckets 1 MB and 3 MB at 100 us + 2 GB/s, 10 steps: (b) 10 x (100 us + 1.5 ms); (c) 10 x (200 us + 2 ms)
    b, c = predicted_comm_seconds([1e6, 3e6], 1e-4, 2.0, 10)
    assert b == pytest.approx(0.016) and c == pytest.approx(0.022)
    with pytest.raises(ValueError):
        predicted_comm_seconds([], 1e-4, 2.0, 10)


def test_prediction_cases_from_records():
    from lab_utils.experiments.n02_scaling import predict as scaling_predict
    from lab_utils.learn.scaling_model import AllReduceLine

    line = AllReduceLine(2, 1e-4, 2.0)
    one = agg("DDP", 1, 32, 40.0, 16, gradient_bytes=4_000_000, bucket_bytes=[3_000_000, 1_000_000])
    one.config["train_images"] = 512
    recs = [one, agg("DDP", 2, 32, 24.0, 8, gradient_bytes=4_000_000, bucket_bytes=[3_000_000, 1_000_000]),
            agg("DDP", 4, 32, 14.0, 4, gradient_bytes=4_000_000)]
    cases = scaling_predict.epoch_cases(recs, {2: line})
    assert cases.labels == ["2 x 32: no overlap", "2 x 32: last bucket only"]
    assert cases.measured == [24.0, 24.0]
    assert cases.cases[0] == {"t1_step_seconds": 2.5, "steps": 8, "latency_seconds": 1e-4,
                              "bandwidth_gb_per_s": 2.0, "exposed_bytes": 4_000_000}
    assert cases.cases[1]["exposed_bytes"] == 1_000_000   # the last bucket DDP all-reduces
    assert cases.skipped == ["4 x 32: no all-reduce fit at 4 ranks"] and "4 x 32" in cases.note()
    inputs, fits = scaling_predict.inputs_frames(recs, {2: line}, (1, 2, 4))
    row = inputs.iloc[0]
    assert row["t1_step_seconds"] == 2.5 and row["steps_2"] == 8 and row["steps_4"] == 4  # ceil(128/32)
    assert row["bucket_bytes"] == "3,000,000, 1,000,000" and list(fits["ranks"]) == [2]
    comm = agg("DDP", 2, 32, 24.0, 8, bucket_bytes=[3_000_000, 1_000_000], exposed_comm_seconds=0.5,
               allreduce_seconds=2.0)
    b_cases, c_cases = scaling_predict.comm_cases([comm], {2: line})
    assert b_cases.measured == [0.5] and c_cases.measured == [2.0] and b_cases.cases == c_cases.cases
    assert b_cases.cases[0]["bucket_bytes"] == [3_000_000, 1_000_000] and b_cases.cases[0]["steps"] == 8
    pair = one_output(lambda **k: (1.0, 2.0), 1)
    assert pair(x=1) == 2.0 and one_output(lambda **k: None, 0)(x=1) is None
    assert one_output(None, 0) is None


def test_the_cohorts_printed_speedups_and_its_slip():
    """SPEC.md: the report printed 1.86/1.88/1.94 and 3.54/3.64/3.76; 41.30/23.15 = 1.784 (issue 52 C6)."""
    from lab_utils.experiments.shared.anchors import FIRST_COHORT_PRINTED_SPEEDUPS as P

    assert [P[(2, b)] for b in (32, 128, 512)] == [1.86, 1.88, 1.94]
    assert [P[(4, b)] for b in (32, 128, 512)] == [3.54, 3.64, 3.76]
    df = scaling_tables.anchor_frame()
    first = df[df["method"] == FIRST_COHORT_LABEL].set_index(["gpus", "per_gpu_batch"])
    assert first.loc[(2, 32), "speedup"] == pytest.approx(1.784, abs=5e-4)
    # the others are the times' ratios cut (not rounded) to two decimals: 3.545 -> 3.54, 3.768 -> 3.76
    slips = [k for k in P if math.floor(100 * first.loc[k, "speedup"] + 1e-9) / 100 != P[k]]
    assert slips == [(2, 32)]


def test_allreduce_lines_fit_the_benchmark_records():
    """Timings of a ring with alpha = 10 us, B = 10 GB/s on 4 ranks give back its line (60 us, 6.67 GB/s);
    a rank count with too few sizes has none."""
    from lab_utils.experiments.n02_scaling import predict as scaling_predict
    from lab_utils.learn.ring import ring_allreduce_seconds

    def bench(p, size):
        t = ring_allreduce_seconds(size, p, 10e-6, 10e9)
        return Record("allreduce_bench", {"world_size": p, "size_bytes": size}, {"time_us": t * 1e6})

    recs = [bench(4, 8 << k) for k in range(0, 20, 3)] + [bench(2, 8), bench(2, 64)]
    lines = scaling_predict.allreduce_lines(recs)
    assert list(lines) == [4]
    assert lines[4].latency_seconds == pytest.approx(60e-6)
    assert lines[4].bandwidth_gb_per_s == pytest.approx(10 / 1.5)


def test_a_t_n_row_is_timed_against_the_one_device_run_of_its_method_batch_and_device_type():
    """One baseline lookup (experiments.rows.one_device_runs) for Table 1, Table 2 and notebook 04: a gloo
    CPU run's T(1) is the CPU one-device run's (40 s), not the GPU's (10 s) at the same batch. By hand:
    speedup 40 / 25 = 1.6, compute (a) = 40 / 2 = 20 s, comm (a) = 25 - 20 = 5 s."""
    def agg(devices, device_type, seconds):
        cfg = {"method": scaling.DDP, "devices": devices, "batch_size": 32, "device_type": device_type,
               "backend": "nccl" if device_type == "cuda" else "gloo", "record": "aggregate", "rank": None}
        return Record("scaling", cfg, {"train_seconds": seconds, "steps": 10})

    records = [agg(1, "cuda", 10.0), agg(1, "cpu", 40.0), agg(2, "cpu", 25.0)]
    ones = one_device_runs(records)
    assert ones[pair_key(records[2])] is records[1] and len(ones) == 2
    df = scaling_tables.scaling_frame(records)
    assert df["speedup"].tolist()[2] == pytest.approx(1.6)
    row = compute_vs_comm.comm_row(merged(records[2]), merged(ones.get(pair_key(records[2]))))
    assert (row.compute_a_seconds, row.comm_a_seconds) == pytest.approx((20.0, 5.0))


def test_table_2_and_table_1_take_their_ratios_and_step_times_from_named_functions():
    """By hand, T(1) = 40 s, T(N) = 25 s on 2 devices over 10 steps, (b) = 3 s exposed, (c) = 4 s in flight:
    compute_to_comm_a = 20 / 5 = 4; compute_to_comm_b = (25 - 3) / 3 = 7.33; hidden_percent = 100 x (4 - 3)
    / 4 = 25 %; Table 1's TN_seconds_per_step = 25 / 10 = 2.5 s; no ratio where comm (a) is not positive."""
    def agg(devices, seconds, **m):
        cfg = {"method": scaling.DDP, "devices": devices, "batch_size": 32, "device_type": "cpu",
               "backend": "gloo", "record": "aggregate", "rank": None}
        return Record("scaling", cfg, {"train_seconds": seconds, "steps": 10, **m})

    one = agg(1, 40.0)
    n = agg(2, 25.0, **probe_seconds({"exposed_per_step_seconds": 0.3, "allreduce_per_step_seconds": 0.4,
                                      "noise_seconds": 0.01}, 10))
    df = compute_vs_comm.compute_vs_comm_frame(compute_vs_comm.compute_vs_comm_rows(
        [one, n], profiles.settings(scaling.Settings, "quick", comm_devices=(2,))))
    got = df.iloc[0]
    assert got["compute_to_comm_a"] == pytest.approx(4.0)
    assert got["compute_to_comm_b"] == pytest.approx(22 / 3) and got["hidden_percent"] == pytest.approx(25.0)
    assert scaling_tables.scaling_frame([one, n])["TN_seconds_per_step"].tolist() == pytest.approx([4.0, 2.5])
    assert compute_to_comm(20.0, 0.0) is None and compute_to_comm(20.0, -1.0) is None
    assert hidden_percent(None) is None and per_step(Record("x", {}, {"train_seconds": 1.0})) is None
