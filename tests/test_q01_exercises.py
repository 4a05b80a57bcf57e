"""Notebook 01's exercises beyond tests/test_exercises.py: every order of 01-b's transforms judged by what it
outputs (issue 52, A5), 01-c's reference and its prediction table by hand (issue 48, item 2), the
alternative answers in tests/alternatives/, and 01-b's accepted orders end to end through `make student`
and `make grade`.
"""

from __future__ import annotations

import csv
import itertools
import math
from pathlib import Path

import pytest
import torch

from lab_utils.app.grading import build, exercises
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.exercises import batch_sweep
from lab_utils.app.grading.exercises.answers import same
from lab_utils.app.grading.predict import NOT_DONE, prediction_table
from lab_utils.engine.store import Record, ResultStore
from lab_utils.experiments.n01_batch_sweep import experiment as sweep
from lab_utils.experiments.n01_batch_sweep import tables as sweep_tables
from lab_utils.learn.errors import LabError

REPO = Path(__file__).resolve().parent.parent
BOOK = "01_batch_size_sweep"
ALTERNATIVES = REPO / "tests" / "alternatives"
ORDER = ("crop", "flip", "tensor", "normalize")
MISTAKES = exercises.EXERCISES["q01_train_transform"].mistakes
RAND, RANDINT = torch.rand, torch.randint


@pytest.fixture(scope="module")
def specs():
    """Every case of notebook 01's exercises with the master solution's answer (as `make student` builds)."""
    master = nbs.parse_master(REPO / "labs" / f"{BOOK}.ipynb")
    return {q.name: build.exercise_spec(master, q) for q in master.questions if not q.manual}


def _verdicts(specs, question: str, fn) -> list[str]:
    """The check's sentence ("" = right) on every test cell of ``question``, public first."""
    return [exercises.verdict(question, fn, [c["case"] for c in t["cases"]],
                              [c["expected"] for c in t["cases"]], hidden=t["hidden"])
            for t in specs[question]["tests"]]


# --------------------------------------------------------------------------- 01-b: which orders are right


def _works(order) -> bool:
    """The orders that make the assignment's images: ToTensor and the crop (its padding) before Normalize."""
    return order.index("tensor") < order.index("normalize") and order.index("crop") < order.index("normalize")


def test_every_order_whose_images_are_the_assignments_earns_the_points(specs):
    """Issue 52, A5: of the 24 orders, the 8 with ToTensor and the crop before Normalize (the assignment's,
    ToTensor first, the flip before the crop, Normalize before the flip, ...) pass the public check and
    every hidden cell; the 12 with Normalize before ToTensor are named as the crash; the 4 with Normalize
    after ToTensor but before the crop are named by the mean-colour padding. The old grader gave the
    ToTensor-first order 1 of 2 points (the hidden "describe" case)."""
    accepted, named = [], {}
    for order in itertools.permutations(ORDER):
        sentences = _verdicts(specs, "q01_train_transform", lambda o=order: batch_sweep._pipeline(o))
        if sentences == ["", "", ""]:
            accepted.append(order)
            continue
        assert all(sentences), (order, sentences)   # wrong everywhere, public check included
        mistake = next(m.name for m in MISTAKES if m.name in sentences[0])
        named.setdefault(mistake, []).append(order)
        assert all(mistake in s for s in sentences), (order, sentences)
    assert sorted(accepted) == sorted(o for o in itertools.permutations(ORDER) if _works(o))
    assert len(accepted) == 8 and ("tensor", "crop", "flip", "normalize") in accepted
    assert ("flip", "crop", "tensor", "normalize") in accepted   # the old "flip before crop" mistake
    assert {k: len(v) for k, v in named.items()} == {"Normalize before ToTensor": 12,
                                                     "Normalize before the crop": 4}
    assert all(o.index("normalize") < o.index("tensor") for o in named["Normalize before ToTensor"])
    assert "flip before crop" not in {m.name for m in MISTAKES}


def test_the_check_enumerates_every_crop_and_flip_draw_for_draw():
    """The draws of _EveryCropAndFlip: 162 calls give the 81 crop offsets with and without the flip, each
    once, whichever of the crop and the flip comes first; a flip probability other than 0.5 and torch's
    own random state afterwards are told apart / left alone."""
    from torchvision import transforms as T

    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    with batch_sweep._EveryCropAndFlip() as draws:
        offsets = [(int(draws.randint(0, 9, size=(1,))), int(draws.randint(0, 9, size=(1,))))
                   for _ in range(162)]
        flips = [bool(draws.rand(1) < 0.5) for _ in range(162)]
        assert torch.rand == draws.rand and torch.randint == draws.randint
    assert torch.rand(3).tolist() == before.tolist()   # restored, and nothing drawn from torch's generator
    assert sorted(set(zip(offsets, flips))) == sorted(((i, j), f) for i in range(9) for j in range(9)
                                                         for f in (False, True))
    crop, flip, tensor = T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor()
    a = batch_sweep._transformed(T.Compose([crop, flip, tensor]), {"image": 3})
    b = batch_sweep._transformed(T.Compose([flip, tensor, crop]), {"image": 3})
    c = batch_sweep._transformed(T.Compose([crop, T.RandomHorizontalFlip(0.3), tensor]), {"image": 3})
    assert a == b and a["distinct"] == 162
    assert not same(a, c, 1e-6)
    normalize_first = T.Compose([T.Normalize((0.5,) * 3, (0.2,) * 3), T.ToTensor()])
    assert batch_sweep._transformed(normalize_first, {"image": 0}) == {"error": "TypeError"}
    assert torch.rand is RAND and torch.randint is RANDINT   # torch's own functions are back


def test_transforms_are_compared_as_what_they_do(specs):
    """padding=(4, 4) is padding=4, (32, 32) is 32, Normalize's inplace changes no value: accepted. A flip
    probability of 0.3 or ImageNet's mean is named, publicly."""
    from torchvision import transforms as T

    mean, std = [0.4914, 0.4822, 0.4465], [0.2023, 0.1994, 0.2010]
    spelled = T.Compose([T.RandomCrop((32, 32), padding=(4, 4)), T.RandomHorizontalFlip(p=0.5), T.ToTensor(),
                         T.Normalize(mean, std, inplace=True)])
    assert _verdicts(specs, "q01_train_transform", lambda: spelled) == ["", "", ""]
    p03 = T.Compose([T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(0.3), T.ToTensor(),
                     T.Normalize(mean, std)])
    sentence = _verdicts(specs, "q01_train_transform", lambda: p03)[0]
    assert "RandomHorizontalFlip has other values: p" in sentence
    imagenet = batch_sweep._pipeline(ORDER, mean=batch_sweep.IMAGENET_MEAN, std=batch_sweep.IMAGENET_STD)
    assert "ImageNet's mean and std" in _verdicts(specs, "q01_train_transform", lambda: imagenet)[0]


# --------------------------------------------------------------------------- 01-c: the memory line


def test_memory_line_by_hand():
    """The quick model's counted peaks: 21,271,288 B at 32 and 78,705,400 B at 128. Per image (78,705,400 -
    21,271,288) / 96 = 598,272 B; fixed 21,271,288 - 32 x 598,272 = 2,126,584 B; at 512: 2,126,584 + 512 x
    598,272 = 308,441,848 B (what the cap counted at 512); largest within 450 MB: (450,000,000 - 2,126,584)
    / 598,272 = 748.6 -> 748 (598,272 x 748 = 447,507,456 <= 447,873,416)."""
    line = sweep.memory_line(32, 21_271_288, 128, 78_705_400)
    assert (line.fixed_bytes, line.bytes_per_image) == (2_126_584, 598_272)
    assert sweep.predict_peak_memory(32, 21_271_288, 128, 78_705_400, 512, 450_000_000) == (308_441_848, 748)
    assert line.largest_batch(447_507_456 + 2_126_584) == 748
    assert line.largest_batch(447_507_455 + 2_126_584) == 747
    assert line.largest_batch(1_000_000) == 0   # the fixed part alone does not fit
    with pytest.raises(LabError, match=r"^The memory line needs two different batch sizes, got 32 twice; "):
        sweep.memory_line(32, 1e6, 32, 2e6)
    with pytest.raises(LabError, match=r"^The peak memory does not grow from batch 32 .* to 128 .*; check"):
        sweep.memory_line(32, 2e6, 128, 2e6)


def test_peak_memory_mistakes_are_named_and_the_alternative_passes(specs):
    """Each known mistake fails the public check by name; the master's and the alternative's pass all."""
    ex = exercises.EXERCISES["q01_peak_memory"]
    ns: dict = {}
    exec((ALTERNATIVES / "q01_peak_memory.py").read_text(), ns)
    assert _verdicts(specs, "q01_peak_memory", ns["predict_peak_memory"]) == ["", "", ""]
    for m in ex.mistakes:
        sentences = _verdicts(specs, "q01_peak_memory", m.wrong)
        assert m.name in sentences[0] and all(m.name in s for s in sentences), (m.name, sentences)
    half = _verdicts(specs, "q01_peak_memory", lambda *a: (sweep.predict_peak_memory(*a)[0], 748.5))
    assert "the largest batch is a whole number of images" in half[0]


@pytest.mark.parametrize("question", ["q01_step_timer", "q01_train_transform", "q01_peak_memory"])
def test_alternatives_earn_every_point(specs, question):
    """tests/alternatives/<question>.py (another order, another style) passes every public and hidden cell."""
    ns: dict = {}
    exec(compile((ALTERNATIVES / f"{question}.py").read_text(), question, "exec"), ns)
    assert _verdicts(specs, question, ns[exercises.EXERCISES[question].function]) == [""] * 3


def _rec(batch, status="ok", cpu=None, gpu=None, limit=450_000_000):
    metrics = {"cpu_cap_peak_step_bytes": cpu, "peak_memory_bytes": gpu, "memory_limit_bytes": limit,
               "train_seconds": 1.0} if status == "ok" else {}
    return Record("batch_sweep", {"batch_size": batch}, metrics, status=status, profile="quick")


def test_memory_prediction_table_by_hand(tmp_path):
    """The quick sweep's records (32, 128 counted; 512 counted 308,441,848 B; 1024 oom; 2048 skipped): the
    cases of 512 and above, the lab's line exact at 512 (0 %), the student's blank "not done yet", MB in the
    saved table, and the largest batch beside what the sweep found."""
    recs = [_rec(32, cpu=21_271_288), _rec(128, cpu=78_705_400), _rec(512, cpu=308_441_848),
            _rec(1024, "oom"), _rec(2048, "skipped")]
    cases, measured = sweep_tables.memory_cases(recs)
    assert [c["batch"] for c in cases] == [512, 1024, 2048] and measured == [308_441_848, None, None]
    assert cases[0] == {"batch_a": 32, "peak_a_bytes": 21_271_288, "batch_b": 128, "peak_b_bytes": 78_705_400,
                        "batch": 512, "limit_bytes": 450_000_000, "status": "ok"}

    def blank(batch_a, peak_a_bytes, batch_b, peak_b_bytes, batch, limit_bytes):
        return None

    def renamed(a, pa, b, pb, n, limit):   # other parameter names: called by position
        return sweep.predict_peak_memory(a, pa, b, pb, n, limit)

    for mine, shown in ((blank, NOT_DONE), (renamed, 308.441848)):
        table = prediction_table(sweep_tables.peak_of(mine), cases, measured, sweep_tables.peak_of(
            sweep.predict_peak_memory), show=("batch", "status"), unit="bytes")
        out = sweep_tables.save_memory_table(ResultStore("quick", root=tmp_path / "quick"), table, recs)
        assert list(out.columns) == ["batch", "status", "measured_mb", "lab_model_mb", "lab_model_error_pct",
                                     "your_prediction_mb", "your_error_pct"]
        row = out.iloc[0]
        assert row["measured_mb"] == pytest.approx(308.441848) and row["lab_model_error_pct"] == 0
        assert row["your_prediction_mb"] == pytest.approx(shown) if shown != NOT_DONE else \
            row["your_prediction_mb"] == NOT_DONE
        assert out.iloc[1]["lab_model_mb"] == pytest.approx((2_126_584 + 1024 * 598_272) / 1e6)
        assert math.isnan(out.iloc[1]["measured_mb"]) or out.iloc[1]["measured_mb"] is None
    saved = (tmp_path / "quick" / "tables" / "batch_sweep_memory.csv").read_text()
    assert next(csv.reader([saved.splitlines()[0]]))[1:] == list(out.columns)
    text = sweep_tables.largest_batch_text(renamed, recs)
    assert text == ("**Largest batch within 450 MB:** lab model 748, yours 748; the sweep: 512 fitted, 1024 "
                    "did not.")
    assert "yours not done yet" in sweep_tables.largest_batch_text(blank, recs)


def test_memory_prediction_says_why_when_it_cannot_be_made(tmp_path):
    """A GPU's peak wins over a CPU count; a CPU sweep without a cap (MEMORY_CAP_BYTES = 0) has no peaks:
    no cases, one row and one sentence saying why, the notebook goes on."""
    assert sweep_tables.measured_peak_bytes(_rec(32, cpu=5, gpu=7))[0] == 7
    recs = [_rec(32, limit=None), _rec(128, limit=None), _rec(512, limit=None)]
    assert sweep_tables.memory_cases(recs) == ([], [])
    out = sweep_tables.save_memory_table(ResultStore("quick", root=tmp_path / "quick"), prediction_table(
        None, [], [], sweep.predict_peak_memory), recs)
    assert len(out) == 1 and "MEMORY_CAP_BYTES > 0" in out.iloc[0]["status"]
    assert sweep_tables.largest_batch_text(sweep.predict_peak_memory, recs).startswith("No prediction table")


def test_the_gpu_limit_is_the_share_the_sweep_sets(fake_gpu):
    """On an 80 GiB (fake) GPU: no cap, all of it; memory_fraction 0.25, 20 GiB; a 10 GiB cap beside a 0.5
    fraction, the smaller: 10 GiB (the share _cap_gpu_memory gives torch)."""
    from lab_utils.experiments.n01_batch_sweep import worker

    fake_gpu(count=1)
    dev, gib = torch.device("cuda"), 2 ** 30
    assert worker._gpu_limit_bytes({"memory_fraction": None, "memory_cap_bytes": None}, dev) == 80 * gib
    assert worker._gpu_limit_bytes({"memory_fraction": 0.25, "memory_cap_bytes": None}, dev) == 20 * gib
    assert worker._gpu_limit_bytes({"memory_fraction": 0.5, "memory_cap_bytes": 10 * gib}, dev) == 10 * gib


# --------------------------------------------------------------------------- end to end
