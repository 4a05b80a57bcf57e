"""Notebook 09: data parallelism built by hand.
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Extra", "Data parallelism built by hand", "09_build_ddp", "7 · Which is fastest here, and why",
            "Naive, per-tensor, flat, bucketed and ZeRO-1 data parallelism checked against one process and "
            "timed against torch's DDP and the alpha-beta model.",
            ("build_ddp_check", "build_ddp_memory", "build_ddp", "build_ddp_buckets", "build_ddp_overlap",
             "build_ddp_bf16"),
            ("build_ddp_buckets", "build_ddp_trace"),
            report=("Which implementation is slowest at each rank count, and which alpha-beta term "
                    "explains its exposed communication? What do overlap alone ((a) against (e)) and "
                    "bucketing ((e) against (c)) save?",
                    "In the merged trace, where does each rank's all-reduce run relative to its backward, "
                    "for (b), (c) and DDP? Is there a straggler?",
                    "torch's ZeroRedundancyOptimizer all-reduces, then broadcasts each rank's updated shard: "
                    "how many bytes per step would one rank send, against (d)'s? When does sharding the "
                    "optimizer state pay (the memory table)?"),
            by_hand="q09_report", exercises=("q09_average", "q09_buckets", "q09_shards", "q09_exposed"),
            by_hand_asks="Which implementation is fastest on your machine at each batch size, and why? Use "
                         "the step time with its spread, the exposed communication, the bytes sent and the "
                         "prediction; say whether the difference is larger than the spread.",
            order=3),
)
