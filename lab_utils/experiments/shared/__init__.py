"""What several notebooks' packages share: the datasets, the earlier cohorts' anchors,
time estimates, and the row helpers of every table.
"""
