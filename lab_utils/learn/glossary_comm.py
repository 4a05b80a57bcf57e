""":mod:`lab_utils.learn.metrics`' communication entries: DDP's comm hook and no_sync probe, the all-reduce
benchmark, the communication ledger, data parallelism by hand (notebook 09)."""

ENTRIES: tuple[tuple[str, str, str], ...] = (
    # ---------------------------------------------------- communication (learn.comm_hooks, learn.comm_probe)
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
    ("comm_probe", "the no_sync probe's per-step values (lab_utils.learn.comm_probe.CommProbe fields)", "-"),
    ("allreduce_buckets", "DDP gradient buckets seen by the comm hook", "count"),
    ("bucket_bytes", "the bytes of each DDP gradient bucket, in the order DDP all-reduces them each step "
     "(the first: the last layers' gradients, ready first; the last: the first layers', ready when "
     "backward ends), as DDP rebuilt them after the first backward", "bytes"),
    ("gradient_bytes", "fp32 gradient size S = parameters x 4", "bytes"),
    ("parameters", "trainable parameters of the model", "count"),
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
)
