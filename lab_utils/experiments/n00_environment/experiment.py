"""Notebook 00 (the machine and the software stack): it measures no experiment; its report section is the
environment table (:mod:`lab_utils.experiments.n00_environment.tables`)."""

from __future__ import annotations

from lab_utils.engine.plan import Experiment

#: this notebook's experiments: none (its table describes the machine, it times nothing)
EXPERIMENTS: tuple[Experiment, ...] = ()
