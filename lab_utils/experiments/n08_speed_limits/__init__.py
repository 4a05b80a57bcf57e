"""Notebook 08: how far each measurement is from the hardware's limit.
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Extra", "Speed limits of ResNet-18 on CIFAR-10", "08_speed_limits",
            "5 · The lesson for notebooks 01-03",
            "Which step of the waterfall gave the largest speed-up, and what bounds the spec path?",
            ("fastpath_loader", "fastpath_waterfall", "fastpath_top_ops", "fastpath_accuracy"),
            ("fastpath_waterfall",),
            report=("Which single step of the waterfall gave the largest speed-up on your GPU, and why "
                    "that one?",
                    "Compare the spec loader's images/s (section 1) with the `device_loader` row's "
                    "(section 2): did notebooks 01-03 measure the GPU or the loader? What would change in "
                    "Tables 1-3?",
                    "Name two things in the top-operator table that keep the fastest row from 100 % of "
                    "peak.",
                    "When can the data set no longer stay in GPU memory, and what then (DALI, decoding on "
                    "the GPU, uint8 shards)?"),
            order=1),
)
