"""One module per notebook's experiments, each of one shape: a ``Settings`` dataclass (quick and full values
in :mod:`lab_utils.engine.profiles`), a plan of runs carried out by :func:`lab_utils.engine.plan.measure`, and
its
tables and figures in a ``*_tables`` module. :mod:`~lab_utils.experiments.registry` lists them in notebook
order; ``README.md`` here is the recipe for a new notebook.
"""
