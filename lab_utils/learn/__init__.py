"""What a student reads: how each number of the lab is measured. Imports torch and itself only
(tests/test_architecture.py checks).
"""
