"""The measured core: what a student reads to see how each number is taken.

It imports nothing of the lab above it (``tests/test_architecture.py`` checks):

- :mod:`~lab_utils.core.loop`         THE step loop, THE epoch driver ``run_epoch``, THE ``evaluate``
- :mod:`~lab_utils.core.ranks`        the one aggregation over ranks: the slowest rank defines T(N)
- :mod:`~lab_utils.core.metrics`      the glossary: every metric name, its one definition, its unit
- :mod:`~lab_utils.core.records`      the record and the one file protocol workers hand records back by
- :mod:`~lab_utils.core.timing`       phase timers that are correct under CUDA asynchrony
- :mod:`~lab_utils.core.comm_hooks`   DDP's gradient all-reduce timed by a comm hook, the ``no_sync`` probe
- :mod:`~lab_utils.core.dist`         one distributed context: init, backend, gather across ranks
- :mod:`~lab_utils.core.ring`         ring all-reduce bytes, the alpha-beta time model and its fit
- :mod:`~lab_utils.core.data`         the spec's CIFAR-10 loaders, the synthetic stand-in,
                                      the device-resident loader
- :mod:`~lab_utils.core.hardware`, :mod:`~lab_utils.core.environment`, :mod:`~lab_utils.core.cuda_builds`
                                      the machine: devices, peaks, versions, driver -> torch build
- :mod:`~lab_utils.core.backends`, :mod:`~lab_utils.core.memory`, :mod:`~lab_utils.core.onednn`,
  :mod:`~lab_utils.core.watchdog`     cuDNN/thread settings, OOM handling, a oneDNN workaround, time limits
- :mod:`~lab_utils.core.config`, :mod:`~lab_utils.core.schedules`, :mod:`~lab_utils.core.flops`,
  :mod:`~lab_utils.core.text_data`, :mod:`~lab_utils.core.errors`, :mod:`~lab_utils.core.progress`
"""
