"""Every experiment of the lab, in notebook order: what the time budget sums, doctor runs on a GPU node
and ``python -m lab_utils measure NAME`` measures. Adding a notebook adds its experiments here (one line
each; lab_utils/experiments/README.md has the whole recipe)."""

from __future__ import annotations

from lab_utils.engine.plan import Experiment
from lab_utils.experiments.n01_batch_sweep import experiment as sweep
from lab_utils.experiments.n02_scaling import experiment as scaling
from lab_utils.experiments.n04_allreduce import experiment as comm
from lab_utils.experiments.n05_large_batch import experiment as large_batch
from lab_utils.experiments.n06_gpt_ddp import experiment as gpt
from lab_utils.experiments.n07_quantization import experiment as quantize
from lab_utils.experiments.n08_speed_limits import experiment as fastpath
from lab_utils.experiments.n09_build_ddp import experiment as build_ddp
from lab_utils.learn.errors import LabError

EXPERIMENTS: tuple[Experiment, ...] = (
    sweep.SWEEP_EXPERIMENT,
    scaling.SCALING_EXPERIMENT,
    scaling.COMPUTE_VS_COMM_EXPERIMENT,
    comm.ALLREDUCE_BENCH_EXPERIMENT,
    comm.COMPUTE_STEP_EXPERIMENT,
    large_batch.LARGE_BATCH_EXPERIMENT,
    large_batch.COMM_ACCOUNTING_EXPERIMENT,
    gpt.SCALING_EXPERIMENT,
    gpt.ACCUMULATION_EXPERIMENT,
    gpt.TRAIN_EXPERIMENT,
    quantize.QUANTIZATION_EXPERIMENT,
    fastpath.LOADER_EXPERIMENT,
    fastpath.WATERFALL_EXPERIMENT,
    fastpath.TRACE_EXPERIMENT,
    fastpath.ACCURACY_EXPERIMENT,
    build_ddp.BUILD_DDP_EXPERIMENT,
)


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
