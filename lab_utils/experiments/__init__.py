"""One module per notebook: its settings, what one measurement runs, tables and figures.

- :mod:`~lab_utils.experiments.sweep`        01 batch-size sweep on one device
- :mod:`~lab_utils.experiments.scaling`      02 DataParallel/DDP scaling, 03 compute vs communication
- :mod:`~lab_utils.experiments.comm`         04 all-reduce bandwidth and the ring model
- :mod:`~lab_utils.experiments.large_batch`  05 large-batch accuracy and the communication ledger
- :mod:`~lab_utils.experiments.gpt`          06 the GPT trained with DDP and gradient accumulation
- :mod:`~lab_utils.experiments.quantize`     07 int8 quantization
- :mod:`~lab_utils.experiments.fastpath`, :mod:`~lab_utils.experiments.bench_timers`
                                             08 speed limits: the fast path and timer overhead

Every notebook's quick and full values live in :mod:`lab_utils.profiles`.
"""
