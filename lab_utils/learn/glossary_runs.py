""":mod:`lab_utils.learn.metrics`' entries of whole runs: a DDP run, the GPT, the fast path, quantization."""

ENTRIES: tuple[tuple[str, str, str], ...] = (
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
