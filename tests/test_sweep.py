"""Notebook 01's batch-size sweep: its plan, the OOM rule, resume, table rows, FLOP rate, input checks.

The sweeps here are real (a width-2 ResNet-18 on a few hundred synthetic images, on CPU, in this
process as the plan runs them on a CPU) through ``lab_utils.engine.plan.measure``, as the notebook calls it;
the worker's ``run_epoch`` is wrapped by a spy that counts the calls and then runs the real one. The
out-of-memory row comes from the sweep's CPU memory cap (``CpuMemoryCap``), whose limit is derived
from the measured activation bytes of a small batch, and in one test from the CPU allocator itself
refusing a real allocation.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from store_helpers import lab_for
from torch import nn

from lab_utils.engine import profiles
from lab_utils.engine.hardware import peak_flops_per_s
from lab_utils.engine.harness import Job
from lab_utils.engine.machine import BUDGET_NODE, Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.engine.store import Record
from lab_utils.experiments.n01_batch_sweep import experiment as sweep
from lab_utils.experiments.n01_batch_sweep import tables as sweep_tables
from lab_utils.experiments.n01_batch_sweep import worker
from lab_utils.learn.errors import LabError
from lab_utils.learn.models import ResNet18

WIDTH = 2
SIZES = (8, 32, 128, 160)
TRAIN_IMAGES = 160  # 160 is never tried: the OOM at 128 ends the group first
TEST_IMAGES = 40
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Width-2 models gain nothing from threads; one thread avoids OpenMP stalls on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def cached_loaders():
    """Build the synthetic data set once for the module (its construction takes seconds)."""
    real = worker.make_loaders
    cache: dict = {}

    def make(**kw):
        key = tuple(sorted(kw.items()))
        if key not in cache:
            cache[key] = real(**kw)
        return cache[key]

    return make


class Spy:
    """Wraps ``run_epoch``: counts calls per batch size, keeps weak references to the
    models, and can inject a failure for a batch size before running the real epoch."""

    def __init__(self, real):
        self.real = real
        self.calls: list[int] = []
        self.fail: dict[int, object] = {}
        self.models: list = []

    def __call__(self, model, loader, *args, **kw):
        bs = loader.batch_size
        self.calls.append(bs)
        self.models.append(weakref.ref(model))
        if bs in self.fail:
            self.fail[bs]()
        return self.real(model, loader, *args, **kw)


def _install_spy(mp: pytest.MonkeyPatch, cached_loaders) -> Spy:
    mp.setattr(worker, "make_loaders", cached_loaders)
    spy = Spy(worker.run_epoch)
    mp.setattr(worker, "run_epoch", spy)
    return spy


@pytest.fixture
def spy(monkeypatch, cached_loaders):
    return _install_spy(monkeypatch, cached_loaders)


@pytest.fixture(scope="module")
def oom_sweep(tmp_path_factory, cached_loaders):
    """One standard sweep (ok, ok, oom, not tried), shared by the tests that only read it."""
    from lab_utils.engine.store import ResultStore

    with pytest.MonkeyPatch.context() as mp:
        store = ResultStore("quick", root=tmp_path_factory.mktemp("oom_sweep") / "quick")
        spy = _install_spy(mp, cached_loaders)
        result = small_sweep(store)
    return store, spy, result


def activation_bytes_per_image(width: int = WIDTH, batch: int = 8) -> float:
    """Measured bytes autograd saves per image (through the cap's own accounting, no limit)."""
    model = ResNet18(width=width)
    cap = worker.CpuMemoryCap(model, 10**15, batch)
    with cap:
        model(torch.randn(batch, 3, 32, 32)).sum().backward()
    return (cap.peak_step_bytes - cap.base_bytes) / batch


def cap_between(fits: int, fails: int) -> int:
    """A cap that holds batch ``fits`` but not batch ``fails`` (model state + activations)."""
    state = worker.model_state_bytes(ResNet18(width=WIDTH))
    per_image = activation_bytes_per_image()
    return int(state + per_image * (fits + fails) / 2)


def settings(**kw) -> sweep.Settings:
    """The quick profile's settings with the small sweep's overrides (the parameters cell's way)."""
    args = dict(batch_sizes=SIZES, width=WIDTH, train_images=TRAIN_IMAGES, test_images=TEST_IMAGES,
                memory_cap_bytes=cap_between(32, 128), dataset="synthetic")
    return profiles.settings(sweep.Settings, "quick", **{**args, **kw})


def small_sweep(store, force=False, **kw):
    """A sweep through notebook 01's door: ``measure(lab, SWEEP_EXPERIMENT, settings)``."""
    return measure(lab_for(store), sweep.SWEEP_EXPERIMENT, settings(**kw), force=force, verbose=False)


def ok(records):
    return [r for r in records if r.status == "ok"]


def test_sweep_stops_growing_after_oom_and_frees_the_model(oom_sweep):
    store, spy, result = oom_sweep
    statuses = [r.status for r in result]
    assert statuses == ["ok", "ok", "oom", "skipped"]
    # 2 epochs at 8 and 32, then batch 128 fails in its first epoch; 160 is never tried.
    assert spy.calls == [8, 8, 32, 32, 128]
    oom = result[2]
    assert oom.reason.startswith("OOM:") and "memory cap" in oom.reason
    assert result[3].reason == "not tried: batch 128 already ran out of memory"
    assert sweep_tables.largest_fitting_batch(result) == 32
    # The OOM row is stored (a measurement); the skipped row is not (it follows from it).
    stored = {r.config["batch_size"]: r.status for r in store.latest("batch_sweep")}
    assert stored == {8: "ok", 32: "ok", 128: "oom"}
    # Every model, including the one that ran out of memory mid-forward, has been freed.
    assert all(ref() is None for ref in spy.models)
    # Measured rows carry the real training result, every derived number computed in the worker.
    flops = sweep.flops_per_image(WIDTH).train_flops
    for r in ok(result):
        m = r.metrics
        assert m["images"] == TRAIN_IMAGES and m["steps"] == -(-TRAIN_IMAGES // r.config["batch_size"])
        assert m["train_seconds"] > 0 and m["images_per_s"] == pytest.approx(m["images"] / m["train_seconds"])
        assert m["ms_per_step"] == pytest.approx(1000 * m["train_seconds"] / m["steps"])
        assert m["train_tflops_per_s"] == pytest.approx(flops * m["images_per_s"] / 1e12)
        assert m["percent_of_peak"] is None and m["peak_precision"] == "fp32"  # a CPU has no peak
        assert m["peak_memory_bytes"] is None  # not tracked on CPU
        assert m["cpu_cap_peak_step_bytes"] <= r.config["memory_cap_bytes"]
        assert 0 <= m["test_accuracy"] <= 1 and m["loss"] > 0
    assert result[0].synthetic is True


def test_real_cpu_allocator_oom_is_caught_and_other_errors_are_not(store, spy):
    def huge_allocation():
        torch.empty(1 << 62, dtype=torch.uint8)  # the CPU allocator refuses: a real failed allocation

    spy.fail[32] = huge_allocation
    result = small_sweep(store, memory_cap_bytes=0)  # 0: no cap, so only the allocator can fail
    assert [r.status for r in result] == ["ok", "oom", "skipped", "skipped"]
    assert "can't allocate memory" in result[1].reason
    assert spy.calls == [8, 8, 32]

    def boom():
        raise RuntimeError("a bug, not a memory problem")

    spy.fail[8] = boom
    with pytest.raises(RuntimeError, match="a bug"):
        small_sweep(store, memory_cap_bytes=0, batch_sizes=(8,), force=True)


def test_resume_measures_nothing_new(store, spy):
    first = small_sweep(store, batch_sizes=(8, 32))
    assert len(spy.calls) == 4 and len(store.records("batch_sweep")) == 2
    again = small_sweep(store, batch_sizes=(8, 32))
    assert len(spy.calls) == 4 and len(store.records("batch_sweep")) == 2  # no run_epoch call, nothing stored
    assert [r.metrics for r in again] == [r.metrics for r in first]
    # A stored OOM also stops the resumed sweep without training.
    small_sweep(store, batch_sizes=(8, 32, 128))
    assert spy.calls[4:] == [128]
    resumed = small_sweep(store, batch_sizes=SIZES)
    assert spy.calls[4:] == [128]
    assert [r.status for r in resumed] == ["ok", "ok", "oom", "skipped"]
    # force re-measures.
    small_sweep(store, batch_sizes=(8,), force=True)
    assert spy.calls[-2:] == [8, 8]


def test_the_plan_launches_one_gpu_group_and_runs_in_process_on_a_cpu():
    """Placement, one group (one launch, the out-of-memory rule), the keys of the records stored
    before the plan existed, the CPU's thread pin, and the skip of a batch larger than the data."""
    gpu = make_plan(sweep.SWEEP_EXPERIMENT, profiles.settings(sweep.Settings, "full"),
                    Machine(gpus=1, gpu_name=H100, cores=16, bf16=True), "full")
    assert [r.config["batch_size"] for r in gpu] == [32, 128, 512, 2048, 8192, 32768]
    for r in gpu:
        assert (r.worker, r.device, r.processes, r.in_process) == (worker, "cuda", 1, False)
        assert r.group == "batch_sweep"
        assert r.options["process_group"] is False and r.threads is None and r.skip is None
        assert set(r.config) == {"model", "width", "batch_size", "lr", "epochs", "reported_epoch",
                                 "train_images", "test_images", "dataset", "device", "num_workers",
                                 "memory_cap_bytes", "memory_fraction", "cudnn_benchmark", "metrics_version"}
        assert r.config["device"] == H100 and r.config["train_images"] == 50_000 and r.config["lr"] == 0.1
    cpu = make_plan(sweep.SWEEP_EXPERIMENT, settings(), Machine(gpus=0, cores=2), "quick")
    assert all(r.in_process and r.device == "cpu" and r.threads == 1 and r.config["cpu_threads"] == 1
               for r in cpu)
    big = make_plan(sweep.SWEEP_EXPERIMENT, settings(batch_sizes=(8, 256)), Machine(gpus=0, cores=2), "quick")
    assert big[1].skip == "larger than the 160 training images: not a batch size of this data"


def test_cost_and_doctor_settings_on_the_budget_node():
    """Seconds by hand: 2 epochs x the earlier cohort's 1-GPU epoch (41.3 s at 32, 33.64 s at 128, the
    512 time above it); doctor's run is the smallest batch, one epoch of two steps."""
    full = profiles.settings(sweep.Settings, "full")
    runs = make_plan(sweep.SWEEP_EXPERIMENT, full, BUDGET_NODE, "full")
    assert [sweep.cost(r) for r in runs[:3]] == pytest.approx([82.6, 67.28, 67.9])
    doc = make_plan(sweep.SWEEP_EXPERIMENT, sweep.doctor_settings(full), BUDGET_NODE, "full")
    assert [(r.config["batch_size"], r.config["epochs"], r.config["train_images"]) for r in doc] == [
        (32, 1, 64)]


def test_the_worker_computes_percent_of_peak_on_a_known_gpu(cached_loaders, monkeypatch):
    """The record's % of peak, by hand: FLOPs per image x images/s over the H100's dense TF32 peak."""
    monkeypatch.setattr(worker, "make_loaders", cached_loaders)
    cfg = make_plan(sweep.SWEEP_EXPERIMENT, settings(batch_sizes=(32,), memory_cap_bytes=0),
                    Machine(gpus=0, cores=2), "quick")[0].config
    job = Job("batch_sweep", "quick", [cfg])
    ctx = SimpleNamespace(device=torch.device("cpu"), hardware=lambda: {"device_name": H100})
    [rec] = worker.run_config(cfg, job, ctx, worker.prepare(job, ctx))
    m = rec.metrics
    assert m["peak_precision"] == "tf32"  # cuDNN may use TF32 for fp32 convolutions
    achieved = sweep.flops_per_image(WIDTH).train_flops * m["images_per_s"]
    assert m["percent_of_peak"] == pytest.approx(100 * achieved / peak_flops_per_s(H100, "tf32"))


def test_table_has_one_row_per_batch_size(oom_sweep):
    store, _, result = oom_sweep
    table = sweep_tables.save_tables(store, result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES, TEST_IMAGES))
    assert list(table["batch size"]) == list(SIZES)
    assert list(table["status"]) == ["ok", "ok", "oom", "skipped"]
    assert list(table["peak memory (GiB)"][:2]) == ["not tracked on CPU"] * 2
    assert table["epoch-2 training (s)"][2] is None and table["reason"][2].startswith("OOM")
    md = (store.tables_dir / "batch_sweep.md").read_text()
    assert "profile: quick" in md and "SYNTHETIC" in md and "| oom" in md
    csv = (store.tables_dir / "batch_sweep.csv").read_text().strip().splitlines()
    assert len(csv) == 1 + len(SIZES)
    phases = sweep_tables.phase_table(result)
    assert list(phases["ms per step"]) == [r.metrics["ms_per_step"] for r in ok(result)]  # selected
    assert len((store.tables_dir / "batch_sweep_phases.csv").read_text().strip().splitlines()) == 1 + 2
    fig = sweep_tables.plot_sweep(result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES, TEST_IMAGES))
    assert store.save_figure(fig, "batch_sweep", result).exists()


def test_flop_table_selects_the_records_rate_and_has_no_percentage_on_a_cpu(oom_sweep):
    store, _, result = oom_sweep
    table, why = sweep_tables.save_flop_table(store, result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES,
                                                                            TEST_IMAGES))
    assert list(table["achieved TFLOP/s"]) == [r.metrics["train_tflops_per_s"] for r in ok(result)]
    assert list(table["% of peak"]) == [None, None]
    assert "No % of peak" in why
    gpu = [replace(r, hardware={**r.hardware, "device_name": H100},
                   metrics={**r.metrics, "peak_precision": "tf32", "percent_of_peak": 1.5})
           for r in ok(result)]
    t = sweep_tables.flop_table(gpu)
    assert list(t["% of peak"]) == [1.5, 1.5] and list(t["peak TFLOP/s (tf32)"]) == [
        peak_flops_per_s(H100, "tf32") / 1e12] * 2


def test_resnet18_forward_flops_per_image_match_the_published_count():
    f = sweep.flops_per_image(64)
    assert f.forward_flops == pytest.approx(2 * 0.556e9, rel=0.02)
    # backward = weight grads + input grads (none for the image itself): just under 2x forward
    assert 2.9 < f.train_flops / f.forward_flops < 3.0


def test_memory_cap_counts_model_state_and_activations_by_hand():
    lin = nn.Linear(10, 5)  # 55 fp32 parameters: params + grads + momentum = 3 * 55 * 4 bytes
    assert worker.model_state_bytes(lin) == 3 * 55 * 4
    model = nn.Sequential(nn.Linear(10, 5), nn.ReLU())
    x = torch.randn(8, 10)
    cap = worker.CpuMemoryCap(model, 10**9, 8)
    with cap:
        model(x).sum().backward()
    # saved for backward: the input (8x10) for the weight grad and the ReLU output (8x5)
    assert cap.peak_step_bytes - cap.base_bytes == (8 * 10 + 8 * 5) * 4
    # a cap that holds the Linear's input but not the ReLU's output: OOM after the ReLU
    tight = worker.CpuMemoryCap(model, cap.base_bytes + 8 * 10 * 4, 8)
    seen = []
    handle = model[0].register_forward_hook(lambda m, i, out: seen.append(weakref.ref(out)))
    with pytest.raises(torch.OutOfMemoryError, match="memory cap"), tight:
        model(x)
    handle.remove()
    assert tight.model is None and tight.peak_step_bytes == cap.peak_step_bytes
    # the half-built graph is gone with the exception: the Linear's output was freed
    assert len(seen) == 1 and seen[0]() is None
    # the hooks are gone afterwards: the same forward runs without a cap
    model(x).sum().backward()


@pytest.mark.parametrize("kw, match", [
    ({"batch_sizes": (0, 32)}, "at least 1"),
    ({"batch_sizes": (128, 32)}, "grow strictly"),
    ({"batch_sizes": ()}, "must not be empty"),
    ({"width": 0}, "model width"),
    ({"memory_fraction": 0.5}, "on the CPU use memory_cap_bytes"),
    ({"memory_fraction": 1.5}, r"\(0, 1\]"),
    ({"memory_cap_bytes": -5}, "memory cap"),
])
def test_bad_input_is_rejected_before_training(store, spy, kw, match):
    with pytest.raises(LabError, match=match):
        lab = lab_for(store)
        measure(lab, sweep.SWEEP_EXPERIMENT, lab.settings(sweep.Settings, **kw), verbose=False,
                machine=Machine(gpus=0, cores=2))
    assert spy.calls == []


def test_profiles_follow_the_spec():
    full = profiles.settings(sweep.Settings, "full")
    assert full.batch_sizes[:5] == (32, 128, 512, 2048, 8192) and full.width == 64
    assert full.train_images is None and full.epochs == 2 and full.reported_epoch == 2
    quick = profiles.settings(sweep.Settings, "quick")
    assert quick.memory_cap_bytes and quick.width < 64 and quick.batch_sizes[0] == 32


def test_anchor_table_shows_both_cohort_sets_and_compares_only_the_spec_configuration():
    """Issue 52, A2: the first cohort's Q1 answer (epoch 1 and 2: 59.82 / 43.42, 39.07 / 36.85, 41.69 /
    40.25 s) beside its Table 1's 1-GPU row (41.30 / 33.64 / 33.95 s), 5.1 / 9.5 / 18.6 % apart; this run's
    two epochs; the ratio as the range over the two sets: 41.3 / 20.65 = 2.00 to 43.42 / 20.65 = 2.10."""
    def rec(bs, seconds=None, status="ok", warm=None):
        metrics = {"train_seconds": seconds, "warmup_train_seconds": warm} if seconds is not None else {}
        return Record(experiment="batch_sweep", config={"batch_size": bs}, metrics=metrics, status=status)

    full = [rec(32, 20.65, warm=29.0), rec(128, 16.8, warm=17.5), rec(512, None, "oom")]
    t = sweep_tables.anchor_table(full, profiles.settings(sweep.Settings, "full"))
    assert list(t["batch size"]) == [32, 128, 512]
    assert list(t["cohort Q1: epoch 1 (s)"]) == [59.82, 39.07, 41.69]
    assert list(t["cohort Q1: epoch 2 (s)"]) == [43.42, 36.85, 40.25]
    assert list(t["cohort Table 1 (s)"]) == [41.3, 33.64, 33.95]
    assert list(t["Q1 over Table 1 (%)"]) == [5.1, 9.5, 18.6]
    assert list(t["this run: epoch 1 (s)"]) == [29.0, 17.5, None]
    assert list(t["this run: epoch 2 (s)"]) == [20.65, 16.8, None]
    assert list(t["cohort / this run"])[:2] == ["2.00-2.10", "2.00-2.19"]   # 33.64/16.8, 36.85/16.8
    assert t["cohort / this run"][2].startswith("not measured (oom")
    quick = profiles.settings(sweep.Settings, "quick")
    assert set(sweep_tables.anchor_table(full, quick)["cohort / this run"]) == {
        "not comparable: reduced model/data"}


def test_quick_sweep_pins_threads_like_the_ddp_workers(store, monkeypatch, cached_loaders):
    from lab_utils.experiments.n02_scaling import experiment as scaling

    assert profiles.settings(sweep.Settings, "quick").cpu_threads == profiles.settings(
        scaling.Settings, "quick").cpu_threads
    assert profiles.settings(sweep.Settings, "full").cpu_threads is None  # GPUs: torch's default
    monkeypatch.setattr(worker, "make_loaders", cached_loaders)
    before = torch.get_num_threads()
    seen = []
    real = worker.run_config

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(worker, "run_config", spy)
    torch.set_num_threads(2)
    try:
        result = small_sweep(store, batch_sizes=(32,), train_images=64, test_images=32, memory_cap_bytes=0)
        assert seen == [1] and torch.get_num_threads() == 2  # pinned inside, restored after
    finally:
        torch.set_num_threads(before)
    rec = result[0]
    assert rec.config["cpu_threads"] == 1 and rec.threads == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_launched_worker_gives_the_records_of_the_in_process_one(store):
    """The GPU path's door on this CPU: the same runs launched under torchrun (one process, its JSON
    job file) give the same statuses and configs, the OOM from the worker's own process."""
    runs = [replace(r, in_process=False, threads=1)
            for r in make_plan(sweep.SWEEP_EXPERIMENT, settings(), Machine(gpus=0, cores=2), "quick")]
    got = measure(lab_for(store), sweep.SWEEP_EXPERIMENT, settings(), runs=runs, verbose=False)
    assert [r.status for r in got] == ["ok", "ok", "oom", "skipped"]
    assert [r.config for r in got] == [r.config for r in runs]
    assert got[0].metrics["ms_per_step"] > 0 and got[2].reason.startswith("OOM:")
