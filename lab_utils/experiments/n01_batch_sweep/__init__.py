"""Notebook 01: the single-GPU batch-size sweep (Q1).
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Q1", "Batch-size sweep on one GPU", "01_batch_size_sweep", "The sweep",
            "Epoch-2 training time (loader waits excluded) for batch 32, 128, 512, ... until the batch "
            "does not fit. Why does it fall, and where and why does it stop falling?",
            ("batch_sweep", "batch_sweep_phases", "batch_sweep_flops", "batch_sweep_memory"),
            ("batch_sweep",),
            report=("What does the warm-up epoch absorb on your machine (compare the two epochs in the "
                    "phase table), and what is excluded from the reported time?",
                    "What fraction of the GPU's peak does the best batch size reach? Name two reasons it "
                    "is not higher."),
            by_hand="q01_report", exercises=("q01_step_timer", "q01_train_transform", "q01_peak_memory"),
            by_hand_asks="From which batch size on does the epoch time stop improving on your machine, and "
                         "why there? Which batch size was the first that did not fit, and what fills the "
                         "memory at that size? Quote the numbers from your table."),
)
