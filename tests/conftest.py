"""Test-wide settings: results and data go to temporary folders, never into the repo.

Tests run offline on CPU. ``LAB_DATA_DIR`` points at an empty folder so the synthetic
CIFAR-10 stand-in is used even where real data was prepared; ``LAB_RESULTS_DIR`` points
at a per-session folder. Each test that needs a clean store uses the ``store`` fixture.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

_SESSION_DIR = Path(tempfile.mkdtemp(prefix="lab_tests_"))
os.environ["LAB_RESULTS_DIR"] = str(_SESSION_DIR / "results")
os.environ["LAB_DATA_DIR"] = str(_SESSION_DIR / "data")
os.environ.setdefault("LAB_PROFILE", "quick")
os.environ["LAB_HEADLESS"] = "1"
os.environ.setdefault("MPLBACKEND", "agg")
os.environ.pop("LAB_DATASET", None)
(_SESSION_DIR / "data").mkdir(parents=True, exist_ok=True)


@pytest.fixture
def results_dir(tmp_path, monkeypatch) -> Path:
    """A fresh, empty results root for one test."""
    root = tmp_path / "results"
    monkeypatch.setenv("LAB_RESULTS_DIR", str(root))
    return root


@pytest.fixture
def store(results_dir):
    """A ResultStore for the quick profile under a fresh results root."""
    from lab_utils.results import ResultStore

    return ResultStore("quick")
