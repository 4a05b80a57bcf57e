"""Every notebook of the lab, in notebook order (:data:`NOTEBOOKS`, the one list of them), and every
experiment (:data:`EXPERIMENTS`): what the time budget sums, doctor runs on a GPU node and
``python -m lab_utils measure NAME`` measures (each notebook's report sections are in its package's
``__init__``, which :data:`lab_utils.app.questions.SECTIONS` reads). Adding a notebook adds its experiment
module here (its import and one line of NOTEBOOKS; lab_utils/experiments/README.md has the whole recipe)."""

from __future__ import annotations

from types import ModuleType

from lab_utils.engine.plan import Experiment
from lab_utils.experiments.n00_environment import experiment as n00
from lab_utils.experiments.n01_batch_sweep import experiment as n01
from lab_utils.experiments.n02_scaling import experiment as n02
from lab_utils.experiments.n03_compute_vs_comm import experiment as n03
from lab_utils.experiments.n04_allreduce import experiment as n04
from lab_utils.experiments.n05_large_batch import experiment as n05
from lab_utils.experiments.n06_gpt_ddp import experiment as n06
from lab_utils.experiments.n07_quantization import experiment as n07
from lab_utils.experiments.n08_speed_limits import experiment as n08
from lab_utils.experiments.n09_build_ddp import experiment as n09
from lab_utils.learn.errors import LabError

#: every notebook's experiment module, in notebook order; each has ``EXPERIMENTS`` (its Experiments, in the
#: order it measures them)
NOTEBOOKS: tuple[ModuleType, ...] = (
    n00,
    n01,
    n02,
    n03,
    n04,
    n05,
    n06,
    n07,
    n08,
    n09,
)

EXPERIMENTS: tuple[Experiment, ...] = tuple(e for notebook in NOTEBOOKS for e in notebook.EXPERIMENTS)


def by_name(name: str) -> Experiment:
    """The experiment called ``name`` (one sentence naming the others when there is none)."""
    for e in EXPERIMENTS:
        if e.name == name:
            return e
    raise LabError(f"No experiment {name!r}; use one of: {', '.join(e.name for e in EXPERIMENTS)}.")


def for_notebook(notebook: str) -> tuple[Experiment, ...]:
    """The experiments a notebook (``"02"``) measures, in the order it measures them (its own, and those of
    later notebooks it measures too: ``Experiment.also_in``)."""
    return tuple(e for e in EXPERIMENTS if notebook in e.also_in) + \
        tuple(e for e in EXPERIMENTS if e.notebook == notebook)
