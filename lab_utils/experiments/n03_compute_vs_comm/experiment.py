"""Notebook 03 (Q3.1, Table 2): compute against communication per epoch. Its experiment runs notebook 02's
settings (:class:`lab_utils.experiments.n02_scaling.experiment.Settings`) through notebook 02's plan for it
(:func:`~lab_utils.experiments.n02_scaling.experiment.plan_compute_vs_comm`: T(1) reused from notebook 02's
runs, then DDP on ``comm_devices`` with the communication measured); its tables are in
:mod:`lab_utils.experiments.n03_compute_vs_comm.tables`.
"""

from __future__ import annotations

from lab_utils.engine.plan import Experiment
from lab_utils.experiments.n02_scaling.experiment import (
    COMPUTE_VS_COMM,
    Settings,
    cost,
    doctor_settings,
    plan_compute_vs_comm,
)

COMPUTE_VS_COMM_EXPERIMENT = Experiment(COMPUTE_VS_COMM, "03", Settings, plan_compute_vs_comm, cost,
                                        doctor_settings, "compute vs communication (Table 2)")

#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (COMPUTE_VS_COMM_EXPERIMENT,)
