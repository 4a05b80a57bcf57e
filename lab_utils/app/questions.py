"""Which notebook, section, table and figure answers which question of the assignment.

One ordered list (:data:`SECTIONS`, the assignment's numbering as SPEC.md gives it) is the single source
for everything that names a question: the question map (:func:`question_map_markdown`,
``docs/generated/question-map.md``, written by ``make docs``), the hand-in
(:func:`lab_utils.app.handin.build`), every notebook's "For your report" cell
(:func:`for_your_report_markdown`), the questions each notebook's title names (:func:`labels_for`) and the
order of ``results/<profile>/report.md``. The GPT (notebooks 06 and 07) is the *Part 2 project* an earlier
cohort did, not a question of the assignment; the extras are not either. The lab's own exercises are named
"Exercise NN-a", never with a number that could be the assignment's.

**Where answers are written.** A question graded by hand (``by_hand``: its otter name) is
answered once, in its notebook, in the cell under "<key> (graded by hand, N points)": the
student edition has that cell, ``make grade`` collects its text into the gradebook and
``grades/feedback/<student>.md`` next to the autograded points, so the grader reads every
student's answer in one place, beside the numbers it quotes. The report holds the tables and
figures, the formula Q3.2 asks for first, and every other question (``report``); its section
names the notebook cell instead of asking the hand-graded question a second time.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Section:
    """One question (or project part) of the report, and where the lab answers it."""

    key: str                      # "Q1", "Q3.1", PART2, "Extra"
    title: str                    # what the assignment asks, in a few words
    notebook: str                 # "01_batch_size_sweep"
    cell: str                     # the notebook section (markdown heading) that answers it
    asks: str                     # one line: what the answer must say (report.md's prompt)
    tables: tuple[str, ...] = ()  # results/<profile>/tables/<name>.md, in report order
    figures: tuple[str, ...] = ()  # results/<profile>/figures/<name>.png
    report: tuple[str, ...] = ()  # the questions answered in the report (template, "For your report")
    by_hand: str = ""             # otter name of the question graded by hand in the notebook
    by_hand_asks: str = ""        # what that notebook cell asks (its prompt after the label)
    first: str = ""               # asked before the tables (Q3.2: the all-reduce time formula)
    exercises: tuple[str, ...] = ()  # otter names of its autograded exercises, in notebook order

    @property
    def heading(self) -> str:
        return f"{self.key} · {self.title} (notebook {self.notebook[:2]})"

    @property
    def by_hand_label(self) -> str:
        """The bold label that opens the hand-graded cell, without its points: ``Q1 (graded by hand``."""
        return f"{self.label} (graded by hand"

    @property
    def label(self) -> str:
        """How the notebooks name this section: the key (``Q4.2``), or ``Part 2 project`` / ``Extra``."""
        return "Part 2 project" if self.key == PART2 else self.key


PART2 = "Part 2 project (earlier cohort's GPT)"

SECTIONS: tuple[Section, ...] = (
    Section("Setup", "The machine and software", "00_environment", "Profile",
            "Which GPUs, driver, CUDA, torch and data produced these numbers?", ("environment",)),
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
    Section("Q4.1", "Large-batch accuracy after 5 epochs", "05_large_batch_training",
            "Reading the table and the figures",
            "Loss and test accuracy at epoch 5 with 512 per GPU on 4 GPUs against 128 on 1 GPU.",
            ("large_batch",), ("large_batch_accuracy_epoch", "large_batch_accuracy_time"),
            by_hand="q05_accuracy",
            by_hand_asks="After 5 epochs, how far is the large batch at lr 0.1 behind the reference (loss, "
                         "train and test accuracy), and how many optimizer steps did each take? Which "
                         "accuracy did the earlier cohort report, and which of your columns do you set it "
                         "beside? Quote the rows of your table."),
    Section("Q4.2", "Why the large batch falls behind, and how to improve it", "05_large_batch_training",
            "Why a large batch loses accuracy at a fixed learning rate and a fixed number of epochs",
            "Explain the gap (optimizer steps per epoch, learning rate per image, the noise of the "
            "gradient), then improve it: linear learning-rate scaling and warm-up (Goyal et al. 2017).",
            ("large_batch",), ("large_batch_lr",),
            report=("At equal wall-clock time, which configuration is ahead? Would you pay for 4 GPUs to "
                    "train this model, and with which learning-rate rule?",),
            by_hand="q05_report", exercises=("q05_lr_schedule", "q05_recipe"),
            by_hand_asks="Why does the large batch at lr 0.1 fall behind the reference (one sentence, with "
                         "the optimizer steps of each run)? Which remedy closed most of the gap? Did "
                         "linear scaling alone work, and what happened in its first epoch? Quote the rows "
                         "of your table."),
    Section("Q5", "Why the epoch must be set on the DistributedSampler (set_epoch)",
            "05_large_batch_training",
            "`set_epoch`: which images a rank sees in each epoch",
            "What goes wrong without set_epoch, and why does nothing crash?",
            report=("What goes wrong if `set_epoch` is not called, and why does nothing crash? Quote two "
                    "epochs' indices from the notebook's set_epoch table.",),
            exercises=("q05_set_epoch",)),
    Section("Q6", "Are gradients the only messages communicated across learners?", "05_large_batch_training",
            "Are gradients the only thing communicated?",
            "List what DDP communicates besides the gradients, with bytes per step for the spec "
            "ResNet-18.", ("comm_accounting", "comm_accounting_wire"),
            by_hand="q05_messages",
            by_hand_asks="List what DDP communicates besides the gradients, with the bytes per step for the "
                         "spec ResNet-18 (11,173,962 parameters); quote the rows of your ledger. ZeRO-1 two "
                         "ways: torch's ZeroRedundancyOptimizer (the ledger's ZeRO-1 rows) and the paper's "
                         "(Rajbhandari et al. 2020, sec. 7.2.1: reduce-scatter the gradients, step each "
                         "rank's shard, all-gather the parameters). How many bytes does one rank send per "
                         "step in each, against DDP, and why do they differ? What does each save?"),
    Section("Q7", "At 4 GPUs x 512 per GPU, is communicating only the gradients enough?",
            "05_large_batch_training", "At 4 GPUs x 512 per GPU: is communicating only the gradients enough?",
            "Answer from the communication ledger at 4 x 512: what keeps the replicas identical, what else "
            "must cross the network, and what large-batch training needs beyond the gradients.",
            ("comm_gradients_only",),
            by_hand="q05_gradients_only",
            by_hand_asks="At 4 GPUs x 512 per GPU, is communicating only the gradients enough? Answer from "
                         "the ledger: what keeps the weights identical, which other messages the run needs "
                         "and what breaks without each (initial broadcast, BatchNorm buffers, loss and "
                         "metric reductions), what the large-batch remedies (linear scaling, warm-up) need, "
                         "and what share of the epoch's bytes is not gradients."),
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
                    "the GPU, uint8 shards)?")),
    Section("Extra", "Projection to 8 ... 1024 GPUs", "04_allreduce_bandwidth",
            "7 · Projection to 8 … 1024 devices",
            "How does the fitted ring model scale the epoch past the hardware at hand?",
            ("allreduce_projection", "allreduce_inputs"), ("allreduce_projection_efficiency",),
            report=("At how many devices does efficiency drop below 50 % for each per-GPU batch, and which "
                    "term (latency or bandwidth) causes it? Why do larger per-GPU batches scale further? "
                    "Which assumption is the most optimistic for a real multi-node cluster?",)),
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
                         "prediction; say whether the difference is larger than the spread."),
)

#: Every key of the assignment, in its order (the test's one table checks SECTIONS against it).
ASSIGNMENT_KEYS = ("Q1", "Q2", "Q3.1", "Q3.2", "Q4.1", "Q4.2", "Q5", "Q6", "Q7")


def section_of(question: str) -> Section | None:
    """The section a graded question (otter name: an exercise or a hand-graded answer) belongs to."""
    return next((s for s in SECTIONS if question in s.exercises or question == s.by_hand), None)


def exercise_letter(question: str) -> str:
    """An autograded exercise's letter in its notebook ("q04_ring_bytes" -> "b", as "Exercise 04-b")."""
    nn = question[1:3]
    ordered = [q for s in SECTIONS if s.notebook[:2] == nn for q in s.exercises]
    return "abcdefghij"[ordered.index(question)] if question in ordered else ""


def gradebook_column(question: str) -> str:
    """The gradebook's column for a graded question: the assignment's question, a short name and
    where it is, e.g. ``Q3.2 ring bytes (04-b)`` (Exercise 04-b) or ``Q1 report (01, by hand)``; the
    otter name itself for a question this map does not know."""
    section = section_of(question)
    if section is None:
        return question
    nn, short = question[1:3], question[4:].replace("_", " ")
    where = f"{nn}, by hand" if question == section.by_hand else f"{nn}-{exercise_letter(question)}"
    return f"{section.label} {short} ({where})"


def sections_for(notebook: str) -> list[Section]:
    """The sections a notebook answers (``"01"`` or ``"01_batch_size_sweep"``)."""
    return [s for s in SECTIONS if s.notebook.startswith(str(notebook))]


def labels_for(notebook: str) -> str:
    """``"Q4.1, Q4.2, Q5, Q6, Q7"``: the questions a notebook answers, for its title cell."""
    return ", ".join(dict.fromkeys(s.key for s in sections_for(notebook)))


def question_map_markdown() -> str:
    """The question map (``docs/generated/question-map.md``): question, notebook, section (cell), tables,
    figures, graded by hand."""
    lines = ["| question | notebook | cell (section) | tables (`tables/<name>.md`) | figures "
             "(`figures/<name>.png`) | graded by hand in the notebook |", "|---|---|---|---|---|---|"]
    for s in SECTIONS:
        tables = ", ".join(f"`{t}`" for t in s.tables) or "(in the notebook)"
        figures = ", ".join(f"`{f}`" for f in s.figures) or "-"
        cell = s.cell.replace("|", "\\|")
        by_hand = f"`{s.by_hand}`" if s.by_hand else "-"
        lines.append(f"| **{s.key}** {s.title} | `{s.notebook}` | {cell} | {tables} | {figures} "
                     f"| {by_hand} |")
    return "\n".join(lines)


def _wrapped(text: str, first: str = "", rest: str = "") -> list[str]:
    """``text`` wrapped at 96 columns (Markdown renders it the same; the notebook's diff stays readable)."""
    return textwrap.wrap(text, 96, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False,
                         break_long_words=False)


def for_your_report_markdown(notebook: str) -> str:
    """A notebook's "For your report" cell: per report section, the tables and figures ``make report`` puts
    in and the questions answered in the report (the hand-in's own words), and which question is graded by
    hand in the cell below."""
    lines = ["## For your report", ""]
    lines += _wrapped("`make report` writes your report (README, \"Handing in\"): it puts in your tables and "
                      "figures and leaves a slot for each of your answers. From this notebook:")
    for s in sections_for(notebook):
        shown = [f"`tables/{t}`" for t in s.tables] + [f"`figures/{f}.png`" for f in s.figures]
        what = f"In the report: {', '.join(shown)}." if shown else "No table or figure."
        end = "" if s.title.endswith("?") else "."
        then = " Then answer:" if s.report or s.first else ""
        lines += [""] + _wrapped(f"**{s.label}** · {s.title}{end} {what}{then}")
        if s.report or s.first:
            lines.append("")
        if s.first:
            lines += _wrapped(f"First, the formula. {s.first}", "- ", "  ")
        for q in s.report:
            lines += _wrapped(q, "- ", "  ")
    labels = [f"**{s.by_hand_label})**" for s in sections_for(notebook) if s.by_hand]
    if len(labels) == 1:
        lines += [""] + _wrapped(f"{labels[0]} is answered in the cell below, in this notebook, and graded "
                                 "there; the report does not ask it again.")
    elif labels:
        lines += [""] + _wrapped(f"{', '.join(labels[:-1])} and {labels[-1]} are answered in the cells "
                                 "below, in this notebook, each in its own cell, and graded there; the "
                                 "report does not ask them again.")
    return "\n".join(lines)


def by_hand_prompt(section: Section, points: int) -> str:
    """The prompt of a notebook's hand-graded cell: its bold label, then what it asks."""
    return "\n".join(_wrapped(f"**{section.by_hand_label}, {points} points).** {section.by_hand_asks}"))
