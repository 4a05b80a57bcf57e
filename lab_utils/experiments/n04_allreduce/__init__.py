"""Notebook 04: ring all-reduce bandwidth and Table 3 (Q4).
"""
