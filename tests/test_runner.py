"""The headless runner: executes notebooks, saves executed copies, reports failures."""

import subprocess
import sys

import nbformat
import pytest

from lab_utils import runner
from lab_utils.core.errors import LabError


def _notebook(path, sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, str(path))
    return path


@pytest.mark.slow
def test_environment_notebook_runs_headless(results_dir, capfd):
    results = runner.run(["00"], profile="quick", timeout_s=300)
    assert [r.ok for r in results] == [True]
    out, err = capfd.readouterr()  # the kernel's own stderr too (it inherits the file descriptor)
    assert "ok     00_environment.ipynb" in out
    # clean output: the kernel talks over private Unix sockets (no TCP warning) and is shut down
    assert "without encryption" not in err and "Parent appears to have exited" not in err
    executed = results_dir / "quick" / "executed" / "00_environment.ipynb"
    nb = nbformat.read(str(executed), as_version=4)
    assert any(c.get("outputs") for c in nb.cells if c.cell_type == "code")
    report = (results_dir / "quick" / "report.md").read_text()
    assert "00_environment.ipynb | ok" in report and "### Environment" in report


@pytest.mark.slow
def test_failing_notebook_reports_cell_and_exits_nonzero(results_dir, tmp_path):
    bad = _notebook(tmp_path / "99_broken.ipynb", [
        "import os\nprint(os.environ['LAB_PROFILE'])",
        "x = 1",
        "raise RuntimeError('deliberate failure')",
        "print('never')",
    ])
    proc = subprocess.run([sys.executable, "-m", "lab_utils", "run", str(bad), "--profile", "quick"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "FAILED 99_broken.ipynb" in proc.stdout
    assert "99_broken.ipynb, code cell 3: RuntimeError: deliberate failure" in proc.stderr
    assert "Traceback" not in proc.stderr
    executed = results_dir / "quick" / "executed" / "99_broken.ipynb"
    nb = nbformat.read(str(executed), as_version=4)  # saved even though it failed
    assert nb.cells[0].outputs[0]["text"].strip() == "quick"  # the profile was exported
    assert not nb.cells[3].get("outputs")


def test_missing_notebook_is_one_sentence():
    with pytest.raises(LabError, match="does not exist; give a path or one of: 00_environment.ipynb"):
        runner.resolve_notebooks(["labs/nope.ipynb"])


def test_notebooks_in_order():
    names = [p.name for p in runner.all_notebooks()]
    assert names[0] == "00_environment.ipynb" and names == sorted(names)


def test_cli_bad_input_exits_2_without_traceback():
    for args in (["run", "nope.ipynb"], ["run", "--profile", "fast"], ["info", "--profile", "x"]):
        proc = subprocess.run([sys.executable, "-m", "lab_utils", *args], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, args
        assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_committed_notebooks_have_parameters_cell_and_no_outputs():
    for path in runner.all_notebooks():
        nb = nbformat.read(str(path), as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
        assert len(tagged) == 1, f"{path.name} needs exactly one cell tagged 'parameters'"
        assert "PROFILE" in tagged[0].source
        assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), path.name


@pytest.mark.slow
def test_a_notebook_runs_in_its_own_folder(results_dir, tmp_path):
    """As in JupyterLab: the kernel's working directory is the notebook's folder (a student
    edition's check cells read their own notebook file from there)."""
    folder = tmp_path / "student"
    folder.mkdir()
    nb = _notebook(folder / "98_where.ipynb", [
        "import os, pathlib\npathlib.Path('cwd.txt').write_text(os.getcwd())"])
    [res] = runner.run([str(nb)], profile="quick", timeout_s=120)
    assert res.ok, res.error
    assert (folder / "cwd.txt").read_text() == str(folder)
