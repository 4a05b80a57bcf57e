"""What a student reads: the training loop, timers, rank aggregation, communication hooks, ring formulas,
the hand-made DDP, FLOPs, speedup, schedules, spread, the glossary, the models. Imports torch and itself
only (tests/test_architecture.py checks).
"""
