"""Notebook 03: compute against communication per epoch, Table 2 (Q3); its experiment
(:data:`~lab_utils.experiments.n03_compute_vs_comm.experiment.COMPUTE_VS_COMM_EXPERIMENT`) runs notebook
02's settings through notebook 02's plan for it.
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
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
