"""lab_utils: the tested package behind the deep-learning training-performance lab.

Notebooks in ``labs/`` stay thin and call into these modules:

- :mod:`lab_utils.config`   profiles (``quick`` / ``full``), paths, input checks
- :mod:`lab_utils.hardware` device discovery and peak FLOP/s by GPU name
- :mod:`lab_utils.data`     CIFAR-10 with the spec's transforms, and a synthetic stand-in
- :mod:`lab_utils.models`   the CIFAR ResNet-18 (and the GPT of part 2)
- :mod:`lab_utils.timing`   phase timers that are correct under CUDA asynchrony
- :mod:`lab_utils.train`    one epoch of training / evaluation, as a typed record
- :mod:`lab_utils.results`  the append-only result store, tables and figures
- :mod:`lab_utils.runner`   headless notebook execution and the report
"""

from lab_utils.errors import LabError

__all__ = ["LabError"]
__version__ = "0.1.0"
