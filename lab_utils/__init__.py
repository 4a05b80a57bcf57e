"""lab_utils: the tested package behind the deep-learning training-performance lab.

Notebooks in ``labs/`` stay thin and call into it. It is laid out for its three readers, in four floors;
each imports only its own floor and those below it (``tests/test_architecture.py`` checks):

- :mod:`lab_utils.learn`        what a student reads: the training loop, timers, rank aggregation,
                                communication hooks, ring formulas, the hand-made DDP, FLOPs, the
                                metrics glossary, the models; imports torch and itself only
- :mod:`lab_utils.engine`       what runs an experiment: settings and profiles, the plan and its
                                measure, torchrun launching, the worker harness, records and the store,
                                the machine and its hardware
- :mod:`lab_utils.experiments`  one package per notebook (``n01_batch_sweep`` ... ``n09_build_ddp``:
                                its settings, plan, workers and tables), ``shared/`` and the registry
- :mod:`lab_utils.app`          what instructors and the command line use: ``python -m lab_utils``,
                                the headless runner, doctor, the hand-in, the time budget, grading
"""

from lab_utils.learn.errors import LabError

__all__ = ["LabError"]
__version__ = "0.1.0"
