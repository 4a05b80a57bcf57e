"""Notebook 00 (the machine and the software stack): it measures no experiment; its report section is the
environment table (:mod:`lab_utils.experiments.n00_environment.tables`)."""

from __future__ import annotations

from lab_utils.engine.plan import Experiment
from lab_utils.experiments.shared.sections import Section

#: this notebook's experiments: none (its table describes the machine, it times nothing)
EXPERIMENTS: tuple[Experiment, ...] = ()

#: the report sections this notebook answers (lab_utils.app.questions.SECTIONS gathers them)
SECTIONS: tuple[Section, ...] = (
    Section("Setup", "The machine and software", "00_environment", "Profile",
            "Which GPUs, driver, CUDA, torch and data produced these numbers?", ("environment",)),
)
