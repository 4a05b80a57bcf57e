"""torchrun entry points: argv -> settings -> the core loop -> records.

Each is started by :func:`lab_utils.launcher.launch` (``python -m lab_utils.workers.<name>``),
one process per rank. They import the core, the models and the store, never an experiment.
"""
