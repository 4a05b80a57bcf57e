""":mod:`lab_utils.learn.metrics`' training entries: one epoch, a row's spread, ranks, the evaluation."""

ENTRIES: tuple[tuple[str, str, str], ...] = (
    # ---------------------------------------------------------------- one epoch (learn.loop.run_epoch)
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
    # ---------------------------------------------------------------- a row's time's spread (learn.spread)
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
    # ---------------------------------------------------------------- over ranks (learn.ranks)
    ("world_size", "processes (ranks) of the run", "count"),
    ("slowest_rank", "the rank with the longest epoch_seconds: its breakdown is the aggregate's", "-"),
    ("fastest_rank", "the rank with the shortest epoch_seconds", "-"),
    ("imbalance", "slowest / fastest rank's epoch_seconds", "ratio"),
    ("rank", "the process's rank in the group", "-"),
    ("ranks", "one entry per rank, rank 0 first: that rank's own values of the record, whose keys are in "
     "this glossary (a training rank's epoch values; a ledger rank's byte and call counts)", "-"),
    ("epochs", "the per-epoch history: one entry per epoch (keys in this glossary)", "-"),
    ("time_rule", "how the record's times were taken over ranks, in words", "-"),
    # ---------------------------------------------------------------- evaluation (learn.evaluation.evaluate)
    ("test_loss", "mean loss over the test split (all ranks' shards for DDP)", "nats"),
    ("test_accuracy", "accuracy over the test split (all ranks' shards for DDP)", "fraction"),
    ("test_images", "test samples evaluated", "count"),
    ("test_seconds", "wall time of one evaluation pass, device synchronized", "s"),
    ("eval_seconds", "DDP: wall time of the evaluation (rank 0's BatchNorm broadcast, every shard, the sums "
     "all-reduced), slowest rank", "s"),
    ("val_loss", "GPT: mean next-token loss on the validation split (all ranks' shards)", "nats"),
    ("validation_seconds", "GPT: wall time of the validation pass after an epoch (not in epoch_seconds)",
     "s"),
)
