"""What runs an experiment: the settings, the plan and its measure, torchrun launching, the worker
harness, records and the result store, the machine, the distributed context, hardware facts.
"""
