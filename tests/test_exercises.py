"""The autograded exercises of notebooks 01-07 and 09, checked without executing a notebook.

For every autograded question of the master notebooks (otter assign v7 format, test cells written
as ``check(QUESTION, FUNCTION, [cases])``, lab_utils.app.grading):

- the notebook has its questions, and each question its public and hidden test cells, points
  that add up to what its heading says, and an Exercise in lab_utils.app.grading.exercises;
- the master's solution agrees with the lab's own reference function on several values (the
  numbers the rest of the notebook uses): the answers the build computes from it are right;
- every known mistake differs from the right answer on a public case (the student's check
  names it) and on a hidden case (it cannot score), and is named in one sentence;
- the blank student function says "not done yet"; a function that returns the public answers
  whatever it is asked fails the hidden cases;
- cells that train, measure or launch are tagged ``otter_ignore``.

These run the solutions as plain Python on purpose; tests/test_grading.py runs every case the way
otter runs it (as a doctest) and grades through the documented command.
"""

from __future__ import annotations

import ast
import math
import re
from pathlib import Path

import nbformat
import pytest

from lab_utils.app.grading import EXERCISES, build, check
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.exercises.exercise import explain
from lab_utils.app.questions import sections_for

LABS = Path(__file__).resolve().parent.parent / "labs"

QUESTIONS = {
    "01_batch_size_sweep": ["q01_step_timer", "q01_train_transform", "q01_peak_memory"],
    "02_multi_gpu_scaling": ["q02_speedup", "q02_predict_epoch"],
    "03_compute_vs_communication": ["q03_compute_comm", "q03_predict_comm"],
    "04_allreduce_bandwidth": ["q04_gradient_bytes", "q04_ring_bytes", "q04_utilization",
                               "q04_predicted_bandwidth"],
    "05_large_batch_training": ["q05_lr_schedule", "q05_recipe", "q05_set_epoch"],
    "06_gpt_ddp": ["q06_flops_per_token", "q06_mfu", "q06_rank_time", "q06_tokens_per_s"],
    "07_quantization": ["q07_int8_size"],
    "09_build_ddp": ["q09_average", "q09_buckets", "q09_shards", "q09_exposed"],
}
# The questions graded by hand in each notebook (notebook 05: Q4.1, Q4.2, Q6 and Q7 each have one).
MANUAL = {nb: [s.by_hand for s in sections_for(nb) if s.by_hand] for nb in QUESTIONS}
ALL = [(nb, q) for nb, qs in QUESTIONS.items() for q in qs]

# Code that trains, measures or launches (or reads what did): such a cell must carry otter_ignore.
EXPERIMENT_CALLS = re.compile(r"start\(PROFILE\)|\.run_|lab\.store|\brecords\b|\bresult\b|\bsettings\b")


@pytest.fixture(scope="module")
def masters():
    return {nb: nbs.parse_master(LABS / f"{nb}.ipynb") for nb in QUESTIONS}


@pytest.fixture(scope="module")
def specs(masters):
    """Every case with the answer the build computes (the master's solution) and the mistakes'."""
    return {q.name: build.exercise_spec(m, q) for m in masters.values() for q in m.questions if not q.manual}


def solution(masters, notebook: str, name: str):
    q = masters[notebook].question(name)
    ns: dict = {}
    exec(compile(q.solution, f"<{name} solution>", "exec"), ns)
    return ns[EXERCISES[name].function]


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("notebook", list(QUESTIONS))
def test_notebook_has_its_questions_and_config(masters, notebook):
    nb = nbformat.read(LABS / f"{notebook}.ipynb", as_version=4)
    configs = [c for c in nb.cells if c.cell_type == "raw" and c.source.startswith("# ASSIGNMENT CONFIG")]
    assert len(configs) == 1 and f"name: {notebook}" in configs[0].source
    m = masters[notebook]
    assert sorted(q.name for q in m.questions) == sorted(QUESTIONS[notebook] + MANUAL[notebook])
    assert f"q{notebook[:2]}_report" in MANUAL[notebook]
    for name in MANUAL[notebook]:
        report = m.question(name)
        assert report.manual and report.points > 0, name
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "otter_ignore" not in params[0].metadata.get("tags", [])


@pytest.mark.parametrize("notebook", list(QUESTIONS))
def test_experiment_cells_are_ignored_by_grading(notebook):
    nb = nbformat.read(LABS / f"{notebook}.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        if EXPERIMENT_CALLS.search(cell.source) and "BEGIN SOLUTION" not in cell.source \
                and "check(" not in cell.source:
            assert "otter_ignore" in cell.metadata.get("tags", []), cell.source[:200]


def test_every_question_has_an_exercise_and_every_exercise_a_question():
    assert sorted(EXERCISES) == sorted(q for _, q in ALL)


@pytest.mark.parametrize("notebook,name", ALL)
def test_test_cells_public_then_hidden_and_points_as_titled(masters, notebook, name):
    q = masters[notebook].question(name)
    hidden = [t.hidden for t in q.tests]
    assert hidden[0] is False and any(hidden), hidden
    assert all(t.points == 0 for t in q.tests if not t.hidden) and q.points > 0
    for t in q.tests:
        call = nbs.parse_check(t.source)
        assert (call.question, call.function) == (name, EXERCISES[name].function)
    nb = nbformat.read(LABS / f"{notebook}.ipynb", as_version=4)
    cells = [c.source for c in nb.cells]
    start = next(i for i, s in enumerate(cells) if f"name: {name}" in s)
    heading = next(s for s in reversed(cells[:start]) if "autograded" in s)
    titled = re.search(r"\(autograded, (\d+) points?\)", heading)
    assert titled and int(titled.group(1)) == q.points, (heading[:80], q.points)


# --------------------------------------------------------------------------- the solution vs the lab


def _check_q01(f):
    from lab_utils.app.grading import FakeAsyncDevice

    for queued, work, launch in ((0.5, 2.0, 1e-4), (0.0, 0.75, 3e-3), (7.0, 12.5, 0.0)):
        dev = FakeAsyncDevice(queued_seconds=queued, launch_seconds=launch)
        assert math.isclose(f(dev.step_fn(work), dev.sync, dev.clock), launch + work) and dev.steps == 1


def _check_q01_train_transform(f):
    """The lab's loaders' pipeline (lab_utils.experiments.shared.data.train_transform) in the assignment's
    order, and the solution's: the same transforms with the same values and the same images from every crop
    and flip."""
    from lab_utils.app.grading.exercises import batch_sweep as E
    from lab_utils.experiments.shared import data

    mine, lab = f(), data.train_transform()
    assert [type(t).__name__ for t in lab.transforms] == ["RandomCrop", "RandomHorizontalFlip", "ToTensor",
                                                         "Normalize"]   # SPEC.md's order
    steps = dict(E._transform_steps(lab))
    assert E._transform_steps(mine) == E._transform_steps(lab)
    assert steps["RandomCrop"]["padding"] == [4] * 4 and steps["RandomCrop"]["size"] == [32, 32]
    assert steps["RandomHorizontalFlip"]["p"] == 0.5
    assert steps["Normalize"]["mean"] == list(data.CIFAR10_MEAN) == [0.4914, 0.4822, 0.4465]
    assert steps["Normalize"]["std"] == list(data.CIFAR10_STD) == [0.2023, 0.1994, 0.2010]
    for image in (0, 9, 17):
        out = E._transformed(mine, {"image": image})
        assert out == E._transformed(lab, {"image": image}) and out["shape"] == [3, 32, 32]
        assert out["distinct"] == E.DRAWS == 162   # 9 x 9 crop offsets, flipped or not


def _check_q01_peak_memory(f):
    """The solution against the lab's own line
    (lab_utils.experiments.n01_batch_sweep.experiment.predict_peak_memory) on the quick model's counted
    peaks (21,271,288 B at 32, 78,705,400 B at 128: 598,272 B per image) and a GPU's."""
    from lab_utils.experiments.n01_batch_sweep.experiment import predict_peak_memory

    for case in ((32, 21_271_288, 128, 78_705_400, 512, 450_000_000),
                 (32, 523_000_000, 128, 1_413_000_000, 8192, 80e9), (128, 4e9, 512, 9e9, 2048, 16e9)):
        mine, lab = f(*case), predict_peak_memory(*case)
        assert math.isclose(mine[0], lab[0], rel_tol=1e-12) and mine[1] == lab[1], case
    assert f(32, 21_271_288, 128, 78_705_400, 512, 450_000_000) == (308_441_848, 748)   # quick: 512


def _check_q02(f):
    from lab_utils.experiments.n02_scaling import tables as scaling_tables
    from lab_utils.experiments.shared.anchors import (
        FIRST_COHORT_LABEL,
        FIRST_COHORT_TABLE1_SECONDS,
        OTHER_COHORT_LABEL,
    )

    frame = scaling_tables.anchor_frame()
    assert set(frame["method"]) == {FIRST_COHORT_LABEL, OTHER_COHORT_LABEL}
    first = frame.query("gpus > 1 and method == @FIRST_COHORT_LABEL")
    assert len(first) == 6
    for r in first.itertuples():
        s, e = f(FIRST_COHORT_TABLE1_SECONDS[(1, r.per_gpu_batch)], r.epoch2_seconds, r.gpus)
        assert math.isclose(s, r.speedup, rel_tol=1e-9) and math.isclose(e, r.efficiency, rel_tol=1e-9)


def _check_q03(f):
    from lab_utils.experiments.shared.anchors import FIRST_COHORT_TABLE1_SECONDS as A
    from lab_utils.learn.comm_probe import derived_comm

    for t1, tn, n in ((A[(1, 128)], A[(2, 128)], 2), (A[(1, 32)], A[(4, 32)], 4), (2233.5, 1095.7, 2),
                      (10.0, 10.0, 1), (90.0, 2.0, 64)):
        mine, lab = f(t1, tn, n), derived_comm(t1, tn, n)
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(mine, lab, strict=True))


def _check_q02_predict_epoch(f):
    from lab_utils.learn.scaling_model import AllReduceLine, predicted_epoch_seconds

    line = AllReduceLine(4, 60e-6, 10 / 1.5)
    for case in ((0.02642, 782, 44_695_848, 50e-6, 10.0), (0.1, 49, 262_144, 0.0, 1.0),
                 (0.5, 1, 0, 1e-3, 3.0),
                 (0.08604, 98, 26_214_400, line.latency_seconds, line.bandwidth_gb_per_s)):
        assert math.isclose(f(*case), predicted_epoch_seconds(*case), rel_tol=1e-12)


def _check_q03_predict_comm(f):
    from lab_utils.learn.scaling_model import predicted_comm_seconds

    for case in (([1e6, 3e6], 1e-4, 2.0, 10), ([26_268_672, 18_427_176], 60e-6, 6.67, 196),
                 ([705_608], 0.0, 0.5, 1), ([1_049_600, 26_215_424, 17_430_824], 2e-5, 100.0, 49)):
        mine, lab = f(*case), predicted_comm_seconds(*case)
        assert all(math.isclose(a, b, rel_tol=1e-12) for a, b in zip(mine, lab, strict=True))


def _check_q04_gradient_bytes(f):
    import torch

    from lab_utils.experiments.n04_allreduce import experiment as comm
    from lab_utils.learn.models import ResNet18

    for m in (ResNet18(), ResNet18(width=4).to(torch.float64), ResNet18(width=8).half()):
        assert f(m) == comm.gradient_bytes(m)
    assert f(ResNet18()) == 44_695_848


def _check_q04_ring_bytes(f):
    from lab_utils.experiments.n04_allreduce import experiment as comm

    for s in (44_695_848, 1, 12_345_679):
        for p in (1, 2, 3, 4, 7, 8, 1024):
            for n, b in ((50_000, 128), (50_000, 32), (1001, 7)):
                assert math.isclose(f(s, p, n, b), comm.ring_bytes_per_epoch(s, p, n, b), rel_tol=1e-12)


def _check_q04_utilization(f):
    """Table 3's own rows (comm_table3.utilization_rows, which calls lab_utils.learn.ring.achieved_gb_per_s);
    by hand: 2 x 128 on CIFAR-10, 196 steps x 1.0 x 44,695,848 B = 8,760,386,208 B / 1.07 s = 8.1873 GB/s."""
    from lab_utils.experiments.n04_allreduce import table3 as comm_table3

    for n, b, t in ((2, 128, 1.07), (4, 512, 0.51), (8, 32, 3e-3), (3, 100, 2.0)):
        m = comm_table3.CommMeasurement(devices=n, per_device_batch=b, source="(c) hook all-reduce",
                                        seconds=t, grad_bytes=44_695_848, dataset_size=50_000)
        row = comm_table3.utilization_rows([m], None)[0]
        got = f(row["grad_bytes"], n, row["steps_per_epoch"], t)
        assert math.isclose(got, row["achieved_gb_per_s"], rel_tol=1e-12)
    assert math.isclose(f(44_695_848, 2, 196, 1.07), 196 * 44_695_848 / 1.07 / 1e9, rel_tol=1e-12)
    assert round(f(44_695_848, 2, 196, 1.07), 4) == 8.1873


def _check_q04_predicted_bandwidth(f):
    """The lab's model (lab_utils.learn.ring.predicted_allreduce_gb_per_s, the prediction table's reference);
    by hand: 1e6 and 3e6 B on 4 ranks, alpha 10 us, B 2 GB/s: 6e6 B sent in 60 + 750 + 60 + 2250 us."""
    from lab_utils.experiments.n04_allreduce import tables as comm_tables
    from lab_utils.learn import ring
    from lab_utils.learn.models import ResNet18

    buckets = comm_tables.ddp_bucket_sizes(ResNet18())
    for b in (buckets, [705_608], [1, 2, 3], [4096] * 10):
        for p, a, bw in ((2, 1e-5, 100.0), (4, 3e-5, 2.0), (8, 0.0, 10.0), (1024, 1e-6, 400.0)):
            assert math.isclose(f(b, p, a, bw), ring.predicted_allreduce_gb_per_s(b, p, a, bw), rel_tol=1e-12)
    assert math.isclose(f([1e6, 3e6], 4, 10e-6, 2.0), 6e6 / 3120e-6 / 1e9, rel_tol=1e-12)


def _check_q05_recipe(f):
    """The lab's recipe (lab_utils.learn.schedules.linear_scaling_recipe, which the DDP worker's schedule
    follows); by hand: the assignment's 4 x 512 from 0.1 at 128 with 2 warm-up epochs of 25 steps."""
    from lab_utils.learn import schedules

    for case in ((0.1, 128, 512, 4, 50_000, 2.0), (0.00625, 8, 32, 4, 1_536, 0.5),
                 (0.1, 128, 128, 1, 50_000, 0.0), (0.2, 256, 64, 16, 1_281_167, 5.0),
                 (0.05, 64, 32, 8, 9_800, 1.3)):
        lr, steps = f(*case)
        want = schedules.linear_scaling_recipe(*case)
        assert math.isclose(lr, want[0], rel_tol=1e-12) and steps == want[1]
    assert tuple(f(0.1, 128, 512, 4, 50_000, 2.0)) == (1.6, 50)


def _check_q05_lr_schedule(f):
    from lab_utils.learn import schedules

    for base, gb, bb, w in ((0.1, 2048, 128, 100), (0.1, 2048, 128, 0), (0.02, 96, 32, 5)):
        ref = schedules.make_schedule(base, "linear", gb, bb, steps_per_epoch=max(w, 1), epochs=3,
                                      warmup_epochs=1 if w else 0)
        assert ref.warmup_steps == w
        for step in range(0, 3 * max(w, 1)):
            assert math.isclose(f(step, base, gb, bb, w), ref.lr_at(step), rel_tol=1e-12)


def _check_q05_set_epoch(f):
    from torch.utils.data.distributed import DistributedSampler

    from lab_utils.experiments.n05_large_batch import experiment as lb

    for n, p, r, e, seed in ((16, 2, 0, 2, 0), (16, 2, 1, 3, 0), (33, 4, 2, 2, 5)):
        got = f(DistributedSampler(range(n), num_replicas=p, rank=r, shuffle=True, seed=seed), e)
        assert [list(o) for o in got] == lb.sampler_epoch_orders(n, p, r, e, call_set_epoch=True, seed=seed)
    assert got[0] != got[1]


def _check_q06_flops_per_token(f):
    from lab_utils.learn.models.gpt import GPTConfig
    from lab_utils.learn.models.gpt_sizes import gpt_config, train_flops_per_token

    for cfg in (gpt_config("tiny"), gpt_config("small"), gpt_config("small", vocab_size=200, block_size=512),
                GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)):
        assert f(cfg) == train_flops_per_token(cfg)


def _check_q06_mfu(f):
    from lab_utils.engine.hardware import peak_flops_per_s
    from lab_utils.learn.flops import mfu

    for fpt, tps, n, gpu, prec in ((6.1e7, 2.4e6, 4, "NVIDIA H100 80GB HBM3", "bf16"),
                                   (8.5e8, 3.0e5, 8, "NVIDIA A100-SXM4-40GB", "bf16"),
                                   (1.0e6, 1.0e4, 1, "NVIDIA H100 PCIe", "tf32")):
        by_hand = fpt * tps / (n * peak_flops_per_s(gpu, prec))
        assert math.isclose(f(fpt, tps, peak_flops_per_s(gpu, prec), n), by_hand, rel_tol=1e-12)
        assert math.isclose(f(fpt, tps, peak_flops_per_s(gpu, prec), n),
                            mfu(fpt, tps, peak_flops_per_s(gpu, prec), n), rel_tol=1e-12)  # the worker's


def _check_q06_rank_time(f):
    """The slowest rank, as the lab's table of the earlier report takes it; its speedups (SPEC, Part 2)."""
    from lab_utils.experiments.n06_gpt_ddp import tables as gx
    from lab_utils.experiments.shared.anchors import GPT_RANK_SECONDS

    frame = gx.earlier_report_frame()
    for (b, n), ranks in GPT_RANK_SECONDS.items():
        row = frame[(frame["per-GPU batch"] == b) & (frame["GPUs"] == n)].iloc[0]
        assert f(list(ranks)) == row["slowest rank (s)"]
    ranks = GPT_RANK_SECONDS
    speedups = [round(f(list(ranks[(b, 1)])) / f(list(ranks[(b, n)])), 2) for b in (64, 128) for n in (2, 4)]
    assert speedups == [1.61, 2.68, 1.75, 2.95]


def _check_q06_tokens_per_s(f):
    """The lab's model (lab_utils.learn.flops.predicted_tokens_per_s, behind Exercise 06-d's table), and by
    hand: 0.30 s at batch 64 and 0.50 s at 128 (block 256) are 0.10 s fixed + 12.2 us per token, so 16 x 64
    micro-steps run at 4,096 tokens per 0.15 s = 27,306.7 tokens/s."""
    from lab_utils.learn.flops import predicted_tokens_per_s

    for b, t, m, e, block in (([64, 128], [0.30, 0.50], 16, 1024, 256), ([128, 32], [0.9, 0.3], 8, 512, 64),
                              ([2, 4], [0.002, 0.0031], 1, 8, 64), ([64, 128], [0.1, 0.18], 256, 256, 32)):
        case = {"batch_sizes": b, "step_seconds": t, "micro_batch": m, "effective_batch": e,
                "block_size": block}
        assert math.isclose(f(**case), predicted_tokens_per_s(**case), rel_tol=1e-12)
    assert math.isclose(f([64, 128], [0.30, 0.50], 16, 1024, 256), 4096 / 0.15, rel_tol=1e-12)


def _check_q07_int8_size(f):
    import torch

    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    if not Q.check_variant("torchao_int8_weight_only", "cpu").ok:
        pytest.skip("torchao int8 weight-only unavailable here")
    torch.manual_seed(0)
    for cfg in (gpt_config("tiny", vocab_size=65), gpt_config("tiny", vocab_size=50, n_layer=1, bias=False)):
        model = GPT(cfg)
        measured = Q.payload_bytes(Q.quantize_model(model, "torchao_int8_weight_only", "cpu").state_dict())
        assert f(model) == measured
        linears = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        assert f(model, keep_in_float=linears) == Q.payload_bytes(model.state_dict())  # all float: fp32 size


def _check_q09_average(f):
    """In 2 gloo ranks the solution leaves every rank what the lab's (a), handmade.Naive, does."""
    import torch

    from lab_utils.engine import fork_ranks
    from lab_utils.learn import handmade

    def ranks(rank, world):
        torch.manual_seed(rank)
        model = torch.nn.Linear(3, 2)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        grads = [p.grad.clone() for p in model.parameters()]
        handmade.Naive(model, torch.optim.SGD(model.parameters(), lr=0.1)).sync()
        return [a.tolist() for a in f(grads)], [p.grad.tolist() for p in model.parameters()]

    for mine, lab in fork_ranks.run_in_ranks(ranks, 2):
        assert mine == lab


def _check_q09_buckets(f):
    """The solution is the lab's (c) and torch's own rule (DDP's compute_bucket_assignment_by_size, given
    the parameters in ready order, last first): ResNet-18's 62 tensors at DDP's caps and others."""
    import torch.distributed as dist

    from lab_utils.learn.bucketing import assign_buckets
    from lab_utils.learn.models import ResNet18

    params = list(ResNet18(width=8).parameters())
    sizes = [p.numel() * p.element_size() for p in params]
    order = list(reversed(range(len(params))))
    for cap, first in ((16_000, 16_000), (419_430, 16_384), (10**9, 10**9), (1, 1)):
        torch_buckets, _ = dist._compute_bucket_assignment_by_size([params[i] for i in order], [first, cap],
                                                                   [False] * len(params), order)
        assert f(sizes, cap, first) == assign_buckets(sizes, cap, first) == [list(b) for b in torch_buckets]
        assert sorted(i for b in f(sizes, cap, first) for i in b) == list(range(62))


def _check_q09_shards(f):
    from lab_utils.learn.bucketing import shard_bounds

    for n, p in ((11_173_962, 4), (176_402, 4), (7, 3), (3, 5)):
        assert [tuple(b) for b in f(n, p)] == shard_bounds(n, p)
    assert [e - s for s, e in f(11_173_962, 4)] == [2_793_491, 2_793_491, 2_793_490, 2_793_490]  # by hand


def _check_q09_exposed(f):
    """The solution is the lab's model (traffic.overlap_exposed_seconds) on both sides of its kink, and
    a bucket as large as the gradient exposes one whole all-reduce (notebook 04's ring time)."""
    from lab_utils.learn import ring, traffic

    for b, s, p, a, bw, t in ((25e6, 100e6, 2, 5e-5, 1e10, 0.05), (1e6, 44_695_848, 4, 2e-5, 5e9, 0.01),
                              (3e5, 7e6, 8, 1e-6, 1e11, 1e-3), (7e6, 7e6, 2, 1e-4, 1e9, 0.0)):
        assert math.isclose(f(b, s, p, a, bw, t), traffic.overlap_exposed_seconds(b, s, p, a, bw, t),
                            rel_tol=1e-12)
    assert math.isclose(f(1e9, 1e8, 4, 1e-5, 1e10, 0.5), ring.ring_allreduce_seconds(1e8, 4, 1e-5, 1e10))


CHECKS = {
    "q01_step_timer": _check_q01, "q01_train_transform": _check_q01_train_transform,
    "q01_peak_memory": _check_q01_peak_memory,
    "q02_speedup": _check_q02, "q02_predict_epoch": _check_q02_predict_epoch,
    "q03_compute_comm": _check_q03, "q03_predict_comm": _check_q03_predict_comm,
    "q04_gradient_bytes": _check_q04_gradient_bytes, "q04_ring_bytes": _check_q04_ring_bytes,
    "q04_utilization": _check_q04_utilization, "q04_predicted_bandwidth": _check_q04_predicted_bandwidth,
    "q05_lr_schedule": _check_q05_lr_schedule, "q05_recipe": _check_q05_recipe,
    "q05_set_epoch": _check_q05_set_epoch, "q06_flops_per_token": _check_q06_flops_per_token,
    "q06_mfu": _check_q06_mfu, "q06_rank_time": _check_q06_rank_time,
    "q06_tokens_per_s": _check_q06_tokens_per_s, "q07_int8_size": _check_q07_int8_size,
    "q09_average": _check_q09_average, "q09_buckets": _check_q09_buckets, "q09_shards": _check_q09_shards,
    "q09_exposed": _check_q09_exposed,
}


def test_every_question_has_a_reference_check():
    assert sorted(CHECKS) == sorted(q for _, q in ALL)


@pytest.mark.parametrize("notebook,name", ALL)
def test_solution_agrees_with_the_lab(masters, notebook, name):
    CHECKS[name](solution(masters, notebook, name))


def test_known_values_of_the_built_answers(specs):
    """A few answers worked out by hand (SPEC): the bundle's expected values are these numbers."""
    first = {q: spec["tests"][0]["cases"] for q, spec in specs.items()}
    assert first["q04_gradient_bytes"][0]["expected"] == 44_695_848          # 11,173,962 x 4 bytes
    assert first["q04_ring_bytes"][0]["expected"] == 196 * 44_695_848        # ceil(25,000/128) x S on 2
    assert first["q04_ring_bytes"][1]["expected"] == 98 * 1.5 * 44_695_848   # 4 ranks: 2(P-1)/P = 1.5
    assert math.isclose(first["q02_speedup"][0]["expected"][0], 41.3 / 23.15)
    assert first["q03_compute_comm"][2]["expected"][1] < 0                   # super-linear: stays negative
    assert same(first["q01_step_timer"][0]["expected"], {"seconds": 2.0001, "steps": 1})  # launch + work
    assert first["q06_rank_time"][1]["expected"] == 1384.64                  # the slower of the 2 ranks
    assert first["q06_rank_time"][2]["expected"] == 12.7                     # not rank 0's time


def _cases(specs, name):
    return [c["case"] for t in specs[name]["tests"] for c in t["cases"]]


def test_cohort_anchors_in_the_cases_are_the_published_ones(specs):
    """The earlier cohort's 1-GPU times in the exercises are its published 33.64 / 33.95 s
    (lab_utils.experiments.shared.anchors), never the rounded 33.6 / 34.0 (issue 24, items 3 and 5)."""
    from lab_utils.experiments.shared.anchors import FIRST_COHORT_TABLE1_SECONDS as A

    assert (A[(1, 128)], A[(1, 512)]) == (33.64, 33.95)
    used = set()
    for name in ("q02_speedup", "q03_compute_comm"):
        for t1, tn, n in _cases(specs, name):
            assert t1 not in (33.6, 34.0), (name, t1, tn, n)
            for (gpus, b), t in A.items():
                if gpus == n and t == tn and gpus > 1:   # a cohort row: its T(1) is the published one
                    assert t1 == A[(1, b)], (name, t1, tn, n)
                    used.add((name, b))
    assert {("q02_speedup", 128), ("q02_speedup", 512), ("q03_compute_comm", 128),
            ("q03_compute_comm", 512)} <= used
    anchored = 0
    for nbytes, p, steps, seconds in _cases(specs, "q04_utilization"):
        for (n, b), tn in A.items():
            derived = tn - A[(1, b)] / n
            if n > 1 and (nbytes, p, steps) == (44_695_848, n, math.ceil(50_000 / (n * b))) \
                    and abs(seconds - derived) < 0.1:   # meant as the cohort's comm time (a)
                assert math.isclose(seconds, derived, rel_tol=1e-9), (nbytes, seconds, derived)
                anchored += 1
    assert anchored >= 4   # 2 x 128, 4 x 32 (public); 4 x 512, 2 x 32 (hidden)


def test_gpt_and_other_cohort_numbers_in_the_cases_are_the_published_ones(specs):
    """A case built from the GPT report or the other cohort holds their numbers exactly as
    lab_utils.experiments.shared.anchors has them (per-rank lists, the report's means, the global-batch-32
    times)."""
    from lab_utils.experiments.shared.anchors import (
        GPT_RANK_SECONDS,
        GPT_REPORTED_MEAN_SECONDS,
        OTHER_COHORT_SECONDS,
    )

    published = set(map(tuple, GPT_RANK_SECONDS.values()))
    rank_values = {t for times in published for t in times}
    ranked = [tuple(c[0]) for c in _cases(specs, "q06_rank_time") if set(c[0]) & rank_values]
    assert ranked and all(r in published for r in ranked), ranked
    assert len(ranked) == 5   # 1 x 64, 2 x 64 (public); 2 x 128, 4 x 64, 4 x 128 (hidden)
    gpt_one = {GPT_REPORTED_MEAN_SECONDS[(b, 1)]: b for b in (64, 128)}
    other_one = OTHER_COHORT_SECONDS[(1, 32)]
    used = 0
    for name in ("q02_speedup", "q03_compute_comm"):
        for t1, tn, n in _cases(specs, name):
            if t1 in gpt_one:
                assert tn == GPT_REPORTED_MEAN_SECONDS[(gpt_one[t1], n)], (name, t1, tn, n)
                used += 1
            elif t1 == other_one:
                assert tn == OTHER_COHORT_SECONDS[(n, 32)], (name, t1, tn, n)   # global batch 32
                used += 1
    assert used >= 4


def test_docstrings_give_units_and_inputs_not_the_formula(masters):
    """What a student sees of each exercise function (its docstring) names what it returns, never
    the arithmetic: no operator between terms (the old "bytes / seconds / 1e9")."""
    from otter.assign.solutions import replace_solutions

    for notebook, name in ALL:
        q = masters[notebook].question(name)
        student = "\n".join(replace_solutions(q.solution.split("\n"), "python"))
        fn = next(n for n in ast.walk(ast.parse(student))
                  if isinstance(n, ast.FunctionDef) and n.name == EXERCISES[name].function)
        doc = ast.get_docstring(fn)
        assert doc, name
        assert not re.search(r"\s[-+*/]\s|\*\*|\^|=", doc), (name, doc)


@pytest.mark.timeout(240)
def test_q07_table_shows_the_payload_the_exercise_predicts(masters):
    """Notebook 07's table has `payload_bytes` (the exercise's answer, measured) next to `size_bytes`
    (the torch.save file: larger by the zip container), and keeps its other columns."""
    import torch

    from lab_utils.engine import profiles
    from lab_utils.experiments.n07_quantization import experiment as Q
    from lab_utils.experiments.n07_quantization.tables import quantization_table
    from lab_utils.experiments.n07_quantization.worker import measure_device
    from lab_utils.learn.models.gpt import GPT
    from lab_utils.learn.models.gpt_sizes import gpt_config

    if not Q.check_variant("torchao_int8_weight_only", "cpu").ok:
        pytest.skip("torchao int8 weight-only unavailable here")
    torch.manual_seed(0)
    cfg = gpt_config("tiny", vocab_size=65)
    model = GPT(cfg)
    val = torch.randint(0, cfg.vocab_size, (600,))
    mut = Q.ModelUnderTest(model, val, cfg.block_size, dataset="random", synthetic=True)
    s = profiles.settings(Q.Settings, "quick", variants=("fp32", "torchao_int8_weight_only"),
                          devices=("cpu",), eval_tokens=256, prompt_tokens=4, new_tokens=2, cpu_large_batch=2,
                          warmup=0, repeats=1)
    recs = measure_device(mut, s.variants, "cpu", s.measure_key())   # the worker's rows (config: the plan's)
    for v, r in zip(s.variants, recs):
        r.config = {"variant": v, "device": "cpu"}
    table = quantization_table(recs).set_index("variant")
    cols = list(table.columns)
    assert cols[cols.index("size_bytes") + 1] == "payload_bytes" and "size_vs_fp32" in cols
    predict = solution(masters, "07_quantization", "q07_int8_size")
    int8, fp32 = table.loc["torchao_int8_weight_only"], table.loc["fp32"]
    assert int8["payload_bytes"] == predict(model) < int8["size_bytes"]
    linears = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
    assert fp32["payload_bytes"] == predict(model, keep_in_float=linears) < fp32["size_bytes"]  # all float


# --------------------------------------------------------------------------- mistakes and messages


@pytest.mark.parametrize("notebook,name", ALL)
def test_every_known_mistake_is_caught_publicly_and_cannot_score(specs, notebook, name):
    ex, spec = EXERCISES[name], specs[name]
    for i, m in enumerate(ex.mistakes):
        for hidden in (False, True):
            cases = [c for t in spec["tests"] if t["hidden"] == hidden for c in t["cases"]]
            caught = [c for c in cases if c["mistakes"][i] is not None
                      and not same(c["mistakes"][i], c["expected"], ex.rel_tol)]
            assert caught, f"{name}: no {'hidden' if hidden else 'public'} case catches '{m.name}'"
            c = caught[0]
            label = "hidden case 1 of 1" if hidden else ex.describe(c["case"])
            msg = explain(ex, c["case"], c["mistakes"][i], c["expected"], c["mistakes"], label, hidden)
            assert m.name in msg and m.why in msg, msg


@pytest.mark.parametrize("notebook,name", ALL)
def test_hidden_messages_never_show_the_inputs(specs, notebook, name):
    """A wrong answer on a hidden case is named (a known mistake, or how far off it is), inputs never."""
    ex = EXERCISES[name]
    fixed = " ".join(f"{m.name} {m.why}" for m in ex.mistakes)
    for t in specs[name]["tests"]:
        if not t["hidden"]:
            continue
        for k, c in enumerate(t["cases"]):
            wrong = [a for a in c["mistakes"] if a is not None and not same(a, c["expected"])]
            for got in wrong + [_perturbed(c["expected"])]:
                msg = explain(ex, c["case"], got, c["expected"], c["mistakes"], f"hidden case {k + 1}", True)
                assert msg.startswith(f"hidden case {k + 1}") and msg
                for value in _leaves(c["case"]):
                    if isinstance(value, str) or abs(value) >= 10:
                        shown = {str(value)} if isinstance(value, str) else {str(value), f"{value:,}"}
                        for v in shown:
                            word = rf"(?<![\w.]){re.escape(v)}(?![\w.])"
                            if not re.search(word, fixed):   # "12 L C T" is the formula, not an input
                                assert not re.search(word, msg), (msg, c["case"])


def _leaves(x):
    if isinstance(x, dict):
        return [v for item in x.values() for v in _leaves(item)]
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _leaves(item)]
    return [x] if isinstance(x, (int, float, str)) and not isinstance(x, bool) else []


def _perturbed(x):
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return x * 1.37 + 1
    if isinstance(x, list):
        return [_perturbed(v) for v in x]
    if isinstance(x, dict):
        return {k: _perturbed(v) for k, v in x.items()}
    return None if x else 1


# --------------------------------------------------------------------------- the student's side


def _student_function(masters, notebook: str, name: str):
    """The exercise's function as the student copy hands it out (blank, or a find-the-bug exercise's buggy
    body)."""
    ns: dict = {}
    exec(compile(build.handed_out(masters[notebook].question(name).solution), f"<{name}>", "exec"), ns)
    return ns[EXERCISES[name].function]


@pytest.mark.parametrize("notebook,name", ALL)
def test_blank_function_says_not_done_yet(masters, specs, notebook, name, capsys):
    """The check cell prints one line: "not done yet" for the blank function (for a find-the-bug exercise,
    the handed-out body: the name of its bug), "ok" for the solution."""
    q = masters[notebook].question(name)
    ns: dict = {}
    exec(compile(build.handed_out(q.solution), f"<{name}>", "exec"), ns)
    public = [t for t in specs[name]["tests"] if not t["hidden"]][0]
    cases = [c["case"] for c in public["cases"]]
    check(name, ns[EXERCISES[name].function], cases, [c["expected"] for c in public["cases"]])
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    if EXERCISES[name].find_the_bug:
        assert any(f": {m.name}: " in out for m in EXERCISES[name].mistakes), out
    else:
        assert out.startswith("not done yet"), out
    check(name, solution(masters, notebook, name), cases, [c["expected"] for c in public["cases"]])
    assert capsys.readouterr().out == "ok\n"


@pytest.mark.parametrize("notebook,name", ALL)
def test_hidden_cases_reject_the_public_answers(masters, specs, notebook, name):
    """A function that returns the public answers (a lookup, whatever it is asked) fails a hidden cell."""
    ex, spec = EXERCISES[name], specs[name]
    public = [c for t in spec["tests"] if not t["hidden"] for c in t["cases"]]
    answers = [c["expected"] for c in public]

    def hard_coded(*args, **kwargs):
        return answers[hard_coded.calls % len(answers)]

    for t in spec["tests"]:
        if t["hidden"]:
            hard_coded.calls = 0
            failed = False
            for c in t["cases"]:
                got = ex.run(hard_coded, c["case"])
                hard_coded.calls += 1
                failed |= not same(got, c["expected"], ex.rel_tol)
            if failed:
                return
    pytest.fail(f"{name}: the public answers pass every hidden test cell")


def test_q09_ranks_time_out_before_the_graders_case_limit():
    """A deadlocked average_gradients must end inside _average_call ("timed out", its forked ranks
    killed), not at the grader's case alarm, which leaves them running: with room for forking them."""
    from lab_utils.app.grading import sandbox
    from lab_utils.app.grading.exercises import build_ddp

    assert 10.0 <= build_ddp.RANKS_TIMEOUT_S <= sandbox.Limits().case_seconds - 3.0


@pytest.mark.parametrize("notebook,name", ALL)
def test_a_find_the_bug_exercise_starts_from_one_known_mistake(masters, specs, notebook, name):
    """CONVENTIONS item 3: a find-the-bug exercise's student copy holds a live body (otter's PROMPT) that
    answers every case as one of its known mistakes does, and scores on no hidden case; the other
    exercises start blank (None)."""
    ex, fn = EXERCISES[name], _student_function(masters, notebook, name)
    cases = [(t["hidden"], c) for t in specs[name]["tests"] for c in t["cases"]]
    answers = [ex.run(fn, c["case"]) for _, c in cases]
    prompt = "# BEGIN PROMPT" in masters[notebook].question(name).solution
    assert ex.find_the_bug == prompt, name
    if not ex.find_the_bug:
        assert answers == [None] * len(cases)
        return
    which = {i for i in range(len(ex.mistakes))
             if all(same(a, c["mistakes"][i], ex.rel_tol) for a, (_, c) in zip(answers, cases))}
    assert which, f"{name}: the starting body is none of the known mistakes"
    assert not all(same(a, c["expected"], ex.rel_tol) for a, (hidden, c) in zip(answers, cases) if hidden)

