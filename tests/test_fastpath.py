"""The fast path: device-resident loader (same augmentation as the spec), options, benchmarks.

The statistical tests are seeded, so they are deterministic; their thresholds are the
chi-square critical values at p = 0.001, so a correct implementation passes with any
seed with probability 0.999 and a wrong distribution (e.g. offsets 0..7, flip rate
0.4, a missing flip) fails by a wide margin.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
import textwrap
from dataclasses import replace

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as TF
from PIL import Image
from store_helpers import lab_for

from lab_utils.engine import profiles
from lab_utils.engine.machine import BUDGET_NODE, Machine
from lab_utils.engine.plan import make_plan, measure
from lab_utils.experiments.n08_speed_limits import experiment as fastpath
from lab_utils.experiments.n08_speed_limits import fast_train, worker
from lab_utils.experiments.n08_speed_limits import tables as fastpath_tables
from lab_utils.experiments.n08_speed_limits.experiment import Settings
from lab_utils.experiments.n08_speed_limits.fast_train import TrainOptions
from lab_utils.experiments.shared import data, estimates
from lab_utils.experiments.shared.data import DeviceLoader
from lab_utils.learn.errors import LabError

MEAN = torch.tensor(data.CIFAR10_MEAN).view(3, 1, 1)
STD = torch.tensor(data.CIFAR10_STD).view(3, 1, 1)
CHI2_CRIT_DF8 = 26.12    # chi-square, 8 degrees of freedom, p = 0.001
CHI2_CRIT_DF80 = 124.84  # 80 degrees of freedom, p = 0.001
CPU = Machine(gpus=0, cores=2)
H100 = Machine(gpus=1, gpu_name="NVIDIA H100 80GB HBM3", cores=16, bf16=True)


def tiny(**kw) -> Settings:
    """Settings small enough for a test on two cores."""
    base = dict(width=4, train_images=64, data_images=128, batch_size=32, num_workers=0, warmup_steps=1,
                data_min_seconds=0.0, compile=False, trace_steps=2, top_ops=5, accuracy_epochs=1,
                test_images=40, dataset="synthetic")
    base.update(kw)
    return Settings(**base).validate()


# --------------------------------------------------------------------------- exactness


def spec_augment(img: np.ndarray, dy: int, dx: int, flip: bool) -> torch.Tensor:
    """torchvision's pipeline, random choices fixed: pad 4, crop at (dy, dx), flip, ToTensor, Normalize."""
    pil = TF.pad(Image.fromarray(img), 4)  # fill 0, as RandomCrop(padding=4)
    pil = TF.crop(pil, dy, dx, 32, 32)
    if flip:
        pil = TF.hflip(pil)
    return TF.normalize(TF.to_tensor(pil), data.CIFAR10_MEAN, data.CIFAR10_STD)


@pytest.mark.parametrize("channels_last", [False, True])
def test_batch_equals_torchvision_for_fixed_offsets(channels_last):
    imgs, labels = data.synthetic_arrays(6, True)
    dl = DeviceLoader(imgs, labels, batch_size=6, channels_last=channels_last)
    cases = [(0, 0, 0), (8, 8, 1), (4, 4, 0), (0, 8, 1), (8, 0, 0), (3, 6, 1)]  # corners, centre, mixed
    idx = torch.arange(6)
    dy, dx, fl = (torch.tensor(c) for c in zip(*cases))
    x, y = dl.batch(idx, dy, dx, fl)
    assert x.shape == (6, 3, 32, 32) and x.dtype == torch.float32
    assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
    assert torch.equal(y, torch.as_tensor(labels))
    for i, (a, b, f) in enumerate(cases):
        ref = spec_augment(imgs[i], a, b, bool(f))
        assert torch.allclose(x[i], ref, atol=1e-5), (a, b, f)


def test_test_pipeline_equals_spec_test_transform():
    imgs, labels = data.synthetic_arrays(10, False)
    dl = DeviceLoader(imgs, labels, batch_size=4, augment=False, shuffle=False)
    xs, ys = zip(*dl)
    x, y = torch.cat(xs), torch.cat(ys)
    ref = torch.stack([data.test_transform()(Image.fromarray(im)) for im in imgs])
    assert torch.allclose(x, ref, atol=1e-5)
    assert y.tolist() == labels.tolist()  # order kept without shuffling
    assert [len(b) for b in xs] == [4, 4, 2]


# --------------------------------------------------------------------------- statistics


def position_image() -> np.ndarray:
    """R = 8 x row, G = 8 x column, B = 255: each output pixel says where it came from."""
    r, c = np.meshgrid(np.arange(32), np.arange(32), indexing="ij")
    return np.stack([8 * r, 8 * c, np.full_like(r, 255)], axis=-1).astype(np.uint8)


def decode(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crop offsets (dy, dx) and flips of a batch of augmented position images."""
    v = torch.round((x * STD + MEAN) * 255).long()  # back to uint8 values
    red, green = v[:, 0, 16, 16], v[:, 1, 16, 16]    # (16, 16) is inside the image for every offset
    flip = v[:, 1, 16, 17] < green                      # columns run backwards when flipped
    dy = red // 8 - 12                                  # output row 16 <- original row dy - 4 + 16
    dx = torch.where(flip, green // 8 - 11, green // 8 - 12)
    return dy.numpy(), dx.numpy(), flip.numpy()


def chi2_uniform(counts: np.ndarray) -> float:
    expected = counts.sum() / counts.size
    return float(((counts - expected) ** 2 / expected).sum())


def chi2_two_sample(a: np.ndarray, b: np.ndarray) -> float:
    """Chi-square homogeneity statistic of two histograms over the same bins."""
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    keep = total > 0
    return float((((a - ea) ** 2 / ea)[keep]).sum() + (((b - eb) ** 2 / eb)[keep]).sum())


def test_augmentation_distribution_matches_torchvision():
    n = 3000
    img = position_image()
    torch.manual_seed(0)
    tf = data.train_transform()
    pil = Image.fromarray(img)
    spec = decode(torch.stack([tf(pil) for _ in range(n)]))
    dl = DeviceLoader(np.repeat(img[None], n, axis=0), np.zeros(n, dtype=np.int64), batch_size=512, seed=1)
    dev = decode(torch.cat([x for x, _ in dl]))
    for name, (dy, dx, flip) in {"spec": spec, "device": dev}.items():
        assert dy.min() == 0 and dy.max() == 8 and dx.min() == 0 and dx.max() == 8, name  # 9 offsets, 0..8
        hy, hx = np.bincount(dy, minlength=9), np.bincount(dx, minlength=9)
        assert chi2_uniform(hy) < CHI2_CRIT_DF8 and chi2_uniform(hx) < CHI2_CRIT_DF8, name
        assert chi2_uniform(np.bincount(dy * 9 + dx, minlength=81)) < CHI2_CRIT_DF80, name  # jointly
        assert abs(flip.mean() - 0.5) < 4 * math.sqrt(0.25 / n), name  # flip rate 1/2 within 4 sigma
    for k in range(2):  # the two pipelines' offset histograms agree with each other
        a, b = np.bincount(spec[k], minlength=9), np.bincount(dev[k], minlength=9)
        assert chi2_two_sample(a, b) < CHI2_CRIT_DF8


def test_statistics_catch_a_wrong_distribution():
    # the same checks reject offsets 0..7 and a flip rate of 0.4 (so the test above can fail)
    rng = np.random.default_rng(0)
    wrong = rng.integers(0, 8, 3000)
    assert chi2_uniform(np.bincount(wrong, minlength=9)) > CHI2_CRIT_DF8
    assert abs((rng.random(3000) < 0.4).mean() - 0.5) > 4 * math.sqrt(0.25 / 3000)


def test_normalized_channel_mean_and_std_match_spec():
    split = data.load_split(True, 512, "synthetic")
    torch.manual_seed(0)
    spec = torch.stack([data.train_transform()(Image.fromarray(im)) for im in split.images])
    dev = torch.cat([x for x, _ in data.device_loader(split, "cpu", 128, seed=3)])
    assert dev.shape == spec.shape
    m_spec, m_dev = spec.mean(dim=(0, 2, 3)), dev.mean(dim=(0, 2, 3))
    s_spec, s_dev = spec.std(dim=(0, 2, 3)), dev.std(dim=(0, 2, 3))
    assert torch.allclose(m_spec, m_dev, atol=0.02), (m_spec, m_dev)
    assert torch.allclose(s_spec, s_dev, rtol=0.02), (s_spec, s_dev)
    # zero padding shows up in both as the same per-channel value -mean/std
    pad_value = (-MEAN / STD).view(3)
    for x in (spec, dev):
        frac = (x[:, :, 0, :] - pad_value[None, :, None]).abs().lt(1e-4).float().mean()
        assert 0.3 < frac < 0.6  # top row is padding whenever dy < 4, i.e. 4/9 of the time


# --------------------------------------------------------------------------- loader mechanics


def test_epoch_visits_every_image_once_and_reshuffles():
    imgs, _ = data.synthetic_arrays(100, True)
    labels = np.arange(100)  # label = index, to track images
    dl = DeviceLoader(imgs, labels, batch_size=32, seed=5)
    assert len(dl) == 4
    e1 = torch.cat([y for _, y in dl])
    e2 = torch.cat([y for _, y in dl])
    assert sorted(e1.tolist()) == list(range(100)) and sorted(e2.tolist()) == list(range(100))
    assert not torch.equal(e1, e2)  # a new permutation each epoch
    again = torch.cat([y for _, y in DeviceLoader(imgs, labels, batch_size=32, seed=5)])
    assert torch.equal(e1, again)  # seeded
    dropped = DeviceLoader(imgs, labels, batch_size=32, drop_last=True)
    assert len(dropped) == 3 and sum(len(y) for _, y in dropped) == 96


def test_bad_input_is_one_clear_error():
    imgs, labels = data.synthetic_arrays(4, True)
    with pytest.raises(LabError, match="uint8"):
        DeviceLoader(imgs.astype(np.float32), labels)
    with pytest.raises(LabError, match="one label per image"):
        DeviceLoader(imgs, labels[:3])
    with pytest.raises(LabError, match="batch size"):
        DeviceLoader(imgs, labels, batch_size=0)
    with pytest.raises(LabError, match="loader"):
        TrainOptions(loader="gpu")
    with pytest.raises(LabError, match="SGD"):
        TrainOptions(sgd="adam")
    with pytest.raises(LabError, match="waterfall step"):
        fast_train.waterfall_steps(2, ["spec", "cudagraphs"])
    with pytest.raises(LabError, match="Unknown fast-path setting"):
        profiles.settings(fastpath.Settings, "quick", widht=8)
    with pytest.raises(LabError, match="width"):
        profiles.settings(fastpath.Settings, "quick", width=0)


def test_load_split_uses_synthetic_arrays_without_cifar():
    split = data.load_split(True, 300)  # no CIFAR-10 in the test data dir
    ref, labels = data.synthetic_arrays(300, True)
    assert split.synthetic and np.array_equal(split.images, ref) and np.array_equal(split.labels, labels)
    assert split.images.shape == (300, 32, 32, 3) and split.images.dtype == np.uint8
    assert len(data.load_split(False, 10**6, "synthetic")) == data.CIFAR10_TEST_SIZE  # capped


# --------------------------------------------------------------------------- options and training


def test_waterfall_is_cumulative_and_plans_skips():
    steps = fast_train.waterfall_steps(2)
    assert [s[0] for s in steps] == list(fast_train.STEP_NAMES)
    fields = ("loader", "channels_last", "bf16", "sgd", "compile")
    for (_, _, prev, _), (_, _, cur, _) in zip(steps, steps[1:]):
        changed = [f for f in fields if getattr(prev, f) != getattr(cur, f)]
        assert len(changed) == 1  # exactly one change per step
    last = steps[-1][2]
    assert last == TrainOptions(loader="device", channels_last=True, bf16=True, sgd="fused", compile=True)
    quick = profiles.settings(fastpath.Settings, "quick")
    reasons = {name: reason for name, _, _, reason in fastpath.waterfall(quick, CPU, "quick")}
    assert reasons["compile"].startswith("skipped in quick profile")
    assert all(reasons[n] is None for n in fast_train.STEP_NAMES if n != "compile")
    assert [s[0] for s in fast_train.waterfall_steps(2, ["bf16"])] == ["spec", "bf16"]  # spec always first
    # a GPU without bf16: the row says why, and the later rows build on the last one that ran
    v100 = fastpath.waterfall(quick, Machine(gpus=1, gpu_name="Tesla V100-SXM2-16GB", cores=8), "quick")
    assert v100[3][3] == "this GPU has no bf16 (needs Ampere or newer)" and not v100[4][2].bf16


def test_the_plans_launch_on_a_gpu_and_run_here_on_a_cpu():
    """Every run of the four experiments goes through the launcher on a GPU (one process, no group);
    the loader benchmark, the waterfall and the accuracy check are side-by-side groups (one launch,
    reused whole); on a CPU the same runs are in this process, but a waterfall with a live compile row."""
    full = profiles.settings(Settings, "full")
    experiments = (fastpath.LOADER_EXPERIMENT, fastpath.WATERFALL_EXPERIMENT, fastpath.TRACE_EXPERIMENT,
                   fastpath.ACCURACY_EXPERIMENT)
    for e in experiments:
        runs = make_plan(e, full, H100, "full")
        assert runs and all(r.worker is worker and r.device == "cuda" and not r.in_process
                            and r.processes == 1 and r.options["process_group"] is False and r.skip is None
                            for r in runs), e.name
        together = e is not fastpath.TRACE_EXPERIMENT
        assert {(r.group, r.together) for r in runs} == {(e.name if together else None, together)}, e.name
    waterfall = make_plan(fastpath.WATERFALL_EXPERIMENT, full, H100, "full")
    assert [r.config["step"] for r in waterfall] == list(fast_train.STEP_NAMES)
    assert waterfall[-1].config["compile"] and waterfall[0].config["device"] == "cuda"
    trace = make_plan(fastpath.TRACE_EXPERIMENT, full, H100, "full")[0]
    assert trace.config["step"] == "compile" and trace.options["trace_path"].endswith("fastpath_compile.json")
    quick = profiles.settings(Settings, "quick")
    for e in experiments:
        assert all(r.in_process and r.device == "cpu" for r in make_plan(e, quick, CPU, "quick")), e.name
    compiled = make_plan(fastpath.WATERFALL_EXPERIMENT, replace(quick, compile=True), CPU, "quick")
    assert not any(r.in_process for r in compiled)  # its own process, which the row's time limit can end
    assert make_plan(fastpath.TRACE_EXPERIMENT, replace(quick, fast_step="bf16"), CPU, "quick")[0].config[
        "step"] == "bf16"
    with pytest.raises(LabError, match="fast_step 'compile' is not a waterfall step that runs here"):
        make_plan(fastpath.TRACE_EXPERIMENT, replace(quick, fast_step="compile"), CPU, "quick")


def test_cost_on_the_budget_node_by_hand():
    """The spec row is the cohort's 1-GPU epoch at 128 (33.64 s), a compiled row adds COMPILE_S, a bf16
    fast row is 50,000 x 3.329 GFLOP at 30 % of 989 TFLOP/s; the accuracy check's 8 epochs."""
    full = profiles.settings(Settings, "full")
    rows = make_plan(fastpath.WATERFALL_EXPERIMENT, full, BUDGET_NODE, "full")
    fast = 50_000 * 3.329e9 / (0.30 * 989e12)
    assert [fastpath.cost(r) for r in rows[::3]] == pytest.approx([33.64, fast], rel=1e-3)
    assert fastpath.cost(rows[-1]) == pytest.approx(estimates.COMPILE_S + fast, rel=1e-3)
    spec, fastest = make_plan(fastpath.ACCURACY_EXPERIMENT, full, BUDGET_NODE, "full")
    assert fastpath.cost(spec) == pytest.approx(8 * (33.64 + 0.2 * 33.64))
    assert fastpath.cost(fastest) == pytest.approx(estimates.COMPILE_S + 8 * 1.2 * fast, rel=1e-3)
    loaders = make_plan(fastpath.LOADER_EXPERIMENT, full, BUDGET_NODE, "full")
    assert [fastpath.cost(r) for r in loaders] == [full.data_min_seconds] * 2


@pytest.mark.parametrize("opts", [
    TrainOptions(loader="device"),
    TrainOptions(loader="device", channels_last=True, bf16=True, sgd="fused"),
    TrainOptions(loader="device", sgd="foreach"),
], ids=["fp32", "cl-bf16-fused", "foreach"])
def test_training_options_learn_on_cpu(opts):
    torch.manual_seed(0)
    split = data.load_split(True, 64, "synthetic")
    trainer = fast_train.build_trainer(opts, width=4, device="cpu", lr=0.05)
    x, y = next(iter(data.device_loader(split, "cpu", 32, augment=False,
                                            channels_last=opts.channels_last)))
    losses = [float(trainer.step(x, y)[0]) / 32 for _ in range(5)]
    assert losses[-1] < losses[0]  # the same batch, fitted: loss goes down
    if opts.channels_last:
        assert trainer.model.conv1.weight.is_contiguous(memory_format=torch.channels_last)


def test_fused_and_foreach_sgd_equal_the_for_loop():
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
    params = {}
    for impl in ("for-loop", "foreach", "fused"):
        t = fast_train.build_trainer(TrainOptions(loader="device", sgd=impl), width=4, device="cpu", seed=1)
        for _ in range(2):
            t.step(x, y)
        params[impl] = torch.cat([p.detach().flatten() for p in t.model.parameters()])
    assert torch.allclose(params["for-loop"], params["foreach"], atol=1e-5)
    assert torch.allclose(params["for-loop"], params["fused"], atol=1e-5)
    assert fast_train.resolved_sgd("default", torch.device("cpu")) == "for-loop"
    assert fast_train.resolved_sgd("default", torch.device("cuda")) == "foreach"


def test_peak_precision_per_row():
    assert fast_train.peak_precision(TrainOptions(bf16=True), "NVIDIA H100 80GB HBM3") == "bf16"
    assert fast_train.peak_precision(TrainOptions(), "cpu (some cpu)") == "fp32"


# --------------------------------------------------------------------------- benchmarks and records


def test_bench_data_records_ratio_and_resumes(store):
    s = tiny(num_workers=2)  # the spec pipeline's worker processes, as in the assignment
    recs = measure(lab_for(store), fastpath.LOADER_EXPERIMENT, s)
    spec, dev = recs
    assert spec.config["pipeline"] == "spec" and dev.config["pipeline"] == "device"
    assert spec.synthetic and dev.dataset == "synthetic CIFAR-10 stand-in"
    assert spec.metrics["loader_images"] == 128 and dev.metrics["loader_images"] % 128 == 0
    assert "images" not in spec.metrics   # images are trained on; a loader's are loader_images
    ratio = dev.metrics["loader_images_per_s"] / spec.metrics["loader_images_per_s"]
    assert dev.metrics["ratio_to_spec"] == pytest.approx(ratio)
    assert dev.metrics["run_id"] == spec.metrics["run_id"]
    again = measure(lab_for(store), fastpath.LOADER_EXPERIMENT, s)  # stored together: not measured again
    assert [r.metrics["run_id"] for r in again] == [spec.metrics["run_id"]] * 2
    table = fastpath_tables.data_table(again)
    assert list(table["ratio_to_spec"]) == [1.0, pytest.approx(ratio)]


def test_bench_train_rows_metrics_and_skips(store):
    s = tiny(steps=("spec", "device_loader", "bf16", "compile"))
    recs = measure(lab_for(store), fastpath.WATERFALL_EXPERIMENT, s)
    by = {r.config["step"]: r for r in recs}
    assert list(by) == ["spec", "device_loader", "bf16", "compile"]
    assert by["compile"].status == "skipped" and "skipped in quick profile" in by["compile"].reason
    for name in ("spec", "device_loader", "bf16"):
        r = by[name]
        m = r.metrics
        assert r.status == "ok" and m["images"] == 64 and m["steps"] == 2 and r.synthetic
        assert m["epoch_images_per_s"] == pytest.approx(64 / m["epoch_seconds"])
        achieved = m["train_flops_per_image"] * m["epoch_images_per_s"]
        assert m["achieved_tflops_per_s"] * 1e12 == pytest.approx(achieved)
        assert m["percent_of_peak"] is None  # a CPU has no peak in the table: no percentage
        spec_rate = by["spec"].metrics["epoch_images_per_s"]
        assert m["ratio_to_spec"] == pytest.approx(m["epoch_images_per_s"] / spec_rate)
        assert m["compile_seconds"] is None and m["warmup_seconds"] > 0
    assert by["bf16"].config["bf16"] and by["bf16"].config["loader"] == "device"  # cumulative
    assert by["spec"].metrics["peak_precision"] == "fp32" and by["bf16"].metrics["peak_precision"] == "bf16"
    table = fastpath_tables.waterfall_table(recs)
    assert list(table["step"]) == ["spec", "device_loader", "bf16", "compile"]
    assert table["percent_of_peak"].iloc[0] == "none (peak unknown)"
    assert table["status"].iloc[-1].startswith("skipped in quick profile")
    fig = fastpath_tables.waterfall_figure(recs)
    assert store.save_figure(fig, "fastpath_waterfall", recs).exists()
    assert fastpath_tables.fastest_step(recs) == max(recs[:3], key=lambda r: r.metrics["epoch_images_per_s"]
                                                      ).config["step"]
    text = fastpath_tables.loader_bound_summary([], recs)
    assert "Not enough" in text


@pytest.mark.slow
@pytest.mark.timeout(480)  # the subprocess's own limit (420 s) fails first, with its output
def test_compile_step_runs_and_reports_compile_time(tmp_path):
    """The command that hung on an AVX2 CPU (issue 13), run as a user would, in its own process.

    oneDNN is capped at AVX2 on x86, so the kernel behind the hang (oneDNN#6035) is the one
    this CPU would pick too; the narrow model's strided 1x1 convolutions must be rewritten
    (the row says so). 64 images at batch 32, one batch shape: Inductor compiles it once (about
    a minute of CPU per shape here). That the warm-up meets every shape the epoch meets, the last
    partial batch's too, is the same code for every row of the waterfall, compiled or not, and is
    tested without compiling (tests/test_gpu_numbers.py, the fake GPU's first-call costs). A hang
    fails this test at the subprocess limit, not the whole run. That limit is 420 s: with an empty
    Inductor cache (as on CI) the command took 76 s alone and 160 s inside the suite on a machine
    that added 10 million numbers in 0.63 s, where 300 s left less than a 2x margin.
    """
    env = dict(os.environ, LAB_RESULTS_DIR=str(tmp_path))
    if platform.machine().lower() in ("x86_64", "amd64"):
        env["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    cmd = [sys.executable, "-m", "lab_utils", "bench", "train", "--profile", "quick", "--compile",
           "--width", "2", "--images", "64", "--batch-size", "32", "--steps", "spec,compile",
           "--num-workers", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=420)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "quick" / "runs" / "bench_train.jsonl").open()]
    assert [r["config"]["step"] for r in rows] == ["spec", "compile"]
    comp = rows[-1]
    assert comp["config"]["compile"] and comp["config"]["loader"] == "spec"  # compile on top of spec only
    if comp["status"] == "error":  # no working compiler here: the row says why, nothing is made up
        assert comp["reason"].startswith("torch.compile failed")
        return
    m = comp["metrics"]
    assert comp["status"] == "ok"
    assert m["compile_seconds"] == m["warmup_seconds"] > 0
    assert m["images"] == 64 and m["steps"] == 2
    assert m["graphs_compiled_in_epoch"] in (0, None)  # compilation stayed in the warm-up
    assert "oneDNN#6035" in m["onednn_workaround"]
    assert rows[0]["metrics"]["onednn_workaround"] is None  # the spec row trains channels-first, eagerly
    assert "compile" in res.stdout and "ok" in res.stdout


def test_trace_is_perfetto_json_with_top_operators(store):
    s = tiny()
    [rec] = measure(lab_for(store), fastpath.TRACE_EXPERIMENT, replace(s, fast_step="device_loader"))
    path = store.root / "traces" / "fastpath_device_loader.json"
    assert rec.metrics["trace_path"] == str(path) and rec.config["loader"] == "device"
    trace = json.loads(path.read_text())
    assert trace["traceEvents"]  # Chrome trace format, which Perfetto opens
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "train_step" in names and "data_loader" in names
    ops = fastpath_tables.top_ops_table([rec])
    assert 0 < len(ops) <= 5 and (ops["self_ms"] >= 0).all()
    assert ops["percent"].sum() <= 100.0 + 1e-6
    assert list(ops["self_ms"]) == sorted(ops["self_ms"], reverse=True)
    assert any(str(o).startswith("aten::") for o in ops["operator"])
    [again] = measure(lab_for(store), fastpath.TRACE_EXPERIMENT, replace(s, fast_step="device_loader"))
    assert again.timestamp == rec.timestamp  # resumed from the store
    assert "self time = CPU time" in fastpath_tables.trace_notes([again])[1]


def test_top_operators_leave_out_record_function_ranges():
    """CPU: a real profile of two tiny steps, each inside the lab's record_function ranges."""
    from torch.profiler import ProfilerActivity, profile, record_function

    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(16, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            with record_function("data_loader"):
                batch = x * 1.0
            with record_function("train_step"):
                model(batch).sum().backward()
    assert any(e.key == "train_step" and e.is_user_annotation for e in prof.key_averages())
    rows = worker.top_operators(prof, n=1000, device_type="cpu")
    names = {r["operator"] for r in rows}
    assert not names & {"data_loader", "train_step"} and "aten::addmm" in names
    # percent is of the operators' total self CPU time: over all operators it adds up to 100
    assert sum(r["percent"] for r in rows) == pytest.approx(100.0)
    top = worker.top_operators(prof, n=3, device_type="cpu")
    assert [r["operator"] for r in top] == [r["operator"] for r in rows[:3]]


def _event(key, device_type, self_device_us, self_cpu_us=0.0, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    return SimpleNamespace(key=key, device_type=getattr(DeviceType, device_type), count=2,
                           self_device_time_total=self_device_us, self_cpu_time_total=self_cpu_us,
                           is_user_annotation=annotation)


def test_top_operators_on_a_gpu_count_each_kernel_once():
    """GPU (simulated key_averages rows): the host operator carries the time of the kernel it
    launched, the kernel is also a device row, and the range's GPU copy spans all kernels."""
    from types import SimpleNamespace

    events = [
        _event("train_step", "CPU", 0.0, 50.0, annotation=True),
        _event("train_step", "CUDA", 1000.0, annotation=True),         # gpu_user_annotation
        _event("aten::convolution", "CPU", 600.0, 30.0),
        _event("aten::addmm", "CPU", 300.0, 20.0),
        _event("cudaLaunchKernel", "CPU", 0.0, 40.0),
        _event("sm90_xmma_fprop_kernel", "CUDA", 600.0),
        _event("ampere_sgemm_kernel", "CUDA", 300.0),
        _event("Memcpy HtoD", "CUDA", 100.0),                          # no operator launched it
    ]
    prof = SimpleNamespace(key_averages=lambda: events)
    rows = worker.top_operators(prof, n=10, device_type="cuda")
    assert [r["operator"] for r in rows[:2]] == ["aten::convolution", "aten::addmm"]
    assert "train_step" not in {r["operator"] for r in rows}
    assert "sm90_xmma_fprop_kernel" not in {r["operator"] for r in rows}  # not counted twice
    # percent of the 1000 us of kernel time (600 + 300 + 100), not of 3000 with duplicates
    assert rows[0]["percent"] == pytest.approx(60.0) and rows[1]["percent"] == pytest.approx(30.0)
    assert rows[0]["self_ms"] == pytest.approx(0.6) and rows[0]["self_cpu_ms"] == pytest.approx(0.03)
    assert sum(r["percent"] for r in rows) == pytest.approx(90.0)  # the memcpy had no operator


def test_accuracy_check_compares_two_runs(store):
    s = tiny()
    fast = TrainOptions(loader="device", channels_last=True, bf16=True, sgd="fused", num_workers=0)
    recs = measure(lab_for(store), fastpath.ACCURACY_EXPERIMENT, replace(s, fast_step="fused_sgd"))
    assert [r.config["run"] for r in recs] == ["spec", "fused_sgd"]
    assert TrainOptions.from_config(recs[1].config) == fast
    for r in recs:
        assert r.status == "ok" and 0.0 <= r.metrics["test_accuracy"] <= 1.0
        assert math.isfinite(r.metrics["test_loss"]) and r.config["test_images"] == 40
    table = fastpath_tables.accuracy_table(recs)
    diff = 100 * (recs[1].metrics["test_accuracy"] - recs[0].metrics["test_accuracy"])
    assert table["difference_points"].iloc[1] == pytest.approx(diff)
    lines = fastpath_tables.targets_summary([], [], recs)
    assert "within 1 point" in lines[-1]
    skipped = measure(lab_for(store), fastpath.ACCURACY_EXPERIMENT, tiny(accuracy_epochs=0))
    assert skipped[0].status == "skipped" and "accuracy_epochs is 0" in skipped[0].reason
    same = measure(lab_for(store), fastpath.ACCURACY_EXPERIMENT, replace(s, fast_step="spec"))
    assert same[0].status == "skipped" and "nothing to compare" in same[0].reason
    # the same columns as a compared check's (tests/table_columns.json freezes them): the quick lab
    # skips the check when timing noise makes the spec step the fastest
    assert list(fastpath_tables.accuracy_table(same).columns) == list(table.columns)


def test_cli_bench_data_and_bad_input(results_dir, capsys):
    from lab_utils.app.cli import main

    rc = main(["bench", "data", "--profile", "quick", "--images", "128", "--min-seconds", "0",
               "--num-workers", "0", "--dataset", "synthetic"])
    out = capsys.readouterr().out
    assert rc == 0 and "ratio device / spec" in out and "device-resident loader" in out
    assert (results_dir / "quick" / "runs" / "bench_data.jsonl").exists()
    assert main(["bench", "train", "--profile", "quick", "--images", "0"]) == 2
    assert "error:" in capsys.readouterr().err


def test_cli_bench_train_small(results_dir, capsys):
    rc = fastpath_tables.bench_train_main(["--profile", "quick", "--images", "32", "--batch-size", "16",
                                    "--width", "2", "--num-workers", "0", "--steps", "spec,device_loader",
                                    "--dataset", "synthetic"])
    out = capsys.readouterr().out
    assert rc == 0 and "device_loader" in out and "ratio_to_spec" in out
    lines = (results_dir / "quick" / "runs" / "bench_train.jsonl").read_text().splitlines()
    assert len(lines) == 2


@pytest.mark.timeout(120)
def test_trace_prints_no_profiler_noise(tmp_path):
    """What a student reads under the trace cell: none of kineto's start/stop markers or its
    "gpuGetDeviceCount failed" on a machine without a GPU (a fresh process: kineto reads its
    log level once)."""
    code = textwrap.dedent("""
        from lab_utils.engine.machine import Machine
        from lab_utils.experiments.n08_speed_limits import experiment as fastpath
        from lab_utils.engine.plan import measure
        s = fastpath.Settings(width=4, train_images=64, data_images=128, batch_size=32, num_workers=0,
                              warmup_steps=1, trace_steps=2, top_ops=5, dataset="synthetic",
                              fast_step="device_loader").validate()
        measure("quick", fastpath.TRACE_EXPERIMENT, s, machine=Machine(cores=1), verbose=False)
        print("traced")
    """)
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env["LAB_RESULTS_DIR"] = str(tmp_path)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=100)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "traced" in res.stdout
    for noise in ("gpuGetDeviceCount", "profiler_start", "profiler_stop"):
        assert noise not in res.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_row_past_its_time_limit_is_an_error_row_that_says_why(store):
    """The watchdog in a launched waterfall: the row's failure file (not the log's words) says why, the
    row is stored as an error (measured again next time), the rows after it are not run, one error."""
    from lab_utils.learn.errors import LaunchError

    # 1024 images through the PIL pipeline and 32 steps: far longer than the row's 0.1 s
    s = tiny(steps=("spec", "device_loader"), train_images=1024, row_timeout_s=0.1)
    runs = [replace(r, in_process=False) for r in make_plan(fastpath.WATERFALL_EXPERIMENT, s, CPU, "quick")]
    with pytest.raises(LaunchError, match="did not finish within 0.1 s") as e:
        measure(lab_for(store), fastpath.WATERFALL_EXPERIMENT, s, runs=runs, verbose=False)
    assert "1 run(s) of bench_train failed" in str(e.value)
    [row] = store.records("bench_train")
    assert (row.config["step"], row.status) == ("spec", "error")
    assert "waterfall row 'spec'" in row.reason and "raise --row-timeout" in row.reason


def test_a_waterfall_row_on_a_known_gpu_gives_its_percent_of_peak(store, monkeypatch):
    """The row's % of peak, by hand: FLOPs per image x images/s over ONE H100's dense peak at the row's
    precision (a waterfall row runs on one device; the CPU stands in, named an H100)."""
    from lab_utils.engine.hardware import peak_flops_per_s

    h100 = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(worker, "device_name", lambda device: h100)
    [rec] = measure(lab_for(store), fastpath.WATERFALL_EXPERIMENT, tiny(steps=("spec",)))
    m = rec.metrics
    peak = peak_flops_per_s(h100, m["peak_precision"])
    assert peak is not None and m["peak_precision"] in ("fp32", "tf32")
    achieved = m["train_flops_per_image"] * m["epoch_images_per_s"]
    assert m["percent_of_peak"] == pytest.approx(100 * achieved / peak)
