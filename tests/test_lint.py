"""`make lint` as part of `make test`: ruff over the whole checkout, notebooks included (pyproject.toml's
settings), so an unsorted import in a notebook's cell fails CI instead of waiting for a reader."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(120)
def test_ruff_finds_nothing_in_the_checkout():
    res = subprocess.run([sys.executable, "-m", "ruff", "check", "."], cwd=REPO, capture_output=True,
                         text=True, timeout=100)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-2000:]
