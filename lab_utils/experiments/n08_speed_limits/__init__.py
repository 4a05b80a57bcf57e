"""Notebook 08: how far each measurement is from the hardware's limit.
"""
