"""The glossary: every metric name a record holds, its one definition, and its unit.

One meaning per name, everywhere in the lab (a sweep record, a DDP rank, a GPT epoch, a
table's note). A name that would mean something else gets another name: ``images_per_s``
is always over ``train_seconds`` (loader waits excluded), the fast path's rate over the
whole epoch is ``epoch_images_per_s``, the loader's own ``loader_images_per_s`` (of its
``loader_images``, where ``images`` are always trained on). ``tests/test_metrics_glossary.py``
checks that no definition says the same thing twice.

Aggregates over the ranks of a DDP run (:mod:`lab_utils.learn.ranks`) add a suffix to a time
of this glossary: ``<name>_mean`` (the mean over ranks), ``<name>_max`` (the maximum),
``<name>_min`` (the minimum); :func:`define` resolves them. ``tests/test_notebooks.py`` checks
that every metric key a notebook run writes (top level, and in the ``epochs`` and ``ranks``
lists) is defined here.

Units: ``s`` seconds, ``us`` microseconds, ``bytes`` (decimal multiples in tables: MB = 1e6),
``GB/s`` decimal (1e9, as nccl-tests), ``count``, ``fraction`` (0..1), ``%`` (0..100),
``nats`` (natural-log cross-entropy), ``lr`` (a learning rate), ``-`` (text, a flag, or a
nested structure described in the definition).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Metric:
    """One metric: its name, what it is (what it includes and excludes), its unit."""

    name: str
    definition: str
    unit: str


_ENTRIES: tuple[tuple[str, str, str], ...] = (
    # ---------------------------------------------------------------- one epoch (core.loop.run_epoch)
    ("epoch", "1-based index of the epoch a value belongs to", "count"),
    ("reported_epoch", "the epoch whose values the record reports at its top level (the last one; epoch 1 "
     "warms up)", "count"),
    ("epoch_seconds", "wall time of one training pass over the epoch's batches, from the first batch "
     "request to the end of the last step, device synchronized at both ends; loader waits INCLUDED, "
     "evaluation and validation excluded. An aggregate over ranks: the slowest rank's (max)", "s"),
    ("train_seconds", "training time of the epoch: data movement + compute + communication, each a "
     "synchronized phase; waiting on the loader EXCLUDED (this rank's, and in DDP the wait for the other "
     "ranks' loaders, skew_wait_seconds). The spec's reported time. An aggregate over ranks: the slowest "
     "rank's (max): T(N)", "s"),
    ("data_loading_seconds", "time blocked on this process's data loader (the next() of each batch)", "s"),
    ("data_movement_seconds", "host-to-device copies of the batches", "s"),
    ("compute_seconds", "forward, loss, backward and optimizer step (DDP's exposed gradient all-reduce wait "
     "moved out to communication when a comm hook times it)", "s"),
    ("communication_seconds", "exposed communication inside training: the wait at the end of backward for "
     "all-reduces still running (with a comm hook) plus the end-of-epoch reduction of the loss sums", "s"),
    ("skew_wait_seconds", "DDP: time in the barrier before each synchronizing micro-step, waiting for the "
     "slowest rank's loader; not training time (0 with one rank)", "s"),
    ("train_plus_skew_wait_seconds", "max over ranks of train_seconds + skew_wait_seconds: about what T(N) "
     "was before the skew barrier existed", "s"),
    ("images", "training samples (images; sequences for a GPT) the epoch trained on (all ranks for an "
     "aggregate)", "count"),
    ("images_per_s", "training images / train_seconds (loader waits excluded); aggregate: all ranks' images "
     "/ the slowest rank's train_seconds", "images/s"),
    ("epoch_images_per_s", "training images / epoch_seconds (loader waits INCLUDED): the fast path's rate",
     "images/s"),
    ("loader_images", "the loader benchmark: images its full passes delivered (no model trains)", "count"),
    ("loader_images_per_s", "the loader benchmark: loader_images / its seconds of wall time (no model)",
     "images/s"),
    ("steps", "optimizer steps in the epoch (per rank; the maximum over ranks for an aggregate)", "count"),
    ("micro_steps", "forward/backward passes in the epoch (= batches; = steps without accumulation)",
     "count"),
    ("loss", "mean training loss over the samples this process trained on in the epoch", "nats"),
    ("accuracy", "training accuracy over the samples this process trained on in the epoch", "fraction"),
    ("train_loss", "mean training loss over the epoch's samples of ALL ranks (all-reduced)", "nats"),
    ("train_accuracy", "training accuracy over the epoch's samples of all ranks (all-reduced)", "fraction"),
    ("train_loss_rank", "mean training loss over this rank's samples of the epoch", "nats"),
    ("train_accuracy_rank", "training accuracy over this rank's samples of the epoch", "fraction"),
    ("global_loss", "run_epoch with global_sums: mean training loss over all ranks' samples (as train_loss)",
     "nats"),
    ("global_accuracy", "run_epoch with global_sums: training accuracy over all ranks' samples", "fraction"),
    ("global_images", "samples all ranks trained on in the epoch (the all-reduced count)", "count"),
    ("lr", "learning rate of the epoch's last optimizer step", "lr"),
    ("sample_order_head", "the first indices the rank's DistributedSampler gave in the epoch (set_epoch "
     "check)", "-"),
    ("lr_first", "learning rate of the epoch's first optimizer step", "lr"),
    ("peak_memory_bytes", "device memory high-water mark (torch.cuda.max_memory_allocated) over the "
     "measured training pass(es), the fullest GPU; None on a CPU", "bytes"),
    ("peak_memory_bytes_per_device", "DataParallel: each GPU's high-water mark, in device_ids order",
     "bytes"),
    ("elapsed_seconds", "wall time from the start of epoch 1 to the end of this epoch, evaluation included "
     "(slowest rank): for accuracy-against-wall-clock plots", "s"),
    ("cumulative_train_seconds", "sum of train_seconds up to this epoch", "s"),
    ("warmup_train_seconds", "train_seconds of the warm-up epoch (epoch 1)", "s"),
    ("warmup_data_loading_seconds", "data_loading_seconds of the warm-up epoch (epoch 1)", "s"),
    ("warmup_epoch_seconds", "epoch_seconds of the warm-up epoch (epoch 1)", "s"),
    ("steps_per_epoch", "optimizer steps per epoch (per rank)", "count"),
    ("ms_per_step", "1000 x train_seconds / steps: the mean training time of one optimizer step", "ms"),
    ("batches_per_epoch", "batches per epoch per rank (= steps_per_epoch x accumulation steps)", "count"),
    ("batch_size", "samples per batch (per device)", "count"),
    ("step_train_seconds_p10", "10th percentile over the epoch's optimizer steps of one step's training "
     "time (its data movement + compute + communication, the phases train_seconds sums; loader wait and "
     "skew wait excluded). An aggregate over ranks: that of the rank whose train_seconds is T(N)", "s"),
    ("step_train_seconds_p50", "50th percentile (median) of a step's training time over the epoch's "
     "optimizer steps, as step_train_seconds_p10", "s"),
    ("step_train_seconds_p90", "90th percentile of a step's training time over the epoch's optimizer steps, "
     "as step_train_seconds_p10", "s"),
    ("step_train_seconds_sd", "sample standard deviation of a step's training time over the epoch's "
     "optimizer steps, as step_train_seconds_p10: sd x sqrt(steps) is the standard error of train_seconds",
     "s"),
    ("cpu_cap_peak_step_bytes", "CPU memory cap: the largest model state + saved activations of one step",
     "bytes"),
    ("memory_limit_bytes", "the memory a sweep run may hold: the GPU's total memory times the per-process "
     "share set (memory_fraction, memory_cap_bytes), or the CPU memory cap; None on a CPU without a cap",
     "bytes"),
    # ---------------------------------------------------------------- a row's time's spread (core.spread)
    ("repeats", "measurements of one configuration merged into a table's row (REPEATS; ok ones)", "count"),
    ("train_seconds_median", "a table row's time: the median over the row's ok repeats of their "
     "train_seconds (one measurement: its own). Tables 1 and 2: T(N). The merged record's train_seconds "
     "stays the repeat's whose phases it holds", "s"),
    ("spread_pct", "the spread of a row's time, in percent of it: one run, 100 x (p90 - p10) / p50 of its "
     "per-step training times; with repeats, 100 x (max - min) / median of the repeats' train_seconds "
     "(the row's time is then that median). Tables 2 and 3: the spread of T(N)", "%"),
    ("spread_of", "which spread spread_pct is, in words: 'p10-p90 of S steps' or 'min-max of R repeats'",
     "-"),
    ("spread_low_seconds", "the low end of the row's time's spread: min over the repeats, or one run's time "
     "x p10/p50 of its step times", "s"),
    ("spread_high_seconds", "the high end of the row's time's spread: max over the repeats, or one run's "
     "time x p90/p50 of its step times", "s"),
    ("stderr_seconds", "the standard error of a row's time: one run, step_train_seconds_sd x sqrt(steps) "
     "(steps taken as independent: no run-to-run variation in it); with repeats, stdev / sqrt(R) of the "
     "repeats' train_seconds", "s"),
    ("stderr_pct", "stderr_seconds in percent of the row's time", "%"),
    ("speedup_noise_flag", "Table 1: |T(N) - T(1)| <= 2 x their standard errors combined, so the speedup is "
     "not distinguishable from 1. Blank: distinguishable, or no standard error to judge by", "-"),
    ("comm_a_stderr_seconds", "Table 2: the standard error of communication (a) = T(N) - T(1)/N, "
     "sqrt(se(T(N))^2 + (se(T(1))/N)^2)", "s"),
    ("comm_a_noise_flag", "Table 2: |communication (a)| <= 2 x comm_a_stderr_seconds, so (a) is not "
     "distinguishable from 0. Blank: distinguishable, or no standard error to judge by", "-"),
    # ---------------------------------------------------------------- over ranks (core.ranks)
    ("world_size", "processes (ranks) of the run", "count"),
    ("slowest_rank", "the rank with the longest epoch_seconds: its breakdown is the aggregate's", "-"),
    ("fastest_rank", "the rank with the shortest epoch_seconds", "-"),
    ("imbalance", "slowest / fastest rank's epoch_seconds", "ratio"),
    ("rank", "the process's rank in the group", "-"),
    ("ranks", "one entry per rank, rank 0 first: that rank's own values of the record, whose keys are in "
     "this glossary (a training rank's epoch values; a ledger rank's byte and call counts)", "-"),
    ("epochs", "the per-epoch history: one entry per epoch (keys in this glossary)", "-"),
    ("time_rule", "how the record's times were taken over ranks, in words", "-"),
    # ---------------------------------------------------------------- evaluation (core.loop.evaluate)
    ("test_loss", "mean loss over the test split (all ranks' shards for DDP)", "nats"),
    ("test_accuracy", "accuracy over the test split (all ranks' shards for DDP)", "fraction"),
    ("test_images", "test samples evaluated", "count"),
    ("test_seconds", "wall time of one evaluation pass, device synchronized", "s"),
    ("eval_seconds", "DDP: wall time of the evaluation (rank 0's BatchNorm broadcast, every shard, the sums "
     "all-reduced), slowest rank", "s"),
    ("val_loss", "GPT: mean next-token loss on the validation split (all ranks' shards)", "nats"),
    ("validation_seconds", "GPT: wall time of the validation pass after an epoch (not in epoch_seconds)",
     "s"),
    # ---------------------------------------------------------------- communication (core.comm_hooks)
    ("allreduce_seconds", "(c) per epoch: the time a gradient all-reduce was in flight (DDP comm hook, union "
     "over buckets), measured on the no_sync probe's steps: their mean per step x the epoch's steps", "s"),
    ("epoch_allreduce_seconds", "the comm hook's all-reduce time in flight during the epoch's own training "
     "steps, summed (the same hook as allreduce_seconds, not the probe)", "s"),
    ("exposed_tail_seconds", "the hook's in-step estimate of (b): last bucket ready -> backward returned, "
     "summed over the epoch's steps", "s"),
    ("exposed_comm_seconds", "(b): exposed communication per epoch = (step with gradient sync - the same "
     "step under no_sync) x steps (the probe)", "s"),
    ("exposed_comm_noise_seconds", "standard error of (b), scaled like exposed_comm_seconds", "s"),
    ("overlap_seconds", "(c) - (b), at least 0: all-reduce time hidden behind backward", "s"),
    ("overlap_fraction", "overlap_seconds / (c)", "fraction"),
    ("comm_probe", "the no_sync probe's per-step values (lab_utils.learn.comm_hooks.CommProbe fields)", "-"),
    ("allreduce_buckets", "DDP gradient buckets seen by the comm hook", "count"),
    ("bucket_bytes", "the bytes of each DDP gradient bucket, in the order DDP all-reduces them each step "
     "(the first: the last layers' gradients, ready first; the last: the first layers', ready when "
     "backward ends), as DDP rebuilt them after the first backward", "bytes"),
    ("gradient_bytes", "fp32 gradient size S = parameters x 4", "bytes"),
    ("parameters", "trainable parameters of the model", "count"),
    # ---------------------------------------------------------------- a DDP run (workers.ddp)
    ("startup_seconds", "slowest rank: building the data sets and this configuration's loaders, model, DDP "
     "wrapper and optimizer (process start-up and import torch not included)", "s"),
    ("worker_seconds", "rank 0: the data sets plus this configuration from set-up to the gathered results",
     "s"),
    ("global_batch", "samples per optimizer step over all ranks = per-device batch x ranks x accumulation",
     "count"),
    ("peak_lr", "the learning rate at the end of warm-up (linear rule: lr x global batch / base batch)",
     "lr"),
    ("warmup_steps", "optimizer steps of the linear warm-up", "count"),
    ("accumulation_steps", "micro-batches per optimizer step on each device", "count"),
    ("accumulation_note", "how an accumulation run emulates more devices, in words", "-"),
    ("debug_note", "TEST KNOB: says a rank's loader was slowed on purpose", "-"),
    ("backend", "process-group backend: nccl | gloo | single process (DataParallel) | None (one process)",
     "-"),
    ("device_type", "cuda | cpu", "-"),
    ("threads_per_rank", "torch intra-op threads of each rank", "count"),
    ("threads_pinned", "DataParallel: the torch thread count was set for the run (and restored)", "-"),
    # ---------------------------------------------------------------- the GPT (workers.gpt_train)
    ("tokens", "training tokens of the epoch (all ranks for an aggregate) = sequences x block size", "count"),
    ("sequences", "training sequences of the epoch (all ranks for an aggregate)", "count"),
    ("tokens_per_s", "training tokens / train_seconds (loader waits EXCLUDED); aggregate: all ranks' tokens "
     "/ the slowest rank's train_seconds", "tokens/s"),
    ("epoch_tokens_per_s", "the GPT: training tokens / epoch_seconds of an uninstrumented pass (device "
     "synchronized at its two ends only, loader waits INCLUDED); aggregate: all ranks' tokens / the slowest "
     "rank's epoch_seconds", "tokens/s"),
    ("mfu", "model FLOPs utilization: flops_per_token x epoch_tokens_per_s / (devices x peak FLOP/s) "
     "(lab_utils.learn.flops.mfu); None where the peak is unknown (CPUs)", "fraction"),
    ("breakdown", "the GPT: the instrumented pass after the last epoch (breakdown_steps optimizer steps, "
     "every phase synchronized, the comm hook read, the skew barrier under DDP): its epoch entry (a "
     "rank's) or their aggregate over ranks, seconds over the pass", "-"),
    ("timer_overhead_ratio", "the GPT: the instrumented pass's epoch_seconds per optimizer step / the "
     "reported uninstrumented epoch's (slowest ranks): what the timers' synchronizations cost the run",
     "ratio"),
    ("flops_per_token", "training FLOPs per token, counted by FlopCounterMode", "FLOP"),
    ("flops_per_token_formula", "training FLOPs per token by 6N + 12LCT", "FLOP"),
    ("peak_flops_per_s", "the device's dense peak at the run's precision; None when unknown", "FLOP/s"),
    ("precision", "the precision the peak is taken at: fp32 | tf32 | bf16", "-"),
    ("precision_note", "why the precision differs from the dtype asked (bf16 where the device has no native "
     "bf16 runs fp32), in words; None when it does not", "-"),
    ("device_name", "the device's name (the GPU model, or cpu)", "-"),
    ("corpus", "the text corpus trained on", "-"),
    ("train_windows", "training windows of block-size tokens", "count"),
    ("tokens_per_step", "tokens per optimizer step over all ranks", "count"),
    ("total_steps", "optimizer steps planned for the run", "count"),
    ("steps_done", "optimizer steps the run took", "count"),
    ("saved_activation_bytes", "bytes autograd keeps for backward after one micro-batch's forward", "bytes"),
    ("checkpoint", "path of the saved model", "-"),
    ("timers", "a rank's nested timers over the whole run: rows of timer, count, total_seconds, mean_seconds "
     "(per call); an aggregate's: the slowest rank's (of the reported epoch)", "-"),
    # ---------------------------------------------------------------- the all-reduce benchmark
    ("time_us", "microseconds per all-reduce of one message, the slowest rank", "us"),
    ("compute_seconds_per_step", "one training step on one device (forward, loss, backward, SGD step) on "
     "random tensors already there, mean over the timed steps after untimed warm-up ones", "s"),
    ("time_us_min_rank", "microseconds per all-reduce, the fastest rank", "us"),
    ("algbw_gb_per_s", "algorithm bandwidth S / t (nccl-tests)", "GB/s"),
    ("busbw_gb_per_s", "bus bandwidth algbw x 2(n-1)/n (nccl-tests)", "GB/s"),
    ("correct", "the all-reduce's sum was right on every rank", "-"),
    ("count", "fp32 elements in the message", "count"),
    ("note", "why a row runs where it runs, or what limits it, in words", "-"),
    ("run_id", "the store's id of one measurement session: rows compared side by side share it", "-"),
    ("group_runs", "configurations of the together group that run_id's launch measured: a run_id with "
     "fewer stored runs was stopped part-way, and its group is measured again whole", "count"),
    # ---------------------------------------------------------------- the communication ledger
    ("model_bytes", "the model's parameter and buffer sizes (ModelBytes fields)", "-"),
    ("ledger", "payload bytes and calls per (phase, collective)", "-"),
    ("wire", "per phase: occurrences, payload bytes counted and bytes this process wrote (wchar of "
     "/proc/self/io), both per occurrence, and with 2 ranks the bytes the algorithms imply it writes", "-"),
    ("wire_measured", "the bytes written (wire) could be read (gloo on Linux)", "-"),
    ("parameters_equal_after_init", "every rank held rank 0's parameters after DDP's broadcast", "-"),
    ("sgd_state_bytes", "SGD momentum bytes this rank holds", "bytes"),
    ("zero_state_bytes", "ZeRO-1: momentum bytes this rank holds (its shard)", "bytes"),
    ("zero_consolidated_state_bytes", "ZeRO-1: momentum bytes consolidated onto rank 0", "bytes"),
    # ---------------------------------------------------------------- data parallelism by hand (notebook 09)
    ("implementations", "notebook 09: one entry per implementation of the configuration (its name, bucket_mb "
     "and the values below)", "-"),
    ("implementation", "local (no communication) | naive | per_tensor | flat | bucketed | zero1 | ddp | "
     "ddp_bf16", "-"),
    ("bucket_mb", "bucket cap in MiB (2^20 bytes), as DDP's bucket_cap_mb; None: one bucket (bucketed) or "
     "none (the others)", "MiB"),
    ("check_steps", "K: steps of the correctness check", "count"),
    ("timed_steps", "rounds of a comparison whose steps are timed (each steps every implementation once)",
     "count"),
    ("dtype", "the dtype the check's parameters (or the bf16 hook's gradients) were held in", "-"),
    ("max_abs_diff", "largest |parameter - the one-process reference| after K steps over ranks and elements",
     "-"),
    ("equal", "torch.allclose(parameters, reference, rtol, atol) on every rank; None for a lossy hook", "-"),
    ("rtol", "relative tolerance of the check (lab_utils.learn.handmade.TOLERANCE)", "-"),
    ("atol", "absolute tolerance of the check", "-"),
    ("last_step_loss", "mean loss of an implementation's last step over all ranks' samples", "nats"),
    ("step_seconds", "from a barrier to the end of the optimizer step, the slowest rank's; median over the "
     "timed steps", "s"),
    ("step_seconds_p10", "10th percentile of step_seconds over the timed steps", "s"),
    ("step_seconds_p90", "90th percentile of step_seconds over the timed steps", "s"),
    ("comm_exposed_seconds", "a step minus the no-communication step of the same round; median over the "
     "rounds", "s"),
    ("comm_exposed_seconds_p10", "10th percentile of comm_exposed_seconds over the rounds", "s"),
    ("comm_exposed_seconds_p90", "90th percentile of comm_exposed_seconds over the rounds", "s"),
    ("messages", "the collectives of one step: [kind, bytes of the buffer]", "-"),
    ("bytes_per_rank_per_step", "ring bytes one rank sends per step: 2(P-1)/P x S per all-reduce, half per "
     "reduce-scatter or all-gather", "bytes"),
    ("overlaps", "the collectives start during backward (per_tensor, bucketed, DDP)", "-"),
    ("backward_seconds", "notebook 09: the no-communication replica's backward pass alone (the loop's "
     "backward timer, device synchronized at both ends), mean over the comparison's steps, the slowest "
     "rank's", "s"),
    ("optimizer", "the optimizer of a memory row: sgd (the recipe) or adam (torch's defaults)", "-"),
    ("held_bytes", "notebook 09: tensor bytes an implementation keeps between steps on one rank (model, "
     "gradients, optimizer state, its buffers), counted from before it was built; the largest over ranks",
     "bytes"),
    ("peak_bytes", "notebook 09: the most tensor bytes allocated at once during one step (held_bytes plus "
     "activations and temporaries); GPU: max_memory_allocated, CPU: the profiler's allocation events; the "
     "largest over ranks", "bytes"),
    ("optimizer_state_bytes", "bytes of the tensors the optimizer keeps between steps on one rank (SGD's "
     "momentum; Adam's two moments); the largest over ranks", "bytes"),
    ("parameter_bytes", "bytes of the model's parameters (one copy)", "bytes"),
    ("tensors", "parameter tensors of the model (each one message for the naive all-reduce)", "count"),
    ("bench_time_us", "notebook 09's own all-reduce timing: microseconds per size, the slowest rank's mean, "
     "best of 3 sweeps", "us"),
    ("fit", "alpha-beta fit of bench_time_us (AlphaBetaFit fields), or why there is none (problem)", "-"),
    ("trace_paths", "every rank's Chrome trace, in rank order", "-"),
    # ---------------------------------------------------------------- the fast path
    ("seconds", "the loader benchmark's wall time over its passes", "s"),
    ("passes", "full passes over the images", "count"),
    ("ratio_to_spec", "rate over the spec row's rate, measured in the same session", "ratio"),
    ("adds", "what a waterfall step adds, in words", "-"),
    ("description", "the training options of the row, in words", "-"),
    ("warmup_seconds", "untimed warm-up steps before the timed epoch (compilation included)", "s"),
    ("compile_seconds", "the warm-up of a torch.compile row: compilation included", "s"),
    ("train_flops_per_image", "training FLOPs per image (forward + backward, FlopCounterMode)", "FLOP"),
    ("achieved_tflops_per_s", "train_flops_per_image x epoch_images_per_s / 1e12", "TFLOP/s"),
    ("peak_precision", "the precision the row's peak is taken at", "-"),
    ("train_tflops_per_s", "train_flops_per_image x images_per_s / 1e12: the sweep's FLOP rate over "
     "train_seconds (loader waits excluded)", "TFLOP/s"),
    ("percent_of_peak", "the record's FLOP rate (achieved_tflops_per_s, or the sweep's train_tflops_per_s) / "
     "the device's dense peak at peak_precision", "%"),
    ("sgd_resolved", "the SGD implementation that ran", "-"),
    ("graphs_compiled_in_epoch", "graphs torch.compile compiled inside the timed epoch", "count"),
    ("onednn_workaround", "the oneDNN defect workaround applied, in words", "-"),
    ("trace_path", "the Chrome/Perfetto trace file", "-"),
    ("trace_bytes", "size of the trace file", "bytes"),
    ("steps_traced", "training steps under the profiler", "count"),
    ("top_ops", "the profiler's top operators (rows)", "-"),
    # ---------------------------------------------------------------- quantization
    ("payload_bytes", "bytes of the serialized weights (tensors only)", "bytes"),
    ("size_bytes", "bytes of the saved model file", "bytes"),
    ("eval_tokens", "held-out tokens the loss is measured on", "count"),
    ("perplexity", "exp(val_loss)", "ratio"),
    ("ms_per_token_b1", "batch-1 decoding: median milliseconds per generated token", "ms"),
    ("ms_per_token_b1_min", "batch-1 decoding: fastest repetition, ms per token", "ms"),
    ("ms_per_token_b1_max", "batch-1 decoding: slowest repetition, ms per token", "ms"),
    ("tokens_per_s_b1", "batch-1 decoding: generated tokens per second of decoding wall time (median)",
     "tokens/s"),
    ("tokens_per_s_large", "large-batch decoding: generated tokens per second of decoding wall time "
     "(median)", "tokens/s"),
    ("tokens_per_s_large_min", "large-batch decoding: slowest repetition", "tokens/s"),
    ("tokens_per_s_large_max", "large-batch decoding: fastest repetition", "tokens/s"),
    ("seconds_b1", "batch-1 decoding: total timed wall time", "s"),
    ("seconds_large", "large-batch decoding: total timed wall time", "s"),
    ("large_batch", "the batch of the throughput measurement", "count"),
    ("mean_context_tokens", "mean context length while decoding", "count"),
    ("weight_flops_per_byte_b1", "arithmetic intensity of the weight matmuls at batch 1", "FLOP/byte"),
    ("weight_flops_per_byte_large", "arithmetic intensity of the weight matmuls at the large batch",
     "FLOP/byte"),
    ("kernel", "the matmul kernel the variant runs, in words", "-"),
    ("label", "the variant's label in tables", "-"),
    ("method", "how the variant was made, in words", "-"),
)

GLOSSARY: dict[str, Metric] = {n: Metric(n, d, u) for n, d, u in _ENTRIES}

#: Suffixes an aggregate over ranks adds to a time of the glossary (lab_utils.learn.ranks).
RANK_SUFFIXES = {"_mean": "mean over ranks", "_max": "maximum over ranks", "_min": "minimum over ranks"}


def define(name: str) -> Metric | None:
    """The glossary's entry for ``name`` (an aggregate's ``<time>_mean`` / ``_max`` / ``_min`` too)."""
    if name in GLOSSARY:
        return GLOSSARY[name]
    for suffix, what in RANK_SUFFIXES.items():
        base = name.removesuffix(suffix)
        if base != name and base in GLOSSARY and GLOSSARY[base].unit == "s":
            m = GLOSSARY[base]
            return Metric(name, f"{what} of {base}: {m.definition}", m.unit)
    return None


def unknown(names: Iterable[str]) -> list[str]:
    """The names that are not in the glossary (sorted)."""
    return sorted({n for n in names if define(n) is None})


def note(name: str) -> str:
    """``name: definition (unit)``, for a table's notes."""
    m = define(name)
    if m is None:
        raise KeyError(f"{name!r} is not in lab_utils.learn.metrics; define it there first")
    return f"{m.name}: {m.definition} ({m.unit})"


#: The metric that IS T(N) in notebooks 02 and 03 (and every speedup built on it): a table row's
#: ``train_seconds_median``, the median over its repeats (:func:`lab_utils.learn.spread.merge_repeats`) of an
#: aggregate record's ``train_seconds``, the slowest rank's (:func:`lab_utils.learn.ranks.aggregate_epoch`).
#: The GPT of notebook 06 times an uninstrumented pass instead: its T(N) is ``epoch_seconds``
#: (:data:`lab_utils.experiments.n06_gpt_ddp.tables.GPT_T_N`).
T_N = "train_seconds_median"


def value(record: Any, name: str) -> float | None:
    """The number ``name`` of an ``ok`` record's metrics; None (a blank table cell) when the record
    is missing, not ok, or does not hold it. ``value(rec, T_N)`` is T(N)."""
    if record is None or getattr(record, "status", None) != "ok":
        return None
    v = record.metrics.get(name)
    return float(v) if v is not None else None


def per_step(record: Any, name: str = T_N) -> float | None:
    """The record's ``name`` (T(N) by default) per optimizer step: ``value(record, name) / steps``; None when
    either is missing or the record is not ok. Table 1's ``TN_seconds_per_step`` and every t(1) per step."""
    v, steps = value(record, name), record.metrics.get("steps") if record is not None else None
    return v / steps if v is not None and steps else None


def is_missing(v: Any) -> bool:
    """None, NaN or not a number: a blank cell."""
    try:
        return math.isnan(float(v))
    except (TypeError, ValueError):
        return True
