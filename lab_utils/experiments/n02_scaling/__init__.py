"""Notebook 02: DataParallel and DDP scaling, T(N) and its prediction (Q2).
"""
