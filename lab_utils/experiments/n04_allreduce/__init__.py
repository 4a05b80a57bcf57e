"""Notebook 04: ring all-reduce bandwidth and Table 3 (Q4).
"""

from lab_utils.experiments.shared.sections import Section

#: the report sections this notebook answers: lab_utils.app.questions.SECTIONS gathers them from
#: every notebook's package, without importing its experiment (no torch for the question map)
SECTIONS: tuple[Section, ...] = (
    Section("Q3.2", "Ring all-reduce bandwidth utilization (Table 3)", "04_allreduce_bandwidth",
            "6 · Table 3: bandwidth utilization of the training runs",
            "Bytes each rank sends per epoch (2(P-1)/P x S bytes per step, S in bytes), the achieved "
            "bandwidth and its fraction of the measured peak.",
            ("allreduce_utilization", "allreduce_bytes", "allreduce_fit", "allreduce_bench",
             "allreduce_models", "allreduce_buckets"), ("allreduce_busbw",),
            report=("The busbw figure: where does the latency-dominated regime end on this machine? How "
                    "big are DDP's buckets compared with that size?",),
            by_hand="q04_report",
            exercises=("q04_gradient_bytes", "q04_ring_bytes", "q04_utilization", "q04_predicted_bandwidth"),
            by_hand_asks="Table 3: give (a), the assignment's utilization, for DDP, then (c). Why do (a) "
                         "and (b) give different (even impossible) GB/s? What share of the benchmark's "
                         "peak did training reach, and what explains the gap? Quote your numbers.",
            first="The all-reduce time formula, before the table (the assignment asks for it first): the "
                  "time T(S, P) of a ring all-reduce of S bytes on P ranks, with latency alpha and "
                  "bandwidth B, each term named, and the bytes each rank sends per step and per epoch (S "
                  "in bytes, not parameters). Give your fitted alpha and B (`allreduce_fit`)."),
    Section("Extra", "Projection to 8 ... 1024 GPUs", "04_allreduce_bandwidth",
            "7 · Projection to 8 … 1024 devices",
            "How does the fitted ring model scale the epoch past the hardware at hand?",
            ("allreduce_projection", "allreduce_inputs"), ("allreduce_projection_efficiency",),
            report=("At how many devices does efficiency drop below 50 % for each per-GPU batch, and which "
                    "term (latency or bandwidth) causes it? Why do larger per-GPU batches scale further? "
                    "Which assumption is the most optimistic for a real multi-node cluster?",),
            order=2),
)
