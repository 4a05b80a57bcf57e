"""Notebook 06: a GPT trained with DDP and gradient accumulation.
"""
