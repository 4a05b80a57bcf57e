"""lab_utils: the tested package behind the deep-learning training-performance lab.

Notebooks in ``labs/`` stay thin and call into it. Its folders are its layers; each
imports only the layers listed before it (``tests/test_architecture.py`` checks):

- :mod:`lab_utils.core`         what a student reads: the one training loop and evaluate,
                                timers, the distributed context, ring formulas, data, machine
- :mod:`lab_utils.learn.models`       the CIFAR ResNet-18 and the GPT of part 2
- :mod:`lab_utils.engine.store`, :mod:`lab_utils.engine.launcher`, :mod:`lab_utils.profiles`
                                the result store, torchrun launching, every notebook's quick/full values
- :mod:`lab_utils.workers`      torchrun entry points (argv -> settings -> core loop -> records)
- :mod:`lab_utils.experiments`  one module per notebook
- the top: :mod:`lab_utils.app.runner` (headless execution, the report), ``python -m lab_utils``,
  grading, the question map, time estimates
"""

from lab_utils.learn.errors import LabError

__all__ = ["LabError"]
__version__ = "0.1.0"
