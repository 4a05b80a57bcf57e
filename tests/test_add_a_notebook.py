"""The add-a-notebook recipe (lab_utils/experiments/README.md), followed in a copy of the lab from the
README's code blocks alone: its new files written, its three edits made; then the measure command, the
time budget and doctor must pick the new notebook's experiment up with no other change."""

from __future__ import annotations

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


def blocks() -> list[tuple[str, str, str]]:
    """The recipe's code blocks that say what to do with them: (what, path, code)."""
    text = RECIPE.read_text(encoding="utf-8")
    pattern = r"```python (new|append|registry|section|cell): (\S+)\n(.*?)```"
    return [(m.group(1), m.group(2), m.group(3)) for m in re.finditer(pattern, text, re.S)]


def follow_the_recipe(root: Path) -> dict[str, int]:
    """Apply every block to the copy at ``root``; returns how many of each kind there were."""
    done: dict[str, int] = {}
    for what, rel, code in blocks():
        path = root / rel
        done[what] = done.get(what, 0) + 1
        if what == "new":
            assert not path.exists(), f"{rel} is not new"
            path.write_text(code, encoding="utf-8")
        elif what == "append":
            path.write_text(path.read_text(encoding="utf-8") + code, encoding="utf-8")
        elif what == "registry":  # the import after the module's imports, the entry at the end of EXPERIMENTS
            text = path.read_text(encoding="utf-8")
            imports, entry = code.strip().splitlines()
            head, sep, tail = text.partition("\nEXPERIMENTS: tuple[Experiment, ...] = (\n")
            assert sep, "registry.py has no EXPERIMENTS tuple"
            body, close, rest = tail.partition("\n)\n")
            path.write_text(f"{head}\n{imports}\n{sep}{body}\n{entry}{close}{rest}", encoding="utf-8")
        elif what == "section":  # before the end of SECTIONS
            text = path.read_text(encoding="utf-8")
            head, sep, tail = text.partition("\nSECTIONS: tuple[Section, ...] = (\n")
            body, close, rest = tail.partition("\n)\n")
            path.write_text(f"{head}{sep}{body}\n{code.rstrip()}{close}{rest}", encoding="utf-8")
        elif what == "cell":
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# 10 · Step time"),
                                                 nbformat.v4.new_code_cell(code.strip())])
            nbformat.write(nb, str(path))
    return done


@pytest.fixture(scope="module")
def lab_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lab10")
    for name in ("lab_utils", "labs"):
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    done = follow_the_recipe(root)
    # at most 4 new files and 3 edits of shared registries (profiles table, registry, questions)
    new_files = done.get("new", 0) + done.get("cell", 0)
    edits = done.get("append", 0) + done.get("registry", 0) + done.get("section", 0)
    assert new_files <= 4 and edits <= 3, done
    assert done == {"new": 2, "cell": 1, "append": 1, "registry": 1, "section": 1}
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
def test_the_time_budget_and_doctor_pick_the_new_experiment_up(lab_copy):
    """Notebook 10 is a row of the budget table, summed from its plan for the budget's node (3 runs of
    20 steps at 1 ms, one launch: 60 s + 40 s + 0.06 s -> 2 min), and a row 10_toy of the doctor, whose
    measurement runs the notebook's own plan (here on this CPU, in this process)."""
    code = (
        "import json\n"
        "from lab_utils.app import doctor, doctor_checks, doctor_experiments, time_budget as tb\n"
        "from lab_utils.engine.machine import Machine\n"
        "from lab_utils.experiments import registry\n"
        "parts = tb.notebook_parts('10')\n"
        "m = doctor_checks.Machine(gpus=0, names=[], mig=[], driver=None, problem=None, profile='full')\n"
        "d = doctor_experiments.measure_experiment(registry.by_name('toy'), m,"
        " machine=Machine(gpus=0, cores=1))\n"
        "print(json.dumps({'table': tb.budget_table().to_dict('records'),"
        " 'checks': [c.name for c in doctor.CHECKS],"
        " 'parts': [[p.what, p.seconds, p.start_up] for p in parts], 'doctor': d,"
        " 'judged': doctor_experiments.judge_experiment(d, m)}))\n")
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


def test_the_recipe_names_the_registries_that_derive_and_those_that_do_not():
    text = RECIPE.read_text(encoding="utf-8")
    for name in ("registry.py", "profiles.py", "app/questions.py", "table_columns.json", "gpu_branches.py",
                 "metrics.py", "labs/NN_*.ipynb"):
        assert name in text, name
