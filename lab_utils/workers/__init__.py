"""torchrun entry points, one shape (:mod:`lab_utils.workers.harness`): a JSON job -> core loop -> records.

Each is started by :func:`lab_utils.plan.measure` (``python -m lab_utils.workers.<name> JOB.json``), one
process per rank. They import the core and the models, never the store nor an experiment.
"""
