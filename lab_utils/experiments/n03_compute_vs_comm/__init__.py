"""Notebook 03: compute against communication per epoch, Table 2 (Q3); its experiment is
measured with notebook 02's
(:data:`~lab_utils.experiments.n02_scaling.experiment.COMPUTE_VS_COMM_EXPERIMENT`).
"""
