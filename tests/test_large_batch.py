"""Notebook 05's package code: runs and their plan, set_epoch, tables/figures, communicated bytes."""

from __future__ import annotations

import math

import pytest
from store_helpers import lab_for, put

from lab_utils.app.grading.predict import one_output
from lab_utils.engine import profiles
from lab_utils.engine.machine import Machine
from lab_utils.engine.plan import aggregates, measure
from lab_utils.experiments.n02_scaling import ddp_worker as ddp
from lab_utils.experiments.n02_scaling.ddp_worker import RunConfig
from lab_utils.experiments.n05_large_batch import accounting_tables as at
from lab_utils.experiments.n05_large_batch import experiment as lb
from lab_utils.experiments.n05_large_batch import tables as lbt
from lab_utils.learn.errors import LabError, LaunchError
from lab_utils.learn.schedules import make_schedule


def _settings(profile: str = "quick", **overrides) -> lb.Settings:
    return profiles.settings(lb.Settings, profile, **overrides)

# --------------------------------------------------------------------------- set_epoch


def test_set_epoch_changes_the_order_and_without_it_epochs_repeat():
    with_it = lb.sampler_epoch_orders(dataset_size=16, num_replicas=2, rank=0, epochs=2, call_set_epoch=True)
    without = lb.sampler_epoch_orders(dataset_size=16, num_replicas=2, rank=0, epochs=2, call_set_epoch=False)
    assert with_it[0] != with_it[1]          # a new shuffle every epoch
    assert without[0] == without[1]          # the same order again
    assert without[0] == with_it[0]          # epoch 0 is the same either way (seed + 0)
    for orders in (with_it, without):
        assert all(len(o) == 8 for o in orders)


def test_ranks_split_each_epoch_without_overlap():
    for call in (True, False):
        r0 = lb.sampler_epoch_orders(16, 2, 0, 3, call)
        r1 = lb.sampler_epoch_orders(16, 2, 1, 3, call)
        for a, b in zip(r0, r1):
            assert set(a).isdisjoint(b) and set(a) | set(b) == set(range(16))


def test_set_epoch_table_has_a_row_per_case_and_epoch():
    t = lbt.set_epoch_table(dataset_size=12, num_replicas=3, epochs=2)
    assert len(t) == 4 and list(t.columns) == ["set_epoch called", "epoch", "rank 0 indices",
                                               "rank 1 indices", "rank 2 indices"]
    no = t[t["set_epoch called"] == "no"]
    assert no.iloc[0]["rank 1 indices"] == no.iloc[1]["rank 1 indices"]
    with pytest.raises(LabError, match="rank"):
        lb.sampler_epoch_orders(16, 2, rank=2)


# --------------------------------------------------------------------------- plan and settings

H100_NODE = Machine(gpus=4, gpu_name="NVIDIA H100 80GB HBM3", cores=64, bf16=True)
CPU = Machine(gpus=0, cores=2)


def test_plan_devices_uses_what_the_machine_has_and_says_so():
    full = _settings("full")
    assert lb.plan_devices(full, Machine(gpus=8, gpu_name="G")) == lb.DevicePlan(4, "nccl", "GPU", None)
    one = lb.plan_devices(full, Machine(gpus=1, gpu_name="G"))
    assert (one.large_devices, one.accumulation_steps) == (1, 4)
    assert "4 x 512 emulated with 1 device x 4 accumulation steps (global batch 2048" in one.note
    for gpus in (2, 3):  # 3 GPUs: 2 x 2 steps, the largest divisor of 4 that fits
        two = lb.plan_devices(full, Machine(gpus=gpus, gpu_name="G"))
        assert (two.large_devices, two.accumulation_steps, two.device) == (2, 2, "cuda")
        assert "4 x 512 emulated with 2 devices x 2 accumulation steps" in two.note
    cpu = lb.plan_devices(_settings("quick"), CPU)
    assert (cpu.large_devices, cpu.backend, cpu.accumulation_steps, cpu.device) == (2, "gloo", 2, "cpu")
    assert "gloo" in cpu.note and "4 x 32 emulated with 2 devices x 2 accumulation steps" in cpu.note
    runs = lb.plan(full, Machine(gpus=1, gpu_name="G"), "full")
    assert [r.config["global_batch"] for r in runs] == [128, 2048, 2048, 2048, 2048]
    assert [r.config.get("accumulation_steps", 1) for r in runs] == [1, 4, 4, 4, 4]


def test_the_plan_on_a_4_gpu_node_its_cost_and_the_doctors_settings():
    """Five DDP runs with NCCL: the reference alone, the four large-batch runs in one launch (group
    "large", 4x one run's time limit); the configs are the worker's RunConfig (the resume keys of
    earlier records); the budget's seconds by hand."""
    full = _settings("full")
    runs = lb.plan(full, H100_NODE, "full")
    assert [r.label for r in runs] == ["small batch (reference)", "large batch, same lr",
                                       "+ linear lr scaling", "+ warm-up", "+ warm-up + cosine decay"]
    assert [r.processes for r in runs] == [1, 4, 4, 4, 4] and {r.device for r in runs} == {"cuda"}
    assert [r.group for r in runs] == [None, "large", "large", "large", "large"]
    assert [r.timeout_s for r in runs] == [3600.0] + [4 * 3600.0] * 4
    assert all(not r.in_process and r.threads is None and r.worker is ddp for r in runs)
    assert [r.config["lr_rule"] for r in runs] == ["fixed", "fixed", "linear", "linear", "linear"]
    assert [r.config["warmup_epochs"] for r in runs] == [0, 0, 0, 2.0, 2.0]
    assert [r.config["decay"] for r in runs] == ["constant"] * 4 + ["cosine"]
    assert runs[3].config == {
        "method": "DDP", "record": "aggregate", "rank": None, "devices": 4, "backend": "nccl",
        "device_type": "cuda", "batch_size": 512, "global_batch": 2048, "epochs": 5, "width": 64,
        "train_images": 50_000, "test_images": 10_000, "dataset": "synthetic", "num_workers": 2, "lr": 0.1,
        "lr_rule": "linear", "base_batch": 128, "warmup_epochs": 2.0, "decay": "constant", "eval": True,
        "measure_comm": False, "comm_steps": None, "bucket_cap_mb": None, "seed": 0, "tag": "+ warm-up"}
    assert lbt.rule_text(RunConfig.from_config(runs[4].config)) == (
        "linear 0.1 x 2048/128, warm-up 2 ep from 0.1, cosine decay")
    [ledger] = lb.plan_accounting(full, H100_NODE, "full")
    assert (ledger.processes, ledger.device, ledger.config["backend"], ledger.options) == (
        4, "cuda", "nccl", {"backend": "nccl"})
    [cpu] = lb.plan_accounting(full, Machine(gpus=1, gpu_name="G"), "full")
    assert (cpu.processes, cpu.device, cpu.config["backend"]) == (2, "cpu", "gloo")  # NCCL cannot share a GPU
    # 5 epochs + 5 test passes: the first cohort's 1 x 128 epoch 33.64 s, 4 x 512 9.01 s (test passes a fifth
    # of an epoch at 128 per GPU: 33.64 and 9.23 s): 5 x 1.2 x 33.64 + 4 x 5 x (9.01 + 0.2 x 9.23)
    assert sum(lb.cost(r) for r in runs) == pytest.approx(5 * 1.2 * 33.64 + 20 * (9.01 + 0.2 * 9.23))
    assert lb.cost(ledger) == 40.0  # with its own launch: the 80 s the budget gave the ledger before
    small = lb.plan(lb.doctor_settings(full), H100_NODE, "full")
    assert {(r.config["epochs"], r.config["train_images"], r.config["test_images"]) for r in small} == {
        (1, 4096, 200)}


@pytest.mark.parametrize("overrides, match", [
    ({"decay": "constant"}, "cosine"),
    ({"warmup_epochs": 9}, "warmup_epochs"),
    ({"small_batch": 0}, "small batch"),
    ({"large_batch_per_device": 8, "devices": 2, "small_batch": 32}, "must exceed"),
    ({"train_images": 100}, "less than one large global batch"),
    ({"colour": "red"}, "Unknown large-batch setting"),
])
def test_bad_settings_are_refused_before_any_work(overrides, match):
    with pytest.raises(LabError, match=match):
        _settings("quick", **overrides).validate()


def test_quick_settings_stay_small():
    s = _settings("quick")
    assert s.width <= 16 and s.train_images <= 4096
    full = _settings("full")
    # the same rule in both profiles: global batch = per-device batch x 4, 16x the reference batch
    assert s.devices == full.devices == 4
    assert s.large_batch_per_device * s.devices == 16 * s.small_batch
    assert (full.epochs, full.small_batch, full.large_batch_per_device, full.devices, full.width) == (
        5, 128, 512, 4, 64)
    assert full.train_images is None and full.lr == 0.1


# --------------------------------------------------------------------------- tables and figures


def _history(accs, seconds=2.0):
    return [{"epoch": i + 1, "test_accuracy": a, "test_loss": 2 - a, "train_loss": 2.2 - a,
             "epoch_seconds": seconds + (1.0 if i == 0 else 0.0), "elapsed_seconds": (i + 1) * seconds}
            for i, a in enumerate(accs)]


def _fake_result(store, failed: bool = False):
    """Records shaped like the DDP worker's aggregate records (test input, not results): (records,
    settings, plan, runs)."""
    s = _settings("quick", epochs=3)
    plan = lb.plan_devices(s, CPU)
    runs = lb.plan(s, CPU, "quick")
    recs = []
    for i, run in enumerate(runs):
        if failed and i == 1:
            recs.append(put(store, lb.EXPERIMENT, run.config, {}, status="error", reason="rank 1 died",
                            synthetic=True))
            continue
        hist = _history([0.2 + 0.1 * i, 0.3 + 0.1 * i, 0.4 + 0.1 * i])
        metrics = {**hist[-1], "epochs": hist, "reported_epoch": 3, "peak_lr": 0.1,
                   "steps_per_epoch": s.train_images // run.config["global_batch"]}
        recs.append(put(store, lb.EXPERIMENT, run.config, metrics, synthetic=True, dataset="synthetic"))
    return recs, s, plan, runs


def test_table_rows_and_columns(store):
    recs, s, plan, runs = _fake_result(store, failed=True)
    t = lbt.large_batch_table(recs, s)
    assert list(t["configuration"]) == [r.label for r in runs]
    assert list(t["global batch"]) == [8, 128, 128, 128, 128]
    assert t.loc[0, "epoch-3 test accuracy %"] == pytest.approx(40.0)
    assert t.loc[0, "epoch time s"] == pytest.approx(2.0)  # epoch 3's (the record's)
    assert t.loc[0, "peak lr"] == 0.1 and math.isnan(t.loc[1, "peak lr"])  # the record's; none if it failed
    assert t.loc[0, "optimizer steps"] == 3 * 1536 // 8
    assert t.loc[1, "status"] == "error: rank 1 died"
    lbt.save_large_batch_table(store, recs, s, plan)
    text = (store.tables_dir / "large_batch.md").read_text()
    assert "large batch, same lr" in text and "SYNTHETIC" in text and "gloo" in text


def test_figures_are_saved(store):
    recs, s, plan, runs = _fake_result(store)
    import matplotlib.pyplot as plt

    plt.close("all")  # figures other tests left open are not this test's business
    paths = lbt.save_figures(store, recs, s, plan)
    assert [p.name for p in paths] == ["large_batch_accuracy_epoch.png", "large_batch_accuracy_time.png",
                                       "large_batch_lr.png"]
    assert all(p.stat().st_size > 0 for p in paths) and not plt.get_fignums()
    assert len(lbt.plot_accuracy(recs, s, "time", plan).axes) == 2  # test accuracy and training loss
    plt.close("all")
    with pytest.raises(LabError, match="epoch"):
        lbt.plot_accuracy(recs, s, "steps")
    curves = lbt.lr_curves(recs, s)
    warm = curves[runs[3].label]
    # quick: reference lr 0.00625 at batch 8, linear rule x 128/8 = 0.1, 12 steps per epoch, warm-up
    # over half an epoch (6 steps)
    assert warm[0] == pytest.approx(0.00625) and max(warm) == pytest.approx(0.1)
    assert warm[3] == pytest.approx(0.00625 + (0.1 - 0.00625) * 3 / 6)  # half-way through the warm-up
    assert warm[5] < 0.1 and warm[6] == pytest.approx(0.1)  # the peak from step 6 on
    assert len(curves[runs[0].label]) == 3 * 192 and len(warm) == 3 * 12


def test_worker_sample_orders_reads_rank_records(store):
    cfg = {"record": "aggregate", "rank": None, "tag": "x"}
    agg = put(store, lb.EXPERIMENT, cfg, {})
    put(store, lb.EXPERIMENT, {**cfg, "record": "rank", "rank": 1},
              {"epochs": [{"epoch": 1, "sample_order_head": [3, 1]},
                          {"epoch": 2, "sample_order_head": [0, 2]}]})
    rows = lbt.worker_sample_orders([agg, *store.latest(lb.EXPERIMENT)], agg)
    assert rows == [{"rank": 1, "epoch": 1, "first indices": "3 1"},
                    {"rank": 1, "epoch": 2, "first indices": "0 2"}]


# --------------------------------------------------------------------------- communication accounting


def test_model_bytes_by_hand():
    import torch

    from lab_utils.experiments.n05_large_batch.accounting_worker import model_bytes, tensor_bytes

    m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    b = model_bytes(m)
    # Linear: 3*2 + 2 = 8 fp32; BN: weight 2 + bias 2 = 4 fp32 -> 12 x 4 = 48 bytes
    # buffers: running_mean 2 + running_var 2 fp32 = 16 bytes, num_batches_tracked 1 int64 = 8 bytes
    assert (b.parameters, b.parameter_bytes, b.buffer_bytes, b.floating_buffer_bytes, b.buffers) == (
        12, 48, 24, 16, 3)
    assert tensor_bytes(torch.zeros(5, dtype=torch.float16)) == 10


def test_ledger_counts_by_phase_and_mutes():
    from lab_utils.experiments.n05_large_batch.accounting_worker import CommLedger

    led = CommLedger()
    with led.in_phase("step"):
        led.add("all_reduce", 100)
        led.add("all_reduce", 100)
        with led.mute():
            led.add("all_reduce", 999)
        led.add("broadcast", 8, src=1)
    counted = {(r["phase"], r["kind"]): (r["bytes"], r["calls"]) for r in led.as_rows()}
    assert counted == {("step", "all_reduce"): (200, 2), ("step", "broadcast"): (8, 1)}  # nothing elsewhere
    assert led.as_rows()[1]["bytes_by_src"] == {1: 8}


@pytest.mark.slow
def test_accounting_on_a_real_two_rank_gloo_run_equals_the_model_sizes(store):
    """Launch 2 gloo ranks: every payload equals the parameter/buffer bytes of the model."""
    from lab_utils.learn.models import ResNet18

    s = _settings("quick", comm_width=2, comm_batch=4, comm_steps=2)
    [rec] = measure(lab_for(store), lb.COMM_ACCOUNTING_EXPERIMENT, s, verbose=False, machine=CPU)
    assert rec.status == "ok" and rec.config["devices"] == 2 and rec.config["backend"] == "gloo"
    model = ResNet18(width=2)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    items = {it.what: it for it in at.comm_items(rec)}
    assert items["initial parameter + buffer broadcast"].payload_bytes == params + buffers
    assert items["BatchNorm buffers (broadcast_buffers=True)"].payload_bytes == buffers
    assert items["gradients"].payload_bytes == params
    assert items["ZeRO-1: gradients (still all of them)"].payload_bytes == params
    shards = [w for w in items if w.startswith("ZeRO-1: updated parameter shards")]
    assert items[shards[0]].payload_bytes == params
    checks = at.accounting_checks(rec)
    assert len(checks) >= 2 * 7 and all(checks.values())
    ranks = rec.metrics["ranks"]
    assert all(g["parameters_equal_after_init"] for g in ranks)
    # ZeRO-1 halves the momentum each rank holds (two ranks), plain SGD holds all of it
    assert [g["sgd_state_bytes"] for g in ranks] == [params, params]
    assert sum(g["zero_state_bytes"] for g in ranks) == params
    # the table and the wire cross-check (gloo): a training step writes at least the payload
    table = at.comm_table(rec)
    assert set(table["equal"]) <= {"yes", ""} and len(table) == len(items)
    wire = at.wire_table(rec)
    if wire is not None:
        step = wire[wire["phase"].str.startswith("one training step")].iloc[0]
        assert step["rank 1 wrote (bytes)"] >= params  # ring all-reduce, P=2: 2(P-1)/P x S = S per rank
        # the worker's expectation: the payload all-reduced (2(P-1)/P = 1) plus the buffers rank 0 sends
        assert step["rank 0 expected (bytes)"] == params + buffers + 4 and step["rank 1 expected (bytes)"] \
            == params + 4
    # stored: a second call reads the store instead of launching
    [again] = measure(lab_for(store), lb.COMM_ACCOUNTING_EXPERIMENT, s, verbose=False, machine=CPU)
    assert again.timestamp == rec.timestamp


def test_the_wire_summary_by_hand():
    """Per phase and occurrence: payload counted, bytes written (mean), and what 2 ranks should write."""
    from lab_utils.experiments.n05_large_batch.accounting_worker import wire_summary

    ledger = [{"phase": "step", "kind": "gradient_bucket_all_reduce", "bytes": 3000, "bytes_by_src": {}},
              {"phase": "loss_logging", "kind": "all_reduce", "bytes": 12, "bytes_by_src": {}},
              {"phase": "step", "kind": "broadcast_coalesced", "bytes": 300, "bytes_by_src": {0: 300}}]
    wire = {"step:1": [1500], "step:2": [1600], "step:3": [1700]}
    assert wire_summary(ledger, wire, 0, 2) == {"step": {"occurrences": 3, "payload_bytes": 1104.0,
                                                         "written_bytes": 1600.0,
                                                         "expected_written_bytes": 1104.0}}
    assert wire_summary(ledger, wire, 1, 2)["step"]["expected_written_bytes"] == 1004.0  # not a root
    assert wire_summary(ledger, wire, 1, 4)["step"]["expected_written_bytes"] is None


# --------------------------------------------------------------------------- orchestration


def test_a_failed_launch_is_error_rows_the_other_launch_goes_on_and_it_is_retried(store, monkeypatch):
    """Two launches: the reference's, then the four large runs'. Each fails here: the run it was on is a
    stored error row; the three after it in the large launch are not stored; all five are tried again
    next time."""
    from lab_utils.engine import launcher

    calls = []

    def failing_launch(module, job, nproc, **kw):
        calls.append((module, nproc, len(job["configs"])))
        raise LaunchError("The 2-process run of lab_utils.experiments.n02_scaling.ddp_worker failed "
                          "(torchrun exit code 1).\n"
                          "last log lines")
        yield

    monkeypatch.setattr(launcher, "stream", failing_launch)
    tiny = {"epochs": 1, "width": 2, "train_images": 64, "test_images": 20, "small_batch": 8,
            "large_batch_per_device": 16}
    s = _settings("quick", **tiny)
    with pytest.raises(LaunchError, match="2 run\\(s\\) of large_batch failed"):
        measure(lab_for(store), lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=CPU)
    assert calls == [("lab_utils.experiments.n02_scaling.ddp_worker", 1, 1),
                     ("lab_utils.experiments.n02_scaling.ddp_worker", 2, 4)]
    recs = store.latest(lb.EXPERIMENT)
    assert [r.status for r in recs] == ["error"] * 2
    assert [r.config["tag"] for r in recs] == ["small batch (reference)", "large batch, same lr"]
    assert recs[1].reason.startswith("The 2-process run") and "\n" not in recs[1].reason
    t = lbt.large_batch_table(recs, s)
    assert all(x.startswith("error: ") for x in t["status"])
    with pytest.raises(LaunchError):  # error rows are not final: tried again, the "not run" ones too
        measure(lab_for(store), lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=CPU)
    assert calls[2:] == calls[:2]


@pytest.mark.slow
def test_tiny_real_runs_are_stored_and_resumed(store, monkeypatch, tmp_path):
    """Five tiny DDP runs (1 and 2 gloo ranks): records found under the worker's config, then resumed.

    The store is built on another folder than $LAB_RESULTS_DIR names (as a script may build one):
    every record lands in it (the workers hand them back; the parent stores them), none in the
    default folder (issue 26: the workers used to write there, and the parent found nothing)."""
    from lab_utils.engine.store import ResultStore

    default = store
    store = ResultStore("quick", root=tmp_path / "elsewhere" / "quick")
    lab = lab_for(store)
    tiny = {"epochs": 2, "width": 2, "train_images": 64, "test_images": 20, "small_batch": 8,
            "large_batch_per_device": 8, "warmup_epochs": 1.0}
    s = _settings("quick", **tiny)
    out = measure(lab, lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=CPU)
    recs = aggregates(out)
    assert len(out) == len(store.latest(lb.EXPERIMENT)) == 5 + 1 + 4 * 2
    assert default.records(lb.EXPERIMENT) == []
    assert [r.status for r in recs] == ["ok"] * 5, [r.reason for r in recs]
    # quick: 4 x 8 emulated with 2 gloo processes x 2 accumulation steps
    assert [r.config["global_batch"] for r in recs] == [8, 32, 32, 32, 32]
    assert [r.config.get("accumulation_steps", 1) for r in recs] == [1, 2, 2, 2, 2]
    assert [r.metrics["accumulation_steps"] for r in recs] == [1, 2, 2, 2, 2]
    assert recs[1].metrics["accumulation_note"].startswith("4 x 8 emulated with 2 devices x 2")
    # quick's reference lr 0.00625 at batch 8; linear rule x 32/8 = 0.025
    peaks = [r.metrics["peak_lr"] for r in recs]
    assert peaks == pytest.approx([0.00625, 0.00625, 0.025, 0.025, 0.025])
    for rec in recs:
        run = RunConfig.from_config(rec.config)
        assert len(rec.metrics["epochs"]) == 2
        steps = rec.metrics["steps_per_epoch"]
        batches = math.ceil(64 / run.devices / run.batch_size)
        assert steps == math.ceil(batches / run.accumulation_steps)
        # the worker's lr per epoch is the schedule's (warm-up over epoch 1 for the remedies)
        sched = make_schedule(s.lr, run.lr_rule, run.global_batch, s.small_batch, steps, s.epochs,
                              run.warmup_epochs, run.decay)
        last_lrs = [e["lr"] for e in rec.metrics["epochs"]]
        assert last_lrs == pytest.approx([sched.lr_at(steps - 1), sched.lr_at(2 * steps - 1)])
    orders = lbt.worker_sample_orders(out, recs[1])
    assert {o["rank"] for o in orders} == {0, 1} and len(orders) == 4
    r0 = [o["first indices"] for o in orders if o["rank"] == 0]
    assert r0[0] != r0[1]  # the worker calls set_epoch: a new order every epoch

    from lab_utils.engine import launcher

    def no_launch(*a, **kw):
        raise AssertionError("a stored run was launched again")

    monkeypatch.setattr(launcher, "stream", no_launch)
    again = measure(lab, lb.LARGE_BATCH_EXPERIMENT, s, verbose=False, machine=CPU)
    assert [r.timestamp for r in again] == [r.timestamp for r in out]


# ----------------------------------------------------------------- issue 18: Q4.1 comparable numbers


def test_q41_table_shows_train_and_test_accuracy_and_flags_layouts(store):
    """Train accuracy next to test accuracy (the earlier cohort reported only "Accuracy", without
    saying which); every run that is not 4 GPUs x 512 (reference: 1 GPU x 128) says how it differs."""
    recs, s, plan, runs = _fake_result(store)
    recs[1].metrics["train_accuracy"] = 0.634
    t = lbt.large_batch_table(recs, s)
    assert t.loc[1, "epoch-3 train accuracy %"] == pytest.approx(63.4)
    assert t.loc[1, "epoch-3 test accuracy %"] == pytest.approx(50.0)
    # quick on a CPU: 2 gloo processes x 2 accumulation steps x 32 = 128
    assert t.loc[1, "vs assignment"] == (
        "NOT 4 x 512: global batch 128, not 2048; 32 per device, not 512; 2 device(s) x 2 accumulation steps "
        "EMULATE 4 devices; CPU processes, not GPUs")
    assert t.loc[0, "vs assignment"].startswith("NOT 1 x 128: global batch 8, not 128")
    # the assignment's layouts on GPUs are not flagged; an emulation with the right batch still is
    def run(n, b, acc=1, tag="large batch, same lr"):
        return RunConfig(devices=n, backend="nccl", batch_size=b, accumulation_steps=acc, tag=tag)

    assert lbt.layout_flag(run(4, 512), True) == ""
    assert lbt.layout_flag(run(1, 128, tag="small batch (reference)"), True) == ""
    assert lbt.layout_flag(run(2, 512, 2), True) == (
        "NOT 4 x 512: 2 device(s) x 2 accumulation steps EMULATE 4 devices")
    fewer = run(2, 512)
    assert lbt.layout_flag(fewer, True) == "NOT 4 x 512: global batch 1024, not 2048; 2 device(s), not 4"
    anchors = lbt.anchor_frame()
    assert list(anchors["'Accuracy' % (as reported)"]) == [82.2, 63.4]
    assert list(anchors["loss (as reported)"]) == [0.514, 1.016]
    assert list(anchors["global batch"]) == [128, 2048]
    assert not any("train" in c.lower() or "test" in c.lower() for c in anchors.columns if "which" not in c)
    assert set(anchors["which set"]) == {"not stated in the report ('Accuracy')"}
    assert "'Accuracy' 63.4%" in lbt.ANCHORS
    assert "does not say whether these are training or test" in lbt.ANCHORS
    assert "TRAINING" not in lbt.ANCHORS and "train accuracy" not in lbt.ANCHORS


def test_recipe_cases_are_the_linear_runs_and_what_they_used(store):
    """Exercise 05-b's table: one case per run with the linear rule (the three remedies), its layout as
    asked (quick: 2 gloo ranks x 2 accumulation steps = 4 devices of 32), and its record's peak lr and
    warm-up steps; ``output`` picks one of a prediction's outputs, None staying None."""
    from lab_utils.learn.schedules import linear_scaling_recipe

    recs, s, plan, runs = _fake_result(store)
    for r in recs:
        r.metrics["warmup_steps"] = 6 if r.config["warmup_epochs"] else 0
    cases, used, labels = lbt.recipe_cases(recs)
    assert labels == [r.label for r in runs[2:]]
    assert cases[0] == {"base_lr": 0.00625, "base_batch": 8, "per_device_batch": 32, "devices": 4,
                        "dataset_size": 1536, "warmup_epochs": 0.0}
    assert [c["warmup_epochs"] for c in cases] == [0.0, 0.5, 0.5] and used == [(0.1, 0), (0.1, 6), (0.1, 6)]
    assert [linear_scaling_recipe(**c) for c in cases] == [(pytest.approx(0.1), w) for w in (0, 6, 6)]
    steps = one_output(linear_scaling_recipe, 1)
    assert [steps(**c) for c in cases] == [0, 6, 6]
    assert one_output(None, 0) is None and one_output(lambda **kw: None, 0)(**cases[0]) is None

