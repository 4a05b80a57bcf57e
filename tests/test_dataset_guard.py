"""The guard against synthetic data (docs/instructor.md, "Data"): ``LAB_DATASET=cifar10`` (and
``LAB_CORPUS=shakespeare`` for the GPT's text) makes a missing data set an error, in one sentence, before
anything is trained.

It used to be ignored: every experiment's ``Settings.dataset`` defaulted to "auto", so the variable
was never read, and ``LAB_DATASET=cifar10 LAB_DATA_DIR=<empty> python -m lab_utils run 01`` trained
on the synthetic stand-in (issue 32, item 9). A Settings default is now None, which means "read the
environment". Notebook 04 reads no data set (its benchmark and compute steps use random tensors, and
say so), so it is not in the list; notebook 00 only reports what data exist.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lab_utils.engine import config, profiles
from lab_utils.experiments.n01_batch_sweep import experiment as sweep  # noqa: F401 (register)
from lab_utils.experiments.n02_scaling import experiment as scaling  # noqa: F401 (register)
from lab_utils.experiments.n05_large_batch import experiment as large_batch  # noqa: F401 (register)
from lab_utils.experiments.n06_gpt_ddp import experiment as gpt  # noqa: F401 (register)
from lab_utils.experiments.n06_gpt_ddp.worker import TrainConfig
from lab_utils.experiments.n07_quantization import experiment as quantize  # noqa: F401 (register)
from lab_utils.experiments.n08_speed_limits import experiment as fastpath  # noqa: F401 (register)
from lab_utils.experiments.shared.text_data import resolve_corpus
from lab_utils.learn.errors import LabError

REPO = Path(__file__).resolve().parent.parent
DATA_FIELDS = ("dataset", "corpus")


def _registered() -> list[type]:
    return list(profiles._REGISTRY)


@pytest.mark.timeout(60)
def test_no_settings_default_overrides_the_environment():
    """Every settings class (and the workers' arguments) leaves dataset / corpus to the environment:
    default None, and no profile table sets one."""
    checked = []
    for cls in [*_registered(), TrainConfig]:
        for f in dataclasses.fields(cls):
            if f.name in DATA_FIELDS:
                assert f.default is None, (cls.__qualname__, f.name, f.default)
                # the notebook's package
                checked.append(f"{cls.__module__.split('.')[2]}.{cls.__qualname__}.{f.name}")
        if cls in profiles._REGISTRY:
            for profile, values in profiles._REGISTRY[cls][0].items():
                assert not set(values) & set(DATA_FIELDS), (cls.__qualname__, profile)
    assert {"n01_batch_sweep.Settings.dataset", "n02_scaling.Settings.dataset",
            "n05_large_batch.Settings.dataset", "n08_speed_limits.Settings.dataset",
            "n06_gpt_ddp.Settings.corpus", "n06_gpt_ddp.TrainConfig.corpus"} <= set(checked), checked


@pytest.mark.timeout(60)
def test_the_plans_read_lab_dataset(monkeypatch, tmp_path):
    """The plan resolves the dataset the workers get (their RunConfig holds the answer, not None)."""
    from lab_utils.engine.machine import Machine
    from lab_utils.engine.plan import make_plan

    monkeypatch.setenv("LAB_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("LAB_DATASET", "synthetic")
    s = profiles.settings(scaling.Settings, "quick")
    runs = make_plan(scaling.SCALING_EXPERIMENT, s, Machine(gpus=0, cores=2), "quick")
    assert runs and {r.config["dataset"] for r in runs if r.skip is None} == {"synthetic"}
    monkeypatch.setenv("LAB_DATASET", "cifar10")
    with pytest.raises(LabError, match=r"\(LAB_DATASET=cifar10\)"):
        make_plan(scaling.SCALING_EXPERIMENT, s, Machine(gpus=0, cores=2), "quick")
    with pytest.raises(LabError, match=r"\(dataset='cifar10'\)"):
        config.resolve_dataset("cifar10", tmp_path)
    s = profiles.settings(sweep.Settings, "quick")
    assert s.dataset is None
    with pytest.raises(LabError, match="CIFAR-10 is not in"):
        config.resolve_dataset(s.dataset)
    monkeypatch.setenv("LAB_CORPUS", "shakespeare")
    with pytest.raises(LabError, match=r"tiny-Shakespeare is not in .* \(LAB_CORPUS=shakespeare\)"):
        resolve_corpus(None, tmp_path)
    monkeypatch.setenv("LAB_CORPUS", "stdlib")
    assert resolve_corpus(profiles.settings(gpt.Settings, "quick").corpus, tmp_path) == "stdlib"


NOTEBOOKS = {"01": "CIFAR-10", "02": "CIFAR-10", "03": "CIFAR-10", "05": "CIFAR-10", "06": "tiny-Shakespeare",
             "07": "tiny-Shakespeare", "08": "CIFAR-10"}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_experiment_refuses_synthetic_data_through_the_runner(tmp_path):
    """As a new user would: a fresh results folder, an empty data folder, LAB_DATASET=cifar10 (and
    LAB_CORPUS=shakespeare), `python -m lab_utils run NN ...` from the repository root. Each notebook
    that trains stops at its first measuring cell with the one sentence naming the fix, and stores no
    record (nothing ran on synthetic data)."""
    empty, results = tmp_path / "data", tmp_path / "results"
    empty.mkdir()
    env = {**os.environ, "LAB_DATASET": "cifar10", "LAB_CORPUS": "shakespeare", "LAB_DATA_DIR": str(empty),
           "LAB_RESULTS_DIR": str(results)}
    r = subprocess.run([sys.executable, "-m", "lab_utils", "run", *NOTEBOOKS, "--profile", "quick",
                        "--timeout", "120"], cwd=REPO, env=env, capture_output=True, text=True, timeout=380)
    print(r.stdout, r.stderr)
    assert r.returncode == 1
    for nb, what in NOTEBOOKS.items():
        line = next((ln for ln in r.stdout.splitlines() if re.match(rf"\w+\s+{nb}_", ln)), "")
        env_var = "LAB_DATASET=cifar10" if what == "CIFAR-10" else "LAB_CORPUS=shakespeare"
        assert line.startswith("FAILED"), (nb, line)
        assert f"LabError: {what} is not in {empty} ({env_var}) and compute nodes cannot download it; run " \
               "`make prepare`" in line, (nb, line)
        assert line.count(". ") == 0 and line.rstrip().endswith("."), line   # one sentence
    runs = results / "quick" / "runs"
    stored = [p for p in runs.glob("*.jsonl") if p.read_text().strip()] if runs.exists() else []
    assert stored == [], stored
