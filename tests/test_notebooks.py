"""Every notebook of the lab runs headless in the quick profile, in order, as `make lab` does.

One `python -m lab_utils run` over all notebooks (later notebooks read the records and
the checkpoint earlier ones leave), into a fresh results folder; then the report must
hold every table the notebooks promise. This is the instructors' path, on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from lab_utils.app.grading import build, giveaways
from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.questions import SECTIONS
from lab_utils.app.runner import all_notebooks

# Tables the notebooks must produce (results/<profile>/tables/<name>.md): every table a section of the
# question map names (lab_utils/app/questions.py, the one list a new notebook adds its section to).
EXPECTED_TABLES: dict[str, list[str]] = {}
for _section in SECTIONS:
    EXPECTED_TABLES.setdefault(_section.notebook, []).extend(_section.tables)


@pytest.fixture(scope="module")
def lab_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lab") / "results"
    env = dict(os.environ, LAB_RESULTS_DIR=str(root), LAB_PROFILE="quick")
    proc = subprocess.run([sys.executable, "-m", "lab_utils", "run", "--profile", "quick",
                           "--timeout", "900"], capture_output=True, text=True, env=env, timeout=1800)
    return proc, root / "quick"


@pytest.mark.slow
@pytest.mark.timeout(1900)  # the fixture runs every notebook (its own limit: 1800 s)
def test_every_notebook_runs_in_quick_profile(lab_run):
    proc, root = lab_run
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    names = [p.name for p in all_notebooks()]
    for name in names:
        assert f"ok     {name}" in proc.stdout
    assert (root / "report.md").exists()
    assert len(list((root / "executed").glob("*.ipynb"))) == len(names)


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_every_metric_a_notebook_run_writes_is_in_the_glossary(lab_run):
    """One meaning per metric name (issue 26): every metric key of every record the run stored (top
    level, and in each record's per-epoch and per-rank entries) is defined in lab_utils.learn.metrics."""
    import json

    from lab_utils.learn.metrics import unknown

    _, root = lab_run
    where: dict[str, set[str]] = {}
    for path in sorted((root / "runs").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            metrics = json.loads(line)["metrics"] or {}
            entries = [metrics] + [e for k in ("epochs", "ranks") for e in metrics.get(k) or []
                                   if isinstance(e, dict)]
            for key in {k for e in entries for k in e}:
                where.setdefault(key, set()).add(path.stem)
    assert len(where) > 100  # the run wrote records of every notebook
    missing = unknown(where)
    assert missing == [], {k: sorted(where[k]) for k in missing}


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_tables_keep_their_names_and_columns(lab_run):
    """The quick run writes the same tables, with the same columns in the same order, as before the
    data path was rebuilt (issue 26): tests/table_columns.json, the CSV headers of a quick run at
    d4e9c98 (plus payload_bytes, added by Exercise 07-a). The tables are those lab_utils/app/questions.py
    names;
    a new table's columns are frozen by adding them to that file."""
    import csv
    import json
    from pathlib import Path

    _, root = lab_run
    want = json.loads((Path(__file__).with_name("table_columns.json")).read_text())
    got = {p.stem: next(csv.reader(p.open())) for p in sorted((root / "tables").glob("*.csv"))}
    named = {t for tables in EXPECTED_TABLES.values() for t in tables}
    assert sorted(got) == sorted(named) and set(want) <= named  # the names: app/questions.py's
    assert {k: v for k, v in got.items() if k in want and v != want[k]} == {}  # the frozen columns


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_report_holds_every_promised_table(lab_run):
    proc, root = lab_run
    report = (root / "report.md").read_text()
    present = {p.stem for p in all_notebooks()}
    for nb, tables in EXPECTED_TABLES.items():
        if nb not in present:
            continue
        for t in tables:
            md = root / "tables" / f"{t}.md"
            assert md.exists(), f"{nb} did not write table {t}"
            assert (root / "tables" / f"{t}.csv").exists()
            text = md.read_text()
            assert "profile: quick" in text, f"{t} lacks its provenance label"
            assert text.strip() in report
    assert "quick profile" in report


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_make_report_after_the_quick_lab_writes_the_handin_and_check_refuses_it(lab_run):
    """Issue 35: after `make lab PROFILE=quick`, `make report` (from the repository root, as the README
    writes it) writes report.md, report.html with the figures embedded and handin.json; Tables 1-3 are in
    the handout's layout; `make report CHECK=1` exits 1 naming the quick, CPU and synthetic provenance."""
    import json
    from pathlib import Path

    _, root = lab_run
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, LAB_RESULTS_DIR=str(root.parent), LAB_PROFILE="quick")
    make = ["make", "--no-print-directory", "report", "PROFILE=quick"]
    done = subprocess.run(make, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    out = root / "handin"
    md = (out / "report.md").read_text()
    assert "| GPUs | 32: time (s) | 32: speedup | 128: time (s) | 128: speedup |" in md
    assert "| 1 | " in md.split("**Table 1")[1] and "| 4 | " in md.split("**Table 1")[1]
    assert "| GPUs | 32: compute (s) | 32: communication (s) |" in md
    assert "| GPUs | 32: GB/s | 32: utilization % |" in md
    assert "- **profile:** quick" in md and "(SYNTHETIC)" in md
    page = (out / "report.html").read_text()
    assert page.count('src="data:image/png;base64,') >= 10 and 'src="figures/' not in page
    data = json.loads((out / "handin.json").read_text())
    assert data["provenance"]["profile"] == "quick" and data["provenance"]["device_type"] == "cpu"
    t1 = [r for r in data["tables"]["table1"] if r["status"] == "ok"]
    assert {r["gpus"] for r in t1} == {1, 2, 4} and all(r["seconds"] > 0 for r in t1)
    check = subprocess.run([*make, "CHECK=1"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode != 0
    assert "not ready: profile quick" in check.stdout and "not ready: data synthetic" in check.stdout
    assert "not ready: device cpu" in check.stdout


@pytest.mark.slow
@pytest.mark.timeout(1900)
def test_no_output_a_student_sees_first_gives_a_graded_answer_away(lab_run):
    """Issue 48: what the executed notebooks print or display above a graded question's answer cell (the
    cells the student copy keeps: no discussion, no solution, no hidden test) and in earlier notebooks
    names none of that question's give-aways."""
    _, root = lab_run
    masters = [nbs.parse_master(p) for p in build.master_notebooks()]
    names = {m.path.stem: [q.name for q in m.questions] for m in masters}
    books = [(p.stem, giveaways.master_view(json.loads(p.read_text())["cells"], names.get(p.stem, [])))
             for p in sorted((root / "executed").glob("[0-9][0-9]_*.ipynb"))]
    assert len(books) == len(all_notebooks())
    assert giveaways.find_giveaways(books, giveaways.all_giveaways(masters), " (quick-profile output)") == []
