"""Every notebook of the lab runs headless in the quick profile, in order, as `make lab` does.

One `python -m lab_utils run` over all notebooks (later notebooks read the records and
the checkpoint earlier ones leave), into a fresh results folder; then the report must
hold every table the notebooks promise. This is the instructors' path, on CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from lab_utils.runner import all_notebooks

# Tables the notebooks must produce (results/<profile>/tables/<name>.md).
EXPECTED_TABLES = {
    "00_environment": ["environment"],
    "01_batch_size_sweep": ["batch_sweep"],
    "02_multi_gpu_scaling": ["scaling"],
    "03_compute_vs_communication": ["compute_vs_comm"],
    "04_allreduce_bandwidth": ["allreduce_bench", "allreduce_utilization"],
    "05_large_batch_training": ["large_batch"],
    "06_gpt_ddp": ["gpt_scaling", "gpt_compute_vs_comm", "gpt_accumulation"],
    "07_quantization": ["quantization"],
}


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
