"""Which notebook, section, table and figure answers which question of the assignment.

One ordered list (:data:`SECTIONS`) is the single source for three things that must agree:

- the README's question map (:func:`question_map_markdown`, pasted; a test keeps it equal),
- the report template a student fills in (:func:`report_template`, idem),
- the order of ``results/<profile>/report.md`` (:func:`lab_utils.runner.write_report`): by
  question, Q1 ... Q7, then the Part 2 project, then the extras; each section with its
  tables and figures.

Numbering: Q1 batch-size sweep; Q2 speedup, strong or weak scaling; Q3.1 compute vs
communication (Table 2); Q3.2 ring all-reduce bandwidth utilization (Table 3); Q4.1
large-batch loss and accuracy at epoch 5; Q4.2 why the large batch falls behind; Q5 the
remedies (linear learning-rate scaling, warm-up); Q6 ``DistributedSampler.set_epoch``; Q7
what DDP communicates besides the gradients. The GPT (notebooks 06 and 07) is the *Part 2
project* an earlier cohort did (SPEC.md, Part 2), not a question of the assignment.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    """One question (or project part) of the report, and where the lab answers it."""

    key: str                      # "Q1", "Q3.1", "Part 2", "Extra"
    title: str
    notebook: str                 # "01_batch_size_sweep"
    cell: str                     # the notebook section (markdown heading) that answers it
    asks: str                     # what the answer must say (the report template's prompt)
    tables: tuple[str, ...] = ()  # results/<profile>/tables/<name>.md, in report order
    figures: tuple[str, ...] = ()  # results/<profile>/figures/<name>.png

    @property
    def heading(self) -> str:
        return f"{self.key} · {self.title} (notebook {self.notebook[:2]})"


PART2 = "Part 2 project (earlier cohort's GPT)"

SECTIONS: tuple[Section, ...] = (
    Section("Setup", "The machine and software", "00_environment", "Profile",
            "Which GPUs, driver, CUDA, torch and data produced these numbers?", ("environment",)),
    Section("Q1", "Batch-size sweep on one GPU", "01_batch_size_sweep", "Reading the curve",
            "Epoch-2 training time (loader waits excluded) for batch 32, 128, 512, ... until the batch "
            "does not fit. Why does it fall, and where and why does it stop falling?",
            ("batch_sweep", "batch_sweep_phases", "batch_sweep_flops"), ("batch_sweep",)),
    Section("Q2", "Speedup on 1, 2 and 4 GPUs (Table 1)", "02_multi_gpu_scaling",
            "Table 1: time and speedup; Strong or weak scaling?",
            "Time and speedup per (GPUs, per-GPU batch). Is this strong or weak scaling? Would the "
            "other type of scaling be better or worse, and why?",
            ("scaling", "scaling_fixed_global_batch"), ("scaling_speedup",)),
    Section("Q3.1", "Compute vs communication (Table 2)", "03_compute_vs_communication",
            "Table 2: compute vs communication per epoch",
            "Compute T(1)/N and communication T(N) - T(1)/N for 2 and 4 GPUs per batch size; how do "
            "they compare with the measured exposed and total communication?",
            ("compute_vs_comm",), ("compute_vs_comm",)),
    Section("Q3.2", "Ring all-reduce bandwidth utilization (Table 3)", "04_allreduce_bandwidth",
            "6 · Table 3: bandwidth utilization of the training runs",
            "Bytes each rank sends per epoch (2(P-1)/P x S bytes per step, S in bytes), the achieved "
            "bandwidth and its fraction of the measured peak.",
            ("allreduce_utilization", "allreduce_bytes", "allreduce_bench", "allreduce_fit",
             "allreduce_models", "allreduce_buckets"), ("allreduce_busbw",)),
    Section("Q4.1", "Large-batch accuracy after 5 epochs", "05_large_batch_training",
            "Reading the table and the figures",
            "Loss and test accuracy at epoch 5 with 512 per GPU on 4 GPUs against 128 on 1 GPU.",
            ("large_batch",), ("large_batch_accuracy_epoch", "large_batch_accuracy_time")),
    Section("Q4.2", "Why the large batch falls behind", "05_large_batch_training",
            "Why a large batch loses accuracy at a fixed learning rate and a fixed number of epochs",
            "Explain the gap: optimizer steps per epoch, learning rate per image, the noise of the "
            "gradient."),
    Section("Q5", "Remedies: linear learning-rate scaling and warm-up", "05_large_batch_training",
            "Reading the table and the figures",
            "Which remedy (Goyal et al. 2017) closed most of the gap in the same 5 epochs, and what "
            "happened in the first epoch of linear scaling without warm-up?", ("large_batch",),
            ("large_batch_lr",)),
    Section("Q6", "Why call DistributedSampler.set_epoch every epoch", "05_large_batch_training",
            "`set_epoch`: the same shuffle every epoch unless you ask for a new one",
            "What goes wrong without set_epoch, and why does nothing crash?"),
    Section("Q7", "What is communicated besides the gradients", "05_large_batch_training",
            "Are gradients the only thing communicated? No.",
            "List what DDP communicates besides the gradients, with bytes per step for the spec "
            "ResNet-18.", ("comm_accounting", "comm_accounting_wire")),
    Section(PART2, "GPT trained with DDP and gradient accumulation", "06_gpt_ddp",
            "Questions for your report",
            "Scaling at a fixed per-device batch (strong or weak?), compute vs communication per rank, "
            "the gradient-accumulation trade-off.",
            ("gpt_scaling", "gpt_compute_vs_comm", "gpt_rank_breakdown", "gpt_accumulation", "gpt_samples"),
            ("gpt_accumulation",)),
    Section(PART2, "Int8 quantization of the GPT", "07_quantization", "What these measurements say",
            "Size, quality (loss) and speed of each variant on each device; when does int8 pay?",
            ("quantization",), ("quantization_quality_vs_speed",)),
    Section("Extra", "Speed limits of ResNet-18 on CIFAR-10", "08_speed_limits",
            "5 · The lesson for notebooks 01-03",
            "Which step of the waterfall gave the largest speed-up, and what bounds the spec path?",
            ("fastpath_loader", "fastpath_waterfall", "fastpath_top_ops", "fastpath_accuracy"),
            ("fastpath_waterfall",)),
    Section("Extra", "Projection to 8 ... 1024 GPUs", "04_allreduce_bandwidth",
            "7 · Projection to 8 … 1024 devices",
            "How does the fitted ring model scale the epoch past the hardware at hand?",
            ("allreduce_projection", "allreduce_inputs"), ("allreduce_projection_efficiency",)),
)


def sections_for(notebook: str) -> list[Section]:
    """The sections a notebook answers (``"01"`` or ``"01_batch_size_sweep"``)."""
    return [s for s in SECTIONS if s.notebook.startswith(str(notebook))]


def labels_for(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: the questions a notebook answers, for its title cell."""
    keys: list[str] = []
    for s in sections_for(notebook):
        if s.key not in keys:
            keys.append(s.key)
    return ", ".join(keys)


def question_map_markdown() -> str:
    """The README's question map: question, notebook, section (cell), tables, figures."""
    lines = ["| question | notebook | cell (section) | tables (`tables/<name>.md`) "
             "| figures (`figures/<name>.png`) |", "|---|---|---|---|---|"]
    for s in SECTIONS:
        tables = ", ".join(f"`{t}`" for t in s.tables) or "(in the notebook)"
        figures = ", ".join(f"`{f}`" for f in s.figures) or "-"
        cell = s.cell.replace("|", "\\|")
        lines.append(f"| **{s.key}** {s.title} | `{s.notebook}` | {cell} | {tables} | {figures} |")
    return "\n".join(lines)


def report_template() -> str:
    """Markdown a student fills in: one slot per answer, with the tables and figures to paste."""
    lines = ["# Report: deep-learning training performance", "",
             "Profile: `full` · GPUs: ... · date: ...", ""]
    for s in SECTIONS:
        lines += [f"## {s.heading}", "", f"_{s.asks}_", ""]
        for t in s.tables[:1]:
            lines += [f"<!-- paste results/<profile>/tables/{t}.md -->", ""]
        for f in s.figures[:1]:
            lines += [f"![{f}](figures/{f}.png)", ""]
        lines += ["**Answer:** ...", ""]
    return "\n".join(lines).rstrip() + "\n"
