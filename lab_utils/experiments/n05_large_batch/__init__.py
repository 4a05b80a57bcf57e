"""Notebook 05: large-batch accuracy and what DDP communicates (Q5-Q7).
"""
