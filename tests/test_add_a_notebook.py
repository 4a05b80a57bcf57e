"""The add-a-notebook recipe (lab_utils/experiments/README.md), followed in a copy of the lab from the
README's code blocks alone: its package, notebook and test file written, its one registry line added; the
copy then differs from the lab by exactly those (nothing else edited), and the measure command, the time
budget, doctor and the report's sections pick the new notebook up with no other change."""

from __future__ import annotations

import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "lab_utils" / "experiments" / "README.md"
COPIED = ("lab_utils", "labs", "tests")
IGNORED = shutil.ignore_patterns("__pycache__", ".pytest_cache")


def blocks() -> list[tuple[str, str, str]]:
    """The recipe's code blocks that say what to do with them: (what, path, code)."""
    text = RECIPE.read_text(encoding="utf-8")
    pattern = r"```python (new|registry|cell): (\S+)\n(.*?)```"
    return [(m.group(1), m.group(2), m.group(3)) for m in re.finditer(pattern, text, re.S)]


def follow_the_recipe(root: Path) -> None:
    """Apply every block to the copy at ``root``."""
    for what, rel, code in blocks():
        path = root / rel
        if what == "new":
            assert not path.exists(), f"{rel} is not new"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(code, encoding="utf-8")
        elif what == "registry":  # the import after the notebooks' imports, the entry at the end of NOTEBOOKS
            text = path.read_text(encoding="utf-8")
            imports, entry = code.rstrip().splitlines()
            last = list(re.finditer(r"^from lab_utils\.experiments\.n\d\d_\w+ import .*\n", text, re.M))[-1]
            text = f"{text[:last.end()]}{imports}\n{text[last.end():]}"
            head, sep, tail = text.partition("\nNOTEBOOKS: tuple[ModuleType, ...] = (\n")
            assert sep, "registry.py has no NOTEBOOKS tuple"
            body, close, rest = tail.partition("\n)\n")
            path.write_text(f"{head}{sep}{body}\n{entry}{close}{rest}", encoding="utf-8")
        elif what == "cell":
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 10 · Step time"),
                                                 nbformat.v4.new_code_cell(code.strip())])
            nbformat.write(nb, str(path))


def differences(a: Path, b: Path, rel: str = "") -> tuple[set[str], set[str], set[str]]:
    """(files only in ``b``, files only in ``a``, files in both that differ), relative to the roots."""
    cmp = filecmp.dircmp(a, b, ignore=["__pycache__", ".pytest_cache"])
    new, gone = set(), set()
    for name, into, side in [(n, new, b) for n in cmp.right_only] + [(n, gone, a) for n in cmp.left_only]:
        path = side / name
        into |= ({f"{rel}{name}/{p.relative_to(path)}" for p in path.rglob("*") if p.is_file()}
                 if path.is_dir() else {f"{rel}{name}"})
    changed = {f"{rel}{n}" for n in cmp.common_files
               if (a / n).read_bytes() != (b / n).read_bytes()}
    for d in cmp.common_dirs:
        n, g, c = differences(a / d, b / d, f"{rel}{d}/")
        new, gone, changed = new | n, gone | g, changed | c
    return new, gone, changed


@pytest.fixture(scope="module")
def lab_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab10")
    for name in COPIED:
        shutil.copytree(REPO / name, root / name, ignore=IGNORED)
    follow_the_recipe(root)
    new, gone, changed = set(), set(), set()
    for name in COPIED:
        n, g, c = differences(REPO / name, root / name, f"{name}/")
        new, gone, changed = new | n, gone | g, changed | c
    # one package, the notebook, one test file; one edit, the registry's; nothing else
    package = "lab_utils/experiments/n10_toy/"
    assert new == {f"{package}__init__.py", f"{package}experiment.py", f"{package}worker.py",
                   "labs/10_toy.ipynb", "tests/test_toy.py"}, new
    assert (gone, changed) == (set(), {"lab_utils/experiments/registry.py"}), (gone, changed)
    registry = (root / "lab_utils" / "experiments" / "registry.py").read_text(encoding="utf-8")
    before = (REPO / "lab_utils" / "experiments" / "registry.py").read_text(encoding="utf-8")
    assert len(registry.splitlines()) - len(before.splitlines()) == 2  # the import and its line in NOTEBOOKS
    return root


def run(root: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root), "LAB_RESULTS_DIR": str(root / "results")}
    return subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_measure_picks_the_new_experiment_up(lab_copy):
    res = run(lab_copy, "-m", "lab_utils", "measure", "toy", "--profile", "quick")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "toy (notebook 10), profile quick: 2 run(s)" in res.stdout
    assert re.search(r"^  batch 8 +ok +train_seconds \d", res.stdout, re.M), res.stdout
    assert re.search(r"^  batch 32 +ok +train_seconds \d", res.stdout, re.M), res.stdout
    stored = (lab_copy / "results" / "quick" / "runs" / "toy.jsonl").read_text().splitlines()
    assert [json.loads(line)["config"]["batch_size"] for line in stored] == [8, 32]
    again = run(lab_copy, "-m", "lab_utils", "measure", "toy", "--profile", "quick")
    assert "toy: measured now: nothing (all from the store)" in again.stdout


@pytest.mark.timeout(240)
def test_the_time_budget_doctor_and_the_report_pick_the_new_notebook_up(lab_copy):
    """Notebook 10 is a row of the budget table, summed from its plan for the budget's node (3 runs of
    20 steps at 1 ms, one launch: 60 s + 40 s + 0.06 s -> 2 min), a row 10_toy of the doctor, whose
    measurement runs the notebook's own plan (here on this CPU, in this process), and the report's last
    section (an extra without an ``order``: after the others), with its row in the question map."""
    code = (
        "import json\n"
        "from lab_utils.app import doctor, doctor_checks, doctor_experiments, questions, time_budget as tb\n"
        "from lab_utils.engine.machine import Machine\n"
        "from lab_utils.experiments import registry\n"
        "parts = tb.notebook_parts('10')\n"
        "m = doctor_checks.Machine(gpus=0, names=[], mig=[], driver=None, problem=None, profile='full')\n"
        "d = doctor_experiments.measure_experiment(registry.by_name('toy'), m,"
        " machine=Machine(gpus=0, cores=1))\n"
        "print(json.dumps({'table': tb.budget_table().to_dict('records'),"
        " 'checks': [c.name for c in doctor.CHECKS],"
        " 'parts': [[p.what, p.seconds, p.start_up] for p in parts], 'doctor': d,"
        " 'judged': doctor_experiments.judge_experiment(d, m), 'last': questions.SECTIONS[-1].notebook,"
        " 'map': questions.question_map_markdown(), 'toy': questions.sections_for('10')[0].tables}))\n")
    res = run(lab_copy, "-c", code)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    row = next(r for r in out["table"] if r["notebook"] == "10")
    assert (row["topic"], row["answers"], row["estimated minutes"]) == ("toy", "Extra", 2)
    assert row["what takes the time"] == "3 runs; longest: batch 32 (~1 min)"
    assert out["parts"] == [["start-up", 60.0, True], ["start-up of toy", 40.0, True],
                            ["batch 32", 0.02, False], ["batch 128", 0.02, False], ["batch 512", 0.02, False]]
    assert out["checks"].index("10_toy") > max(i for i, c in enumerate(out["checks"]) if c.startswith("09_"))
    assert [(r["label"], r["status"]) for r in out["doctor"]["runs"]] == [("batch 32", "ok")]
    assert out["judged"][2] == "ok" and out["judged"][0].startswith("ran batch 32")
    assert (out["last"], out["toy"]) == ("10_toy", ["toy_steps"])
    assert ("| **Extra** Step time against the batch size | `10_toy` | 1 · The step time | `toy_steps` |"
            in out["map"])


@pytest.mark.timeout(240)
def test_the_new_notebooks_test_file_passes(lab_copy):
    res = run(lab_copy, "-m", "pytest", "-q", "-p", "no:randomly", "-p", "no:cacheprovider",
              "tests/test_toy.py")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "2 passed" in res.stdout, res.stdout


def test_the_recipe_names_the_registries_that_derive_and_those_that_do_not():
    text = RECIPE.read_text(encoding="utf-8")
    for name in ("registry.py", "NOTEBOOKS", "QUICK", "FULL", "EXPERIMENTS", "SECTIONS", "profiles.py",
                 "app/questions.py", "table_columns.json", "gpu_branches.py", "metrics.py", "labs/NN_*.ipynb",
                 "make docs"):
        assert name in text, name
