"""Notebook 00: the machine and the software stack every GPU number depends on."""
