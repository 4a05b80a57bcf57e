"""Notebook 01's batch-size sweep: stop at OOM, resume, table rows, FLOP count, input checks.

The sweeps here are real (a width-2 ResNet-18 on a few hundred synthetic images, on CPU);
``run_epoch`` is wrapped by a spy that counts the calls and then runs the real one.
The out-of-memory row comes from the sweep's CPU memory cap (``CpuMemoryCap``), whose
limit is derived from the measured activation bytes of a small batch, and in one test
from the CPU allocator itself refusing a real allocation.
"""

from __future__ import annotations

import weakref

import pytest
import torch
from store_helpers import lab_for
from torch import nn

from lab_utils.core import profiles
from lab_utils.core.errors import LabError
from lab_utils.experiments import sweep, sweep_tables
from lab_utils.models import ResNet18

WIDTH = 2
SIZES = (8, 32, 128, 512)
TRAIN_IMAGES = 160  # 512 > 160: never tried anyway, the OOM at 128 stops the sweep first
TEST_IMAGES = 40


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
    real = sweep.make_loaders
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
    mp.setattr(sweep, "make_loaders", cached_loaders)
    spy = Spy(sweep.run_epoch)
    mp.setattr(sweep, "run_epoch", spy)
    return spy


@pytest.fixture
def spy(monkeypatch, cached_loaders):
    return _install_spy(monkeypatch, cached_loaders)


@pytest.fixture(scope="module")
def oom_sweep(tmp_path_factory, cached_loaders):
    """One standard sweep (ok, ok, oom, skipped), shared by the tests that only read it."""
    from lab_utils.store import ResultStore

    with pytest.MonkeyPatch.context() as mp:
        store = ResultStore("quick", root=tmp_path_factory.mktemp("oom_sweep") / "quick")
        spy = _install_spy(mp, cached_loaders)
        result = small_sweep(store)
    return store, spy, result


def activation_bytes_per_image(width: int = WIDTH, batch: int = 8) -> float:
    """Measured bytes autograd saves per image (through the cap's own accounting, no limit)."""
    model = ResNet18(width=width)
    cap = sweep.CpuMemoryCap(model, 10**15, batch)
    with cap:
        model(torch.randn(batch, 3, 32, 32)).sum().backward()
    return (cap.peak_step_bytes - cap.base_bytes) / batch


def cap_between(fits: int, fails: int) -> int:
    """A cap that holds batch ``fits`` but not batch ``fails`` (model state + activations)."""
    state = sweep.model_state_bytes(ResNet18(width=WIDTH))
    per_image = activation_bytes_per_image()
    return int(state + per_image * (fits + fails) / 2)


def small_sweep(store, force=False, device="cpu", **kw):
    """A sweep through notebook 01's door: settings from the quick profile with overrides, then measure."""
    args = dict(batch_sizes=SIZES, width=WIDTH, train_images=TRAIN_IMAGES, test_images=TEST_IMAGES,
                memory_cap_bytes=cap_between(32, 128), dataset="synthetic")
    args.update(kw)
    lab = lab_for(store, device)
    return sweep.measure(lab, lab.settings(sweep.Settings, **args), force=force, verbose=False)


def ok(records):
    return [r for r in records if r.status == "ok"]


def test_sweep_stops_growing_after_oom_and_frees_the_model(oom_sweep):
    store, spy, result = oom_sweep
    statuses = [r.status for r in result]
    assert statuses == ["ok", "ok", "oom", "skipped"]
    # 2 epochs at 8 and 32, then batch 128 fails in its first epoch; 512 is never tried.
    assert spy.calls == [8, 8, 32, 32, 128]
    oom = result[2]
    assert oom.reason.startswith("OOM:") and "memory cap" in oom.reason
    assert "128" in result[3].reason
    assert sweep_tables.largest_fitting_batch(result) == 32
    # The OOM row is stored (a measurement); the skipped row is not (it follows from it).
    stored = {r.config["batch_size"]: r.status for r in store.latest("batch_sweep")}
    assert stored == {8: "ok", 32: "ok", 128: "oom"}
    # Every model, including the one that ran out of memory mid-forward, has been freed.
    assert all(ref() is None for ref in spy.models)
    # Measured rows carry the real training result.
    for r in ok(result):
        m = r.metrics
        assert m["images"] == TRAIN_IMAGES and m["steps"] == -(-TRAIN_IMAGES // r.config["batch_size"])
        assert m["train_seconds"] > 0 and m["images_per_s"] == pytest.approx(m["images"] / m["train_seconds"])
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


def test_table_has_one_row_per_batch_size(oom_sweep):
    store, _, result = oom_sweep
    table = sweep_tables.save_tables(store, result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES, TEST_IMAGES))
    assert list(table["batch size"]) == list(SIZES)
    assert list(table["status"]) == ["ok", "ok", "oom", "skipped"]
    assert list(table["peak memory (GiB)"][:2]) == ["not tracked on CPU"] * 2
    assert table["epoch-2 training (s)"][2] == "" and table["reason"][2].startswith("OOM")
    md = (store.tables_dir / "batch_sweep.md").read_text()
    assert "profile: quick" in md and "SYNTHETIC" in md and "| oom" in md
    csv = (store.tables_dir / "batch_sweep.csv").read_text().strip().splitlines()
    assert len(csv) == 1 + len(SIZES)
    phases = (store.tables_dir / "batch_sweep_phases.csv").read_text().strip().splitlines()
    assert len(phases) == 1 + 2  # measured batch sizes only
    fig = sweep_tables.plot_sweep(result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES, TEST_IMAGES))
    assert store.save_figure(fig, "batch_sweep", result).exists()


def test_flop_table_on_cpu_has_no_percentage(oom_sweep):
    store, _, result = oom_sweep
    flops = sweep.FlopsPerImage(width=WIDTH, forward_flops=1e6, train_flops=3e6)
    table, why = sweep_tables.save_flop_table(store, result, sweep.Settings(SIZES, WIDTH, TRAIN_IMAGES,
                                                                            TEST_IMAGES), flops)
    ips = result[1].metrics["images_per_s"]
    assert table["achieved TFLOP/s"][1] == pytest.approx(3e6 * ips / 1e12)
    assert list(table["% of peak"]) == ["", ""]
    assert "No % of peak" in why


def test_resnet18_forward_flops_per_image_match_the_published_count():
    f = sweep.flops_per_image(64, batch=2)
    assert f.forward_flops == pytest.approx(2 * 0.556e9, rel=0.02)
    # backward = weight grads + input grads (none for the image itself): just under 2x forward
    assert 2.9 < f.train_flops / f.forward_flops < 3.0


def test_memory_cap_counts_model_state_and_activations_by_hand():
    lin = nn.Linear(10, 5)  # 55 fp32 parameters: params + grads + momentum = 3 * 55 * 4 bytes
    assert sweep.model_state_bytes(lin) == 3 * 55 * 4
    model = nn.Sequential(nn.Linear(10, 5), nn.ReLU())
    x = torch.randn(8, 10)
    cap = sweep.CpuMemoryCap(model, 10**9, 8)
    with cap:
        model(x).sum().backward()
    # saved for backward: the input (8x10) for the weight grad and the ReLU output (8x5)
    assert cap.peak_step_bytes - cap.base_bytes == (8 * 10 + 8 * 5) * 4
    # a cap that holds the Linear's input but not the ReLU's output: OOM after the ReLU
    tight = sweep.CpuMemoryCap(model, cap.base_bytes + 8 * 10 * 4, 8)
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
        sweep.measure(lab, lab.settings(sweep.Settings, **kw), verbose=False)
    assert spy.calls == []


def test_profiles_follow_the_spec():
    full = profiles.settings(sweep.Settings, "full")
    assert full.batch_sizes[:5] == (32, 128, 512, 2048, 8192) and full.width == 64
    assert full.train_images is None and full.epochs == 2 and full.reported_epoch == 2
    quick = profiles.settings(sweep.Settings, "quick")
    assert quick.memory_cap_bytes and quick.width < 64 and quick.batch_sizes[0] == 32
    assert sweep.growing_batch_sizes(32, 4, 2048) == (32, 128, 512, 2048)


def test_anchor_table_compares_only_the_spec_configuration():
    from lab_utils.store import Record

    def rec(bs, seconds=None, status="ok"):
        metrics = {"train_seconds": seconds} if seconds is not None else {}
        return Record(experiment="batch_sweep", config={"batch_size": bs}, metrics=metrics, status=status)

    full = [rec(32, 20.65), rec(128, 16.8), rec(512, None, "oom")]
    t = sweep_tables.anchor_table(full, profiles.settings(sweep.Settings, "full"))
    assert list(t["batch size"]) == [32, 128, 512]
    assert t["cohort / this run"][0] == pytest.approx(41.3 / 20.65)  # the cohort's 1-GPU row, SPEC.md
    assert t["cohort / this run"][1] == pytest.approx(33.64 / 16.8)
    assert list(t["cohort, 1 GPU (s)"]) == [41.3, 33.64, 33.95]  # unrounded (SPEC.md: also 33.6, 34.0)
    assert t["cohort / this run"][2].startswith("not measured (oom")
    quick = profiles.settings(sweep.Settings, "quick")
    assert set(sweep_tables.anchor_table(full, quick)["cohort / this run"]) == {
        "not comparable: reduced model/data"}


def test_quick_sweep_pins_threads_like_the_ddp_workers(store, monkeypatch):
    from lab_utils.experiments import scaling

    assert profiles.settings(sweep.Settings, "quick").cpu_threads == profiles.settings(
        scaling.Settings, "quick").cpu_threads
    assert profiles.settings(sweep.Settings, "full").cpu_threads is None  # GPUs: torch's default
    before = torch.get_num_threads()
    seen = []
    real = sweep._measure_batch

    def spy(*a, **k):
        seen.append(torch.get_num_threads())
        return real(*a, **k)

    monkeypatch.setattr(sweep, "_measure_batch", spy)
    result = small_sweep(store, batch_sizes=(32,), train_images=64, test_images=32, memory_cap_bytes=0)
    assert seen == [1] and torch.get_num_threads() == before  # pinned inside, restored after
    rec = result[0]
    assert rec.config["cpu_threads"] == 1 and rec.threads == 1
