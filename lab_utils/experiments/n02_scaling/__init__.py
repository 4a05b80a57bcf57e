"""Notebook 02: DataParallel and DDP scaling, T(N) and its prediction (Q2).
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Q2", "Speedup on 1, 2 and 4 GPUs (Table 1); strong or weak scaling", "02_multi_gpu_scaling",
            "Strong or weak scaling? Amdahl and Gustafson",
            "Time and speedup per (GPUs, per-GPU batch). Is this strong or weak scaling? Would the "
            "other type of scaling be better or worse, and why?",
            ("scaling", "scaling_fixed_global_batch"), ("scaling_speedup",),
            report=("At which per-device batch does scaling work best, and why do small batches scale worse?",
                    "DataParallel vs DDP (on GPUs): which is faster at each N, and what does DataParallel "
                    "do every step that DDP does not?",
                    "Why does the aggregate take the slowest rank's time rather than the mean?"),
            by_hand="q02_report", exercises=("q02_speedup", "q02_predict_epoch"),
            by_hand_asks="Is Table 1 strong or weak scaling? Give both speedup definitions side by side: "
                         "the course forum's N x T(1)/T(N) (what must T(N) be for it to be the scaled "
                         "speedup, and what does it give on this lab's epoch times?) and the lab's "
                         "T(1)/T(N) (why the lab reports it). Would the other type of scaling be better or "
                         "worse on your machine (the fixed-global-batch table), and why? Quote your "
                         "numbers."),
)
