"""Notebook 06: a GPT trained with DDP and gradient accumulation.
"""

from lab_utils.experiments.shared.sections import PART2, Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section(PART2, "GPT trained with DDP and gradient accumulation", "06_gpt_ddp",
            "2 · Scaling over devices at a fixed per-device batch",
            "Scaling at a fixed per-device batch (strong or weak?), compute vs communication per rank, "
            "the gradient-accumulation trade-off.",
            ("gpt_scaling", "gpt_rank_breakdown", "gpt_compute_vs_comm", "gpt_accumulation", "gpt_samples"),
            ("gpt_accumulation",),
            report=("Is the experiment in section 2 strong or weak scaling? What would the other one keep "
                    "fixed, and which speedup formula (T(1)/T(N) or N x T(1)/T(N)) belongs to each?",
                    "Compare the measured communication (exposed wait, in flight, no_sync probe) with the "
                    "derived T(N) - T(1)/N. Which would you report, and why?",
                    "With k accumulation steps, how many gradient all-reduces happen per optimizer step, "
                    "and what happens to the communication share of the step?",
                    "Which micro-batch gives the best tokens/s, which the best whole-run time, and which "
                    "fits in memory with the effective batch you need?"),
            by_hand="q06_report",
            exercises=("q06_flops_per_token", "q06_mfu", "q06_rank_time", "q06_tokens_per_s"),
            by_hand_asks="Using the per-rank table, how far apart are the ranks? Recompute the speedup "
                         "with the mean over ranks instead of the slowest rank: by how much does it "
                         "flatter the result, and why is the slowest rank the right one? Do the same for "
                         "the earlier report's per-rank table. Quote your numbers."),
)
