"""Notebook 01: the single-GPU batch-size sweep (Q1).
"""
