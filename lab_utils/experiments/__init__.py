"""One package per notebook (``n00_environment`` ... ``n09_build_ddp``), each of one shape: its ``__init__``
holds the notebook's report ``SECTIONS``; ``experiment.py`` its ``Settings`` (with their ``QUICK`` and
``FULL`` values), the plan of runs :func:`lab_utils.engine.plan.measure` carries out, and its ``EXPERIMENTS``;
its workers (``*worker.py``) and its tables. ``shared/`` holds what several notebooks use;
:mod:`~lab_utils.experiments.registry` lists the notebooks in order; ``README.md`` here is the recipe for a
new notebook.
"""
