"""One experiment per notebook, each of one shape: a ``Settings`` dataclass (its quick and full values
registered in :mod:`lab_utils.core.profiles`), ``measure(lab, settings) -> list[Record]`` (through the
store's one door, so a re-run measures only what is missing), then tables and figures from those
records in a module of their own.

- :mod:`~lab_utils.experiments.sweep`        01 batch-size sweep on one device (tables: ``sweep_tables``)
- :mod:`~lab_utils.experiments.scaling`      02 DataParallel/DDP scaling (``scaling_tables``), 03 compute
                                             vs communication (``compute_vs_comm``)
- :mod:`~lab_utils.experiments.comm`         04 all-reduce bandwidth and the ring model (``comm_tables``)
- :mod:`~lab_utils.experiments.large_batch`  05 large-batch accuracy (``large_batch_tables``) and the
                                             communication ledger (``accounting_tables``)
- :mod:`~lab_utils.experiments.gpt`          06 the GPT trained with DDP and gradient accumulation
                                             (``gpt_tables``, ``gpt_samples``)
- :mod:`~lab_utils.experiments.quantize`     07 int8 quantization (``quantize_tables``; its worker and
                                             ``quant_*`` modules are in :mod:`lab_utils.workers`)
- :mod:`~lab_utils.experiments.fastpath`, :mod:`~lab_utils.experiments.bench_timers`
                                             08 speed limits: the fast path (``fast_train``,
                                             ``fastpath_tables``) and timer overhead
"""
