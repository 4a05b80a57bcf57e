def compute_and_comm(t1_seconds, tn_seconds, devices):
    """(compute seconds, communication seconds) on `devices` devices by the assignment's method (a)."""
    share = 1 / devices
    return (share * t1_seconds, tn_seconds + (-share) * t1_seconds)
