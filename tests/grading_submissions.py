"""Handed-in notebooks for the grading tests, made from the student edition (dist/student/labs).

- :func:`solved`: every exercise holds the master's own solution, every hand-graded answer a text;
- :func:`with_function`: one exercise's cell replaced by given code (cheats, mistakes, hostile code);
- :data:`HOSTILE`: code that tries what a sandbox must stop, as the body of ``achieved_gb_per_s``
  (notebook 04, ``q04_utilization``), then the right answer; the attempt raises where the sandbox
  stops it, and the row names what stopped it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

from lab_utils.app.grading import notebooks as nbs
from lab_utils.app.grading.bench import fill_with_solutions

REPO = Path(__file__).resolve().parent.parent
BOOKS = ["01_batch_size_sweep", "02_multi_gpu_scaling", "03_compute_vs_communication",
         "04_allreduce_bandwidth", "05_large_batch_training", "06_gpt_ddp", "07_quantization", "09_build_ddp"]


def make(*args: str, timeout: float) -> subprocess.CompletedProcess:
    """``make ARGS`` from the repository root, as docs/grading.md writes it."""
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def rel(path: Path) -> str:
    """``path`` relative to the repository root (the form docs/grading.md's commands use)."""
    return os.path.relpath(path, REPO)


def shared_dist(tmp_path_factory) -> Path:
    """Where the grading tests keep the built student copy and bundle (one build per test session:
    tests/test_grading.py builds it with `make student`; tests/test_grading_sandbox.py reuses it)."""
    return tmp_path_factory.getbasetemp() / "grading-dist"


def student_notebook(dist: Path, book: str) -> dict:
    return json.loads((Path(dist) / "student" / "labs" / f"{book}.ipynb").read_text())


def _question(cell: dict) -> str | None:
    return (cell.get("metadata", {}).get(nbs.METADATA_KEY) or {}).get("question")


def solved(nb: dict, book: str) -> dict:
    """The student notebook with each exercise's cell replaced by the master's solution cell."""
    return fill_with_solutions(nb, nbs.parse_master(REPO / "labs" / f"{book}.ipynb"))


def with_function(nb: dict, question: str, source: str, extra_cell: str = "") -> dict:
    """``nb`` with the exercise cell of ``question`` replaced by ``source`` (and a cell appended)."""
    nb = copy.deepcopy(nb)
    hits = [c for c in nb["cells"] if c["cell_type"] == "code" and _question(c) == question]
    assert len(hits) == 1, question
    hits[0]["source"] = source
    if extra_cell:
        nb["cells"].append({"cell_type": "code", "execution_count": None, "id": "extra000", "metadata": {},
                            "outputs": [], "source": extra_cell})
    return nb


def write(path: Path, nb: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(nb, indent=1))
    return path


# The first line of notebook 04's q04_utilization function, and its right body.
UTILIZATION = "def achieved_gb_per_s(gradient_bytes, world_size, steps_per_epoch, comm_seconds):\n"
RIGHT = ("    sent = steps_per_epoch * 2 * (world_size - 1) / world_size * gradient_bytes\n"
         "    return sent / comm_seconds / 1e9\n")


def utilization(body: str, imports: str = "import os\n") -> str:
    """``achieved_gb_per_s`` whose body first runs ``body``, then answers (if the attempt let it)."""
    lines = "".join(f"    {line}\n" for line in body.strip().split("\n"))
    return f"{imports}\n\n{UTILIZATION}{lines}{RIGHT}"


def hostile(home: Path, other: Path, bundle_file: Path) -> dict[str, str]:
    """Student name -> the code of its ``q04_utilization`` cell (absolute paths of this machine)."""
    return {
        "h_home": utilization(f"open(os.path.expanduser('~/.grading_was_here'), 'w').write('x')\n"
                              f"open({str(home / '.grading_was_here')!r}, 'w').write('x')"),
        "h_other": utilization(f"print(open({str(other)!r}).read()[:100])"),
        "h_bundle": utilization(f"print(open({str(bundle_file)!r}).read()[:100])"),
        "h_network": utilization("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)"),
        "h_memory": utilization("block = bytearray(20 * 2 ** 30)"),
        "h_forkbomb": utilization("while True:\n    os.fork()"),
        "h_hugefile": utilization("with open('big.bin', 'wb') as f:\n"
                                  "    for _ in range(1000):\n        f.write(bytes(10 ** 7))"),
    }
