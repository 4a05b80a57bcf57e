"""The exercises of notebooks 03-07 (issue 17), checked without executing a notebook.

For every autograded question of these master notebooks (otter assign v7 format):

- the solution function, extracted from the notebook and exec'd, agrees with the lab's reference
  implementation on several values (the numbers the rest of the notebook uses);
- the question's own tests (public and hidden) pass on the solution;
- in the student edition (solution body replaced by ``...`` as otter does) the first public test
  fails with a "not done yet" message;
- a function that returns the public answer whatever it is asked (a hard-coded answer) fails the
  hidden tests: they use other values;
- public tests are worth 0 points, and the points add up to what the exercise's title says;
- cells that train, measure or launch are tagged ``otter_ignore``.
"""

from __future__ import annotations

import ast
import copy
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import pytest

LABS = Path(__file__).resolve().parent.parent / "labs"

QUESTIONS = {
    "03_compute_vs_communication": ["q03_compute_comm"],
    "04_allreduce_bandwidth": ["q04_gradient_bytes", "q04_ring_bytes", "q04_utilization"],
    "05_large_batch_training": ["q05_lr_schedule", "q05_set_epoch"],
    "06_gpt_ddp": ["q06_flops_per_token", "q06_mfu"],
    "07_quantization": ["q07_int8_size"],
}
MANUAL = {nb: f"q{nb[:2]}_report" for nb in QUESTIONS}
ALL = [(nb, q) for nb, qs in QUESTIONS.items() for q in qs]

# Code that trains, measures or launches (or reads what did): such a cell must carry otter_ignore.
EXPERIMENT_CALLS = re.compile(r"start\(PROFILE\)|\.run_|lab\.store|\brecords\b|\bresult\b|\bsettings\b")


@dataclass
class Question:
    name: str
    config: dict
    prompt: str = ""
    title: str = ""
    solution: str = ""
    tests: list[tuple[bool, str]] = field(default_factory=list)

    @property
    def function_name(self) -> str:
        defs = [n.name for n in ast.parse(self.solution).body if isinstance(n, ast.FunctionDef)]
        assert len(defs) == 1, f"{self.name}: the solution cell defines {defs}, want one function"
        return defs[0]


def _yaml(text: str) -> dict:
    import yaml

    return yaml.safe_load("\n".join(text.splitlines()[1:])) or {}


def parse(notebook: str) -> tuple[nbformat.NotebookNode, dict[str, Question]]:
    nb = nbformat.read(LABS / f"{notebook}.ipynb", as_version=4)
    questions: dict[str, Question] = {}
    q, block, previous_md = None, None, ""
    for cell in nb.cells:
        src = cell.source
        if cell.cell_type == "raw":
            head = src.strip().splitlines()[0] if src.strip() else ""
            if head.startswith("# BEGIN QUESTION"):
                cfg = _yaml(src)
                q = questions.setdefault(cfg["name"], Question(cfg["name"], cfg, title=previous_md))
            elif head.startswith("# END QUESTION"):
                q = None
            elif head.startswith("# BEGIN "):
                block = head.split()[2]
            elif head.startswith("# END "):
                block = None
            continue
        if q is None:
            if cell.cell_type == "markdown":
                previous_md = src
            continue
        if block == "TESTS":
            first = src.lstrip().splitlines()[0]
            hidden = first.startswith("#") and bool(re.search(r"\bhidden\b", first, re.IGNORECASE))
            q.tests.append((hidden, src))
        elif block == "SOLUTION" and cell.cell_type == "code":
            q.solution = src
        elif block is None and cell.cell_type == "markdown":
            q.prompt = src
    return nb, questions


@pytest.fixture(scope="module")
def parsed():
    return {nb: parse(nb) for nb in QUESTIONS}


def solution_namespace(q: Question) -> dict:
    ns: dict = {}
    exec(compile(q.solution, f"<{q.name} solution>", "exec"), ns)
    return ns


def run_tests(q: Question, ns: dict, which: str = "all") -> None:
    for hidden, src in q.tests:
        if which == "all" or (which == "hidden") == hidden:
            exec(compile(src, f"<{q.name} {'hidden' if hidden else 'public'} test>", "exec"), ns)


def student_source(q: Question) -> str:
    from otter.assign.solutions import replace_solutions

    return "\n".join(replace_solutions(q.solution.split("\n"), "python"))


# --------------------------------------------------------------------------- structure


@pytest.mark.parametrize("notebook", list(QUESTIONS))
def test_notebook_has_its_questions_and_config(parsed, notebook):
    nb, questions = parsed[notebook]
    configs = [c for c in nb.cells if c.cell_type == "raw" and c.source.startswith("# ASSIGNMENT CONFIG")]
    assert len(configs) == 1
    assert _yaml(configs[0].source)["name"] == notebook
    assert sorted(questions) == sorted(QUESTIONS[notebook] + [MANUAL[notebook]])
    report = questions[MANUAL[notebook]]
    assert report.config.get("manual") is True and report.config.get("points", 0) > 0
    assert "graded by hand" in report.prompt
    params = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(params) == 1 and "otter_ignore" not in params[0].metadata.get("tags", [])


@pytest.mark.parametrize("notebook", list(QUESTIONS))
def test_experiment_cells_are_ignored_by_grading(parsed, notebook):
    nb, _ = parsed[notebook]
    for cell in nb.cells:
        if cell.cell_type != "code" or "parameters" in cell.metadata.get("tags", []):
            continue
        if EXPERIMENT_CALLS.search(cell.source) and "BEGIN SOLUTION" not in cell.source \
                and "assert" not in cell.source:
            assert "otter_ignore" in cell.metadata.get("tags", []), cell.source[:200]


@pytest.mark.parametrize("notebook,name", ALL)
def test_points_public_zero_and_total_as_titled(parsed, notebook, name):
    q = parsed[notebook][1][name]
    points = q.config["points"]
    assert isinstance(points, list) and len(points) == len(q.tests)
    assert [h for h, _ in q.tests].count(False) >= 2 and any(h for h, _ in q.tests)
    assert all(p == 0 for (hidden, _), p in zip(q.tests, points, strict=True) if not hidden)
    titled = re.search(r"\(autograded, (\d+) points?\)", q.title)
    assert titled and int(titled.group(1)) == sum(points), (q.title[:80], points)


# --------------------------------------------------------------------------- the solution vs the lab


def _check_q03(f):
    from lab_utils.core.comm_hooks import derived_comm

    for t1, tn, n in ((33.6, 17.87, 2), (41.3, 11.65, 4), (2233.5, 1095.7, 2), (10.0, 10.0, 1),
                      (90.0, 2.0, 64)):
        mine, lab = f(t1, tn, n), derived_comm(t1, tn, n)
        assert all(math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-12) for a, b in zip(mine, lab, strict=True))


def _check_q04_gradient_bytes(f):
    import torch

    from lab_utils.experiments import comm
    from lab_utils.models import ResNet18

    for m in (ResNet18(), ResNet18(width=4).to(torch.float64), ResNet18(width=8).half()):
        assert f(m) == comm.gradient_bytes(m)
    assert f(ResNet18()) == 44_695_848


def _check_q04_ring_bytes(f):
    from lab_utils.experiments import comm

    for s in (44_695_848, 1, 12_345_679):
        for p in (1, 2, 3, 4, 7, 8, 1024):
            for n, b in ((50_000, 128), (50_000, 32), (1001, 7)):
                assert math.isclose(f(s, p, n, b), comm.ring_bytes_per_epoch(s, p, n, b), rel_tol=1e-12)


def _check_q04_utilization(f):
    from lab_utils.experiments import comm

    for n, b, t in ((2, 128, 1.07), (4, 512, 0.51), (8, 32, 3e-3)):
        m = comm.CommMeasurement(devices=n, per_device_batch=b, source="(c) hook all-reduce", seconds=t,
                                 grad_bytes=44_695_848, dataset_size=50_000)
        row = comm.utilization_rows([m], None)[0]
        assert math.isclose(f(row["bytes_per_rank_per_epoch"], t), row["achieved_gb_per_s"], rel_tol=1e-12)


def _check_q05_lr_schedule(f):
    from lab_utils.core import schedules

    for base, gb, bb, w in ((0.1, 2048, 128, 100), (0.1, 2048, 128, 0), (0.02, 96, 32, 5)):
        ref = schedules.make_schedule(base, "linear", gb, bb, steps_per_epoch=max(w, 1), epochs=3,
                                      warmup_epochs=1 if w else 0)
        assert ref.warmup_steps == w
        for step in range(0, 3 * max(w, 1)):
            assert math.isclose(f(step, base, gb, bb, w), ref.lr_at(step), rel_tol=1e-12)


def _check_q05_set_epoch(f):
    from torch.utils.data.distributed import DistributedSampler

    from lab_utils.experiments import large_batch as lb

    for n, p, r, e, seed in ((16, 2, 0, 2, 0), (16, 2, 1, 3, 0), (33, 4, 2, 2, 5)):
        got = f(DistributedSampler(range(n), num_replicas=p, rank=r, shuffle=True, seed=seed), e)
        assert [list(o) for o in got] == lb.sampler_epoch_orders(n, p, r, e, call_set_epoch=True, seed=seed)
    assert got[0] != got[1]


def _check_q06_flops_per_token(f):
    from lab_utils.models.gpt import GPTConfig, gpt_config, train_flops_per_token

    for cfg in (gpt_config("tiny"), gpt_config("small"), gpt_config("small", vocab_size=200, block_size=512),
                GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)):
        assert f(cfg) == train_flops_per_token(cfg)


def _check_q06_mfu(f):
    from lab_utils.core.hardware import fraction_of_peak, peak_flops_per_s

    for fpt, tps, n, gpu, prec in ((6.1e7, 2.4e6, 4, "NVIDIA H100 80GB HBM3", "bf16"),
                                   (8.5e8, 3.0e5, 8, "NVIDIA A100-SXM4-40GB", "bf16"),
                                   (1.0e6, 1.0e4, 1, "NVIDIA H100 PCIe", "tf32")):
        lab = fraction_of_peak(fpt * tps / n, gpu, prec)
        assert math.isclose(f(fpt, tps, peak_flops_per_s(gpu, prec), n), lab, rel_tol=1e-12)


def _check_q07_int8_size(f):
    import torch

    from lab_utils.experiments import quantize as Q
    from lab_utils.models.gpt import GPT, gpt_config

    if not Q.check_variant("torchao_int8_weight_only", "cpu").ok:
        pytest.skip("torchao int8 weight-only unavailable here")
    torch.manual_seed(0)
    for cfg in (gpt_config("tiny", vocab_size=65), gpt_config("tiny", vocab_size=50, n_layer=1, bias=False)):
        model = GPT(cfg)
        measured = Q.payload_bytes(Q.quantize_model(model, "torchao_int8_weight_only", "cpu").state_dict())
        assert f(model) == measured
        linears = tuple(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear))
        assert f(model, keep_in_float=linears) == Q.payload_bytes(model.state_dict())  # all float: fp32 size


CHECKS = {
    "q03_compute_comm": _check_q03, "q04_gradient_bytes": _check_q04_gradient_bytes,
    "q04_ring_bytes": _check_q04_ring_bytes, "q04_utilization": _check_q04_utilization,
    "q05_lr_schedule": _check_q05_lr_schedule, "q05_set_epoch": _check_q05_set_epoch,
    "q06_flops_per_token": _check_q06_flops_per_token, "q06_mfu": _check_q06_mfu,
    "q07_int8_size": _check_q07_int8_size,
}


def test_every_question_has_a_reference_check():
    assert sorted(CHECKS) == sorted(q for _, q in ALL)


@pytest.mark.parametrize("notebook,name", ALL)
def test_solution_agrees_with_the_lab(parsed, notebook, name):
    q = parsed[notebook][1][name]
    CHECKS[name](solution_namespace(q)[q.function_name])


@pytest.mark.parametrize("notebook,name", ALL)
def test_solution_passes_its_public_and_hidden_tests(parsed, notebook, name):
    q = parsed[notebook][1][name]
    run_tests(q, solution_namespace(q))


# --------------------------------------------------------------------------- the student's side


@pytest.mark.parametrize("notebook,name", ALL)
def test_student_edition_says_not_done_yet(parsed, notebook, name):
    q = parsed[notebook][1][name]
    student = student_source(q)
    assert "BEGIN SOLUTION" not in student and "..." in student
    ns: dict = {}
    exec(compile(student, f"<{name} student>", "exec"), ns)
    public = [src for hidden, src in q.tests if not hidden]
    with pytest.raises(AssertionError, match="not done yet"):
        exec(compile(public[0], f"<{name} first public test>", "exec"), ns)


@pytest.mark.parametrize("notebook,name", ALL)
def test_hidden_tests_reject_the_public_answer(parsed, notebook, name):
    """A function that returns whatever the public tests wanted, for any input, fails the hidden tests."""
    q = parsed[notebook][1][name]
    ns = solution_namespace(q)
    fn, answers = ns[q.function_name], []

    def recording(*args, **kwargs):
        answers.append(copy.deepcopy(out := fn(*args, **kwargs)))
        return out

    ns[q.function_name] = recording
    run_tests(q, ns, "public")
    assert answers, f"{name}: the public tests never call {q.function_name}"
    public_answer = answers[-1]
    ns[q.function_name] = lambda *args, **kwargs: copy.deepcopy(public_answer)
    with pytest.raises(AssertionError):
        run_tests(q, ns, "hidden")
