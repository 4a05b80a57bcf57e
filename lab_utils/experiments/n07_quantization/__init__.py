"""Notebook 07: int8 quantization, measured side by side.
"""

from lab_utils.experiments.shared.sections import PART2, Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section(PART2, "Int8 quantization of the GPT", "07_quantization", "What these measurements say",
            "Size, quality (loss) and speed of each variant on each device; when does int8 pay?",
            ("quantization",), ("quantization_quality_vs_speed",),
            report=("Re-run with `COMPILE=True` on the GPU: which rows change, and why?",
                    "With your GPU's `P/B` for each precision, which rows of the intensity table are "
                    "memory-bound? Does the measurement agree?"),
            by_hand="q07_report", exercises=("q07_int8_size",),
            by_hand_asks="Which variant would you deploy for batch-1 chat on a CPU, and which for batch-64 "
                         "serving on the GPU? Quote the rows of your table that decide it (speed against "
                         "fp32 on the same device, with its spread) and the loss increase you would "
                         "accept."),
)
