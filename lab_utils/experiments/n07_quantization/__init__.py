"""Notebook 07: int8 quantization, measured side by side.
"""
