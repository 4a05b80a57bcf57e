"""Notebook 09: data parallelism built by hand.
"""
