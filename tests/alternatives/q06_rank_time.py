def run_epoch_seconds(rank_seconds):
    """T(N) in seconds: the slowest rank's epoch time."""
    slowest = rank_seconds[0]
    for t in rank_seconds[1:]:
        if t > slowest:
            slowest = t
    return slowest
