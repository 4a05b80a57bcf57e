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
from lab_utils.experiments.shared.sections import Section

COMPUTE_VS_COMM_EXPERIMENT = Experiment(COMPUTE_VS_COMM, "03", Settings, plan_compute_vs_comm, cost,
                                        doctor_settings, "compute vs communication (Table 2)")

#: this notebook's experiments, in the order it measures them (the registry reads them)
EXPERIMENTS: tuple[Experiment, ...] = (COMPUTE_VS_COMM_EXPERIMENT,)

#: the report sections this notebook answers (lab_utils.app.questions.SECTIONS gathers them)
SECTIONS: tuple[Section, ...] = (
    Section("Q3.1", "Compute vs communication (Table 2)", "03_compute_vs_communication",
            "Table 2: compute vs communication per epoch",
            "Compute T(1)/N and communication T(N) - T(1)/N for 2 and 4 GPUs per batch size; how do "
            "they compare with the measured exposed and total communication?",
            ("compute_vs_comm",), ("compute_vs_comm",),
            report=("How much of the all-reduce (c) is hidden behind backward, and why can it never all be "
                    "hidden?",
                    "How does the compute-to-communication ratio change with the per-device batch, and why?"),
            by_hand="q03_report", exercises=("q03_compute_comm", "q03_predict_comm"),
            by_hand_asks="For one N and per-device batch of your Table 2: how much of the epoch is "
                         "communication by (a), and by (b)? Why do they differ, and what does it mean when "
                         "(a) is negative? Quote your numbers."),
)
