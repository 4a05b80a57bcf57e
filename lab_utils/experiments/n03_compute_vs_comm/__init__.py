"""Notebook 03: compute against communication per epoch, Table 2 (Q3); its experiment
(:data:`~lab_utils.experiments.n03_compute_vs_comm.experiment.COMPUTE_VS_COMM_EXPERIMENT`) runs notebook
02's settings through notebook 02's plan for it.
"""
