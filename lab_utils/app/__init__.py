"""What instructors and the command line use: ``python -m lab_utils``, the headless runner, doctor,
the hand-in, the time budget, the question map, grading and the docs pages.
"""
